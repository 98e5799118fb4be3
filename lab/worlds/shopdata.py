"""The shop world's data: the gold dialog of any task (and the dialog of the divided habit),
every turn of any dialog labelled exactly, the paper's four contamination types written onto gold
turns by rule, and the released-schema files that `python -m lab.shop make-data` writes from them.

The world itself (tasks, tools, labels, `ShopEnv`) is envs.py's; the long worlds `shop-long` and
`shop-copy` lab/worlds/shop.py's; the command line lab/shop.py's.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path

import envs
import model
from lab.worlds import released

# ---------------------------------------------------------------------------------------------
# The world (envs.py's): tasks drawn from a seed, tools that really execute, exact labels
# ---------------------------------------------------------------------------------------------
# Every episode is drawn from one integer seed: a world (USD prices of SHOP_ITEMS at stores A-D,
# exchange rates) and a task, "What is the total cost of 3 apple at store B and 2 pear at store A,
# in EUR?". Solving it takes 2-5 tool calls (one Lookup per line, a Rate unless the currency is
# USD, one Calculator), then a final answer with 2 decimals. The tools really execute against the
# world, so any dialog - gold, contaminated or a model's rollout - is labelled exactly, turn by
# turn, by re-running its tool calls (shop_labels). Vocabulary and phrasing are small and regular
# on purpose: a tiny model trained on the gold dialogs must be able to learn the world.
#
# A turn is correct iff envs.shop_labels says so: its docstring and shop_thought_true's state the
# rules, which the default run's rewards and successes depend on.


# ---- exact labels --------------------------------------------------------------------------------

def dialog_steps(dialog: list[dict]) -> list:
    """The assistant turns of a released-schema dialog as parser results."""
    steps = []
    for m in dialog:
        if m["role"] != "assistant":
            continue
        if len(m.get("tool_calls") or []) > 1:
            steps.append(envs.ParseError("several tool calls in one turn"))
            continue
        thought, call, final = envs.assistant_parts(m)
        steps.append(envs.Action(thought, call["name"], call.get("arguments") or {})
                     if call is not None else envs.Final(thought, final))
    return steps


def shop_dialog_labels(task: envs.ShopTask, dialog: list[dict]) -> list[bool]:
    return envs.shop_labels(task, dialog_steps(dialog))


# ---- the gold solver ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _ShopTurn:
    """The pieces a gold-style turn is written from; contamination edits them."""
    said: tuple = ()                # ((fact, value), ...) restated from observations
    need: tuple | None = None       # the fact the thought says is needed next
    formula: str | None = None      # the thought's "The total is <formula>."
    call: tuple | None = None       # (tool name, arguments); None for the final answer
    answer: str | None = None


def _shop_fact_call(fact) -> tuple:
    if fact[0] == "price":
        return "Lookup", {"store": fact[1], "item": fact[2]}
    return "Rate", {"currency": fact[1]}


def _shop_formula(task: envs.ShopTask, values: dict, mul: str = "*", conv: str = "*") -> str:
    """The total as an expression of the given fact values ("(3*2.50+2*1.20)*0.92")."""
    body = "+".join(f"{q}{mul}{values['price', s, i]}" for q, i, s in task.lines)
    if task.currency == "USD":
        return body
    rate = values["rate", task.currency]
    return f"{body}{conv}{rate}" if len(task.lines) == 1 else f"({body}){conv}{rate}"


def _shop_render(task: envs.ShopTask, turn: _ShopTurn) -> dict:
    """A turn as a released-schema assistant message."""
    parts = []
    for fact, value in turn.said:
        parts.append(f"{fact[2]} at store {fact[1]} costs {value}." if fact[0] == "price"
                     else f"1 USD = {value} {fact[1]}.")
    if turn.need is not None:
        parts.append(f"I need the price of {turn.need[2]} at store {turn.need[1]}."
                     if turn.need[0] == "price" else f"I need the {turn.need[1]} rate.")
    if turn.formula is not None:
        parts.append(f"The total is {turn.formula}.")
    if turn.answer is not None:
        parts.append(f"The total is {turn.answer} {task.currency}.")
    thought = " ".join(parts)
    if turn.call is None:
        return {"role": "assistant", "content": turn.answer, "thought": thought}
    name, arguments = turn.call
    call = {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}
    return {"role": "assistant", "tool_calls": [call], "thought": thought}


def _shop_next(task: envs.ShopTask, known: dict, computed: list[float], said: tuple) -> _ShopTurn:
    """The gold policy: fetch the next missing fact, then compute the total, then answer."""
    missing = [f for f in task.needed if f not in known]
    if missing:
        return _ShopTurn(said=said, need=missing[0], call=_shop_fact_call(missing[0]))
    if not envs.within_half_cent(float(task.total), computed):
        formula = _shop_formula(task, known)
        return _ShopTurn(said=said, formula=formula, call=("Calculator", {"expression": formula}))
    return _ShopTurn(said=said, answer=task.answer)


def tool_message(name: str, text: str) -> dict:
    return {"role": "tool", "name": name, "content": {"type": "text", "content": text}}


def play_turn(dialog: list[dict], task: envs.ShopTask, thought: str, call: tuple | None = None,
              answer: str | None = None) -> envs.ShopResult:
    """Append one assistant turn to `dialog` (released schema): the final `answer`, or the tool
    `call` (name, arguments) followed by the tool's real observation of `task`; the tool's result
    (an empty one for an answer)."""
    if call is None:
        dialog.append({"role": "assistant", "content": answer, "thought": thought})
        return envs.ShopResult("")
    dialog.append({"role": "assistant", "thought": thought, "tool_calls": [
        {"type": "function", "function": {"name": call[0], "arguments": call[1]}}]})
    res = envs.shop_execute(task, *call)
    dialog.append(tool_message(call[0], res.text))
    return res


def _shop_play(task: envs.ShopTask, dialog: list[dict], turn: _ShopTurn,
               state: tuple) -> envs.ShopResult:
    """Append a turn and its true observation; update state = (known, computed, said)."""
    known, computed, _ = state
    dialog.append(_shop_render(task, turn))
    if turn.call is None:
        return envs.ShopResult("")
    res = envs.shop_execute(task, *turn.call)
    dialog.append(tool_message(turn.call[0], res.text))
    if res.fact is not None:
        known[res.fact] = res.value
    if res.number is not None:
        computed.append(res.number)
    return res


def shop_gold(task: envs.ShopTask) -> tuple[list[dict], list[_ShopTurn]]:
    """The gold dialog (released schema) and the pieces of each of its assistant turns."""
    dialog = [{"role": "user", "content": task.text}]
    turns: list[_ShopTurn] = []
    known, computed, said = {}, [], ()
    while True:
        turn = _shop_next(task, known, computed, said)
        turns.append(turn)
        res = _shop_play(task, dialog, turn, (known, computed, said))
        if turn.call is None:
            return dialog, turns
        said = ((res.fact, res.value),) if res.fact is not None else ()


def shop_divided(task: envs.ShopTask) -> list[dict] | None:
    """The gold dialog with the currency conversion done the wrong way round - the dollar total
    divided by the rate ("3*4.17/0.77" for GBP) - and answered with what the Calculator returned,
    so the dialog is consistent with itself and wrong. None for a USD task (nothing to convert).

    Why it exists: the classic slip of currency conversion, and the habit the built-in policy is
    taught on a fraction of its dialogs (python -m lab.shop sft --divided): a fluent,
    self-consistent error that an outcome or a per-turn reward can teach away, which errors of a
    missing skill are not."""
    if task.currency == "USD":
        return None
    dialog = [{"role": "user", "content": task.text}]
    known, computed, said = {}, [], ()
    for turn in shop_gold(task)[1]:
        if turn.formula is not None:
            formula = _shop_formula(task, known, conv="/")
            turn = replace(turn, formula=formula, call=("Calculator", {"expression": formula}))
        elif turn.call is None:
            turn = replace(turn, answer=envs.round_answer(Decimal(repr(computed[-1]))))
        res = _shop_play(task, dialog, turn, (known, computed, said))
        said = ((res.fact, res.value),) if res.fact is not None else ()
    return dialog


def shop_record(task: envs.ShopTask, dialog: list[dict]) -> dict:
    """An episode in the released schema (METHOD.md §1)."""
    return {"tools": envs.SHOP_TOOLS, "files": [], "dialogs": dialog,
            "gt_answer": {"whitelist": [[task.answer]], "blacklist": None}}


def _shop_state(task: envs.ShopTask, dialog: list[dict]) -> tuple[dict, list[float], tuple]:
    """Re-run the tool calls of a dialog: (facts fetched, calculation results, restatable facts
    of the last result)."""
    known, computed, said = {}, [], ()
    for step in dialog_steps(dialog):
        if isinstance(step, envs.Action):
            res = envs.shop_execute(task, step.name, step.arguments)
            if res.fact is not None:
                known[res.fact] = res.value
            if res.number is not None:
                computed.append(res.number)
            said = ((res.fact, res.value),) if res.fact is not None else ()
    return known, computed, said


# ---- contamination (paper Appendix contam_types, contam_procedure), rule-based -------------------
#
# Targets are drawn as in the paper: j uniform over the non-final assistant turns, a type uniform
# over those compatible with turn j, and only turn j is rewritten - every later message, tool
# results included, stays verbatim (matched-pair semantics). As in the release (63 of 176 GTA
# train episodes), an episode gets a second contaminated turn, later and non-final, with
# probability SHOP_SECOND_CONTAMINATION. The types, written onto the gold turn's pieces:
#   reasoning_error (any turn): a Lookup/Rate turn's thought plans a fact the task does not need
#       (its call unchanged); a Calculator turn gets a flawed formula in thought and call
#       (converting with / instead of *; in USD, + instead of *);
#   tool_misuse (any turn): a Lookup/Rate call gets a wrong store, item or currency; a Calculator
#       call gets one * turned into + (thought unchanged);
#   observation_misinterpretation (turns after an observation): the thought misreads one digit of
#       the previous observation's number (a formula in the turn uses the misread number);
#   stale_memory (turns after >= 2 price observations): the last price seen is replaced by an
#       earlier one, in the restatement and in the formula.
# A rewrite is kept only if shop_labels marks it incorrect, so every contaminated turn is an error
# by the same rule that labels everything else.
SHOP_SECOND_CONTAMINATION = 0.35


def _shop_wrong_facts(task: envs.ShopTask, fact) -> list:
    """Facts of the same kind near `fact` that the task does not need."""
    if fact[0] == "price":
        near = [("price", s, fact[2]) for s in envs.SHOP_STORES] + \
               [("price", fact[1], i) for i in envs.SHOP_ITEMS]
    else:
        near = [("rate", c) for c in envs.SHOP_CURRENCIES if c != "USD"]
    return [f for f in near if f not in task.needed]


def _shop_misreads(value: Decimal) -> list[Decimal]:
    """The value with one digit misread."""
    text = str(value)
    out = []
    for pos, ch in enumerate(text):
        if ch.isdigit():
            out += [Decimal(text[:pos] + d + text[pos + 1:]) for d in "0123456789" if d != ch]
    return [v for v in out if v > 0]


def _shop_stale(task: envs.ShopTask, turns: list[_ShopTurn], k: int) -> tuple:
    """(last price fact seen before turn k, earlier price values it could be confused with)."""
    seen = [t.need for t in turns[:k] if t.need is not None and t.need[0] == "price"]
    if len(seen) < 2:
        return None, []
    last = seen[-1]
    olds = sorted({task.value(f) for f in seen[:-1]} - {task.value(last)})
    if turns[k].formula is None and all(f != last for f, _ in turns[k].said):
        return None, []
    return last, olds


def shop_compatible(task: envs.ShopTask, turns: list[_ShopTurn], k: int) -> list[str]:
    """Contamination types that apply to gold turn k (paper Table contam_compat, for shop)."""
    kinds = ["reasoning_error", "tool_misuse"]
    if turns[k].said:
        kinds.append("observation_misinterpretation")
    if _shop_stale(task, turns, k)[1]:
        kinds.append("stale_memory")
    return kinds


def _shop_with_value(task: envs.ShopTask, turn: _ShopTurn, fact, value: Decimal) -> _ShopTurn:
    """The turn believing fact = value: in its restatement and in its formula."""
    said = tuple((f, value if f == fact else v) for f, v in turn.said)
    if turn.formula is None:
        return replace(turn, said=said)
    values = {f: task.value(f) for f in task.needed}
    values[fact] = value
    formula = _shop_formula(task, values)
    return replace(turn, said=said, formula=formula, call=("Calculator", {"expression": formula}))


def _shop_rewrites(task: envs.ShopTask, turns: list[_ShopTurn], k: int, kind: str,
                   rng: random.Random) -> list[_ShopTurn]:
    """Candidate rewrites of gold turn k as a `kind` error, in random order."""
    turn = turns[k]
    truth = {f: task.value(f) for f in task.needed}
    out = []
    if kind == "reasoning_error":
        if turn.need is not None:
            out = [replace(turn, need=f) for f in _shop_wrong_facts(task, turn.need)]
        else:
            flawed = (_shop_formula(task, truth, mul="+") if task.currency == "USD"
                      else _shop_formula(task, truth, conv="/"))
            out = [replace(turn, formula=flawed, call=("Calculator", {"expression": flawed}))]
    elif kind == "tool_misuse":
        if turn.need is not None:
            out = [replace(turn, call=_shop_fact_call(f))
                   for f in _shop_wrong_facts(task, turn.need)]
        else:
            out = [replace(turn, call=("Calculator",
                                       {"expression": turn.formula.replace("*", "+", 1)}))]
    elif kind == "observation_misinterpretation":
        fact, value = turn.said[-1]
        out = [_shop_with_value(task, turn, fact, v) for v in _shop_misreads(value)]
    elif kind == "stale_memory":
        last, olds = _shop_stale(task, turns, k)
        out = [_shop_with_value(task, turn, last, v) for v in olds]
    else:
        raise ValueError(f"unknown contamination type {kind!r}")
    rng.shuffle(out)
    return out


def shop_contaminate(task: envs.ShopTask, dialog: list[dict], turns: list[_ShopTurn],
                     rng: random.Random) -> tuple[list[dict], list[int], list[str], dict]:
    """The contaminated dialog, its contaminated message indices and types, and the rewritten
    turns' pieces by message index (the paper's procedure, see above)."""
    out = list(dialog)
    targets = [rng.randrange(len(turns) - 1)]
    if targets[0] < len(turns) - 2 and rng.random() < SHOP_SECOND_CONTAMINATION:
        targets.append(rng.randrange(targets[0] + 1, len(turns) - 1))
    indices, kinds, rewritten = [], [], {}
    for k in targets:
        compatible = shop_compatible(task, turns, k)
        kind = rng.choice(compatible)
        idx = 2 * k + 1                 # user task, then (assistant, tool) per turn
        # A rewrite can be right by coincidence (6*1.20 = 6+1.20): then the next compatible
        # kind, in table order, is tried.
        for kind in [kind] + [c for c in compatible if c != kind]:
            found = next(((t, m) for t in _shop_rewrites(task, turns, k, kind, rng)
                          for m in [_shop_render(task, t)]
                          if not shop_dialog_labels(task, out[:idx] + [m])[-1]), None)
            if found is not None:
                turn, message = found
                break
        else:
            raise RuntimeError(f"shop seed {task.seed}: no rewrite of turn {k} is an error")
        out[idx] = message
        indices.append(idx)
        kinds.append(kind)
        rewritten[idx] = turn
    return out, indices, kinds, rewritten


def shop_matched(task: envs.ShopTask, episode_id: str, clean: list[dict], contaminated: list[dict],
                 indices: list[int], kinds: list[str]) -> tuple[list[dict], list[dict]]:
    """One matched record per assistant turn, as released: the evaluation turn is the
    contaminated dialog's turn in both files; the prefix is clean or contaminated. Each label is
    shop_labels' verdict on that record's own dialog."""
    labels = shop_dialog_labels(task, contaminated)
    clean_records, contaminated_records = [], []
    for k, t in enumerate(range(1, len(contaminated), 2)):
        kind = kinds[indices.index(t)] if t in indices else None
        dialog = clean[:t] + [contaminated[t]]
        label = shop_dialog_labels(task, dialog)[-1]
        clean_records.append(released.matched_record(episode_id, t, label, kind, indices,
                                                     "clean", dialog))
        contaminated_records.append(released.matched_record(
            episode_id, t, labels[k], kind, indices, "contaminated", contaminated[:t + 1]))
    return clean_records, contaminated_records


def shop_diagnostic(task: envs.ShopTask, episode_id: str, clean: list[dict],
                    contaminated: list[dict], j: int, rewritten: _ShopTurn,
                    rng: random.Random) -> list[dict]:
    """The adversarial pair of one episode (METHOD.md §8e, the paper's Appendix diagnostic), both
    evaluated at the turn after the first contaminated turn j:
    consistent_incorrect - clean prefix, then a fluent gold-style turn that fetches a fact the
        task does not need (one already fetched, or a neighbour of a needed one): label 0;
    inconsistent_correct - contaminated prefix (turn j and its true observation), then the gold
        policy's turn from the true state, restating any value turn j misstated: label 1 (a
        repair turn: it redoes the misused call, corrects the misread value, recomputes)."""
    t = j + 2
    prefix = clean[:t]
    known, _, said = _shop_state(task, prefix)
    options = sorted(known) + sorted({f for need in task.needed
                                      for f in _shop_wrong_facts(task, need)})
    rng.shuffle(options)
    for fact in options:
        turn = _ShopTurn(said=said, need=fact, call=_shop_fact_call(fact))
        wrong = _shop_render(task, turn)
        if not shop_dialog_labels(task, prefix + [wrong])[-1]:
            break
    else:
        raise RuntimeError(f"shop seed {task.seed}: no consistent-but-incorrect turn")

    prefix = contaminated[:j + 1]
    name, arguments = rewritten.call
    prefix.append(tool_message(name, envs.shop_execute(task, name, arguments).text))
    known, computed, said = _shop_state(task, prefix)
    fixes = tuple((f, task.value(f)) for f, v in rewritten.said
                  if v != task.value(f) and all(f != g for g, _ in said))
    repair = _shop_render(task, _shop_next(task, known, computed, fixes + said))
    if not shop_dialog_labels(task, prefix + [repair])[-1]:
        raise RuntimeError(f"shop seed {task.seed}: the repair turn is not correct")
    return [released.matched_record(episode_id, t, False, None, [], "clean", clean[:t] + [wrong],
                                    diagnostic="consistent_incorrect"),
            released.matched_record(episode_id, t, True, None, [j], "contaminated",
                                    prefix + [repair], diagnostic="inconsistent_correct")]


# ---- make-data ----------------------------------------------------------------------------------

def make_shop_data(out_dir, episodes: int = 1000, seed: int = 42) -> dict[str, int]:
    """Write the released-schema files of `episodes` shop episodes (80:20 train/test) to out_dir:
    {clean,contaminated}_{train,test}.json, matched_{clean,contaminated}_{train,test}.json, and
    the adversarial diagnostic set matched_diagnostic_test.json with its episode file
    diagnostic_test.json. Byte-for-byte deterministic. Returns records per file."""
    if not 2 <= episodes <= envs.SHOP_SPLIT_SIZE["train"]:      # 80:20 train/test, disjoint seeds
        raise envs.DataError(f"--episodes {episodes}: 2 to {envs.SHOP_SPLIT_SIZE['train']:,}")
    if seed < 0:
        raise envs.DataError(f"--seed {seed}: must be a non-negative integer")
    n_test = max(1, episodes // 5)
    files: dict[str, object] = {}
    for split, n in (("train", episodes - n_test), ("test", n_test)):
        clean_eps, cont_eps, m_clean, m_cont, diagnostic = {}, {}, [], [], []
        for i in range(n):
            task = envs.shop_task(envs.shop_episode_seed(split, seed, i))
            eid = envs.shop_episode_id(split, seed, i)
            clean, turns = shop_gold(task)
            rng = random.Random(f"shop-contaminate-{task.seed}")
            cont, indices, kinds, rewritten = shop_contaminate(task, clean, turns, rng)
            clean_eps[eid] = shop_record(task, clean)
            cont_eps[eid] = {**shop_record(task, cont), "contaminated_turn_indices": indices,
                             "contamination_types": kinds,
                             "original_turn_contents": [clean[t] for t in indices]}
            mc, mx = shop_matched(task, eid, clean, cont, indices, kinds)
            m_clean += mc
            m_cont += mx
            if split == "test":
                diagnostic += shop_diagnostic(task, eid, clean, cont, indices[0],
                                              rewritten[indices[0]], rng)
        files.update({f"clean_{split}.json": clean_eps, f"contaminated_{split}.json": cont_eps,
                      f"matched_clean_{split}.json": m_clean,
                      f"matched_contaminated_{split}.json": m_cont})
        if split == "test":
            files["diagnostic_test.json"] = clean_eps
            files["matched_diagnostic_test.json"] = diagnostic
    out_dir = Path(out_dir)
    for name, data in files.items():
        # The released layout: episode files indented by 2, matched files on one line.
        text = json.dumps(data, indent=None if name.startswith("matched_") else 2)
        model.write_atomic(out_dir / name, text.encode())
    return {name: len(data) for name, data in files.items()}
