"""The built-in tool world, `shop`, and the recipe of the tiny policy that plays it: what
`python grpo.py` runs on when no model and no data are given. A port of PAIR never needs this file.

    python -m lab.shop make-data --out data/shop --episodes 1000   # released-schema files, offline
    python -m lab.shop sft --out DIR    # train a policy (data/shop-policy/README.md: the commands)

Two parts, top to bottom:
1. The world. Every episode is drawn from one integer seed; its tools really execute, so every
   turn of any dialog is labelled exactly. `make-data` writes the released file schema from it
   (gold dialogs, rule-based contaminations, matched pairs, the diagnostic set), and `ShopEnv`
   is its environment.
2. The built-in policy's recipe (`sft`): a tiny Qwen2 and its tokenizer trained from scratch on
   the world's gold and contaminated dialogs; data/shop-policy/README.md lists the commands.
The probes grpo.py fits for a policy of this world, on its own labelled turns, are in onpolicy.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from decimal import Decimal, ROUND_HALF_UP
from itertools import accumulate
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save as safetensors_bytes, save_file

import envs
import grpo
import model
from lab import data as lab_data, generate, runs
from probes import rollout
import probes

# ---------------------------------------------------------------------------------------------
# The world: tasks drawn from a seed, tools that really execute, exact labels
# ---------------------------------------------------------------------------------------------
# Every episode is drawn from one integer seed: a world (USD prices of SHOP_ITEMS at stores A-D,
# exchange rates) and a task, "What is the total cost of 3 apple at store B and 2 pear at store A,
# in EUR?". Solving it takes 2-5 tool calls (one Lookup per line, a Rate unless the currency is
# USD, one Calculator), then a final answer with 2 decimals. The tools really execute against the
# world, so any dialog - gold, contaminated or a model's rollout - is labelled exactly, turn by
# turn, by re-running its tool calls (shop_labels). Vocabulary and phrasing are small and regular
# on purpose: a tiny model trained on the gold dialogs must be able to learn the world.
#
# A turn is correct iff envs.shop_labels says so: its docstring and _shop_thought_true's state the
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
    if not envs._close(float(task.total), computed):
        formula = _shop_formula(task, known)
        return _ShopTurn(said=said, formula=formula, call=("Calculator", {"expression": formula}))
    return _ShopTurn(said=said, answer=task.answer)


def _tool_message(name: str, text: str) -> dict:
    return {"role": "tool", "name": name, "content": {"type": "text", "content": text}}


def _shop_play(task: envs.ShopTask, dialog: list[dict], turn: _ShopTurn,
               state: tuple) -> envs.ShopResult:
    """Append a turn and its true observation; update state = (known, computed, said)."""
    known, computed, _ = state
    dialog.append(_shop_render(task, turn))
    if turn.call is None:
        return envs.ShopResult("")
    res = envs.shop_execute(task, *turn.call)
    dialog.append(_tool_message(turn.call[0], res.text))
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
            wrong = Decimal(repr(computed[-1])).quantize(envs._CENT, rounding=ROUND_HALF_UP)
            turn = replace(turn, answer=str(wrong))
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


# ---- shop-long: the long-horizon world ----------------------------------------------------------
#
# The same stores, items, tools and labels, for tasks where credit assignment is the hard part. A
# task buys 3-4 numbered lines of different items at one store, "(1) 6 pear, (2) 1 apple and
# (3) 4 milk at store B", and always asks for a currency other than USD. The solution goes line by
# line: a Lookup and the running total (Calculator "total so far + q*p") per line, then the rate,
# the conversion, the answer: 2 x lines + 3 = 9-11 assistant turns. A Lookup's thought
# restates the line before and its own as the task writes them, "(1) 6 pear, (2) 1 apple.":
# finding the next line is then copying on from where the last one ends, which a model as small as
# the built-in one does with an induction head. Every turn after a Calculator call restates its
# result first, "The total so far is 24.21.", copied from the observation just before: the next
# running total then copies it from two messages back, not three.
# (Measured on the way here: without the numbers it took the first line's quantity for every line;
# with each line alone, it lost its place from the third line on; with a store per line, it copied
# the wrong store letter; adding the subtotals in one call at the end, it could not copy them back
# from their observations; with running totals not restated, it lost digits copying one from three
# messages back.)
# A Calculator call is right when it produces a running total (the first k lines) or the total
# converted: a total that leaves a line out is wrong where it is made. A line's number in a
# thought is a name, not a value.
#
# The built-in policy of this world (data/shop-long-policy) is given three slips on purpose, each
# a fluent, turn-local habit at a different turn, each alone enough to fail the episode (its later
# turns carry the wrong number, consistently). Each is a habit of some tasks, as shop's divided
# habit is of non-USD ones, on a feature of its own that half the tasks have (LONG_HABITS): made
# there more often than not, greedy decoding makes it wherever it can, so greedy success is about
# the eighth of tasks that have none, while sampling also plays each habit's right turn.
#   store   - at store A or B, the first line's item is looked up (and costed) at the next store;
#   forget  - with 4 lines, the last line's running total leaves out the lines before it (q*p);
#   divided - in EUR or GBP, the conversion divides the dollar sum by the rate (as shop_divided).
LONG_LINES = (3, 4)
LONG_SLIPS = ("store", "forget", "divided")
LONG_HABITS = {"store": lambda task: task.lines[0][2] in ("A", "B"),
               "forget": lambda task: len(task.lines) == 4,
               "divided": lambda task: task.currency in ("EUR", "GBP")}


def long_task(seed: int) -> envs.ShopTask:
    """The shop-long episode of one seed (one random.Random(seed), fixed draw order)."""
    rng = random.Random(seed)
    prices, rates = envs.draw_world(rng)
    while True:     # drawn again (same stream) until every slip is visible: _long_distinct
        n_lines = rng.randint(*LONG_LINES)
        store = rng.choice(envs.SHOP_STORES)
        lines = tuple((rng.randint(1, envs.SHOP_MAX_QUANTITY), i, store)
                      for i in rng.sample(envs.SHOP_ITEMS, n_lines))
        currency = rng.choice(tuple(envs.SHOP_RATE_CENTS))
        parts = [f"({k + 1}) {q} {i}" for k, (q, i, _) in enumerate(lines)]
        text = rng.choice(envs.SHOP_TEMPLATES).format(
            lines=", ".join(parts[:-1]) + " and " + parts[-1] + f" at store {store}", cur=currency)
        task = envs.ShopTask(seed, prices, rates, lines, currency, text, stepwise=True)
        if _long_distinct(task):
            return task


def _long_distinct(task: envs.ShopTask) -> bool:
    """The gold's computed values lie more than a cent apart (a Calculator result equal to an
    earlier one is a wasted call, so a tie would make a gold turn wrong), and no slip computes a
    value a right turn could (each is wrong where it is made)."""
    # the values as the gold computes them, ties kept (task.quantities is a set: it hides them)
    gold = list(accumulate(q * task.prices[s, i] for q, i, s in task.lines)) + [task.total]
    if any(abs(a - b) <= envs._CENT for k, a in enumerate(gold) for b in gold[k + 1:]):
        return False
    q, item, store = task.lines[0]
    running = [q * task.prices[_slip_store(task, store, item), item]]     # store
    for q, i, s in task.lines[1:]:
        running.append(running[-1] + q * task.prices[s, i])
    usd = sum(q * task.prices[s, i] for q, i, s in task.lines)
    q, i, s = task.lines[-1]
    wrong = running + [q * task.prices[s, i],                          # forget
                       usd / task.rates[task.currency]]                # divided
    return all(abs(a - b) > envs._CENT for a in wrong for b in gold)


def shop_task_from_id(episode_id: str) -> envs.ShopTask:
    """Rebuild the world of a shop (or shop-long) episode id, so any record can be re-labelled."""
    m = re.fullmatch(r"(shop|shop-long)-(\d+)-(train|val|test)-(\d+)", episode_id)
    if m is None:
        raise ValueError(f"not a shop episode id: {episode_id!r} (expected shop-SEED-SPLIT-I or "
                         "shop-long-SEED-SPLIT-I)")
    seed = envs.shop_episode_seed(m.group(3), int(m.group(2)), int(m.group(4)))
    return WORLDS[m.group(1)].task(seed)


# The long world: its episodes, its turn limit (a line a turn, then the total: up to 16 turns)
# and its own policy. The lab's table of worlds is the core's with it.
LONG_WORLD = envs.World("shop-long", long_task, 16, envs.BUILTIN_POLICY.parent / "shop-long-policy")
WORLDS = {**envs.WORLDS, "shop-long": LONG_WORLD}


def _slip_store(task: envs.ShopTask, store: str, item: str) -> str:
    """The next store after `store` (cyclically) whose price of `item` the task does not need."""
    k = envs.SHOP_STORES.index(store)
    for j in range(1, len(envs.SHOP_STORES)):
        other = envs.SHOP_STORES[(k + j) % len(envs.SHOP_STORES)]
        if ("price", other, item) not in task.needed:
            return other
    return store


def long_dialog(task: envs.ShopTask, slips=()) -> list[dict]:
    """The shop-long solution (released schema), with the named LONG_SLIPS made: the gold dialog
    when there are none. Observations are the tools' real outputs, and every turn after a slip
    goes on consistently with what it got, so the answer is wrong and the dialog fluent."""
    dialog = [{"role": "user", "content": task.text}]

    def turn(thought, call=None, answer=None) -> envs.ShopResult:
        if call is None:
            dialog.append({"role": "assistant", "content": answer, "thought": thought})
            return envs.ShopResult("")
        dialog.append({"role": "assistant", "thought": thought, "tool_calls": [
            {"type": "function", "function": {"name": call[0], "arguments": call[1]}}]})
        res = envs.shop_execute(task, *call)
        dialog.append(_tool_message(call[0], res.text))
        return res

    def so_far(running) -> str:
        # each turn after a running total restates it first, copied from the observation just
        # before, so the next total copies it from two messages back, not three
        return "" if running is None else f"The total so far is {running}. "

    running, said = None, []
    for k, (q, item, store) in enumerate(task.lines):
        if k == 0 and "store" in slips:             # the line misread
            store = _slip_store(task, store, item)
        line = f"({k + 1}) {q} {item}"
        # the last line and this one, joined as the task joins them: a verbatim continuation
        joint = "" if k == 0 else f"{said[-1]}{' and ' if k == len(task.lines) - 1 else ', '}"
        said.append(line)
        price = turn(f"{so_far(running)}{joint}{line}. I need the price of {item} at store "
                     f"{store}.", ("Lookup", {"store": store, "item": item})).value
        carry = k > 0 and not (k == len(task.lines) - 1 and "forget" in slips)
        formula = f"{running}+{q}*{price}" if carry else f"{q}*{price}"
        running = turn(f"{line} at store {store} costs {price}. The total so far is {formula}.",
                       ("Calculator", {"expression": formula})).text
    usd = running
    cur = task.currency
    rate = turn(f"{so_far(usd)}I need the {cur} rate.", ("Rate", {"currency": cur})).value
    formula = f"{usd}{'/' if 'divided' in slips else '*'}{rate}"
    total = turn(f"1 USD = {rate} {cur}. The total is {formula}.",
                 ("Calculator", {"expression": formula})).number
    answer = task.answer if not slips else \
        str(Decimal(repr(total)).quantize(envs._CENT, rounding=ROUND_HALF_UP))
    turn(f"The total is {answer} {cur}.", answer=answer)
    return dialog


def slip_turns(task: envs.ShopTask) -> dict[str, int]:
    """For each habit of the built-in policy this task has (shop: divided, if not in USD;
    shop-long: LONG_SLIPS by LONG_HABITS), the assistant turn at which the dialog with that slip
    departs from the gold: where a rollout with a clean prefix makes the decision."""
    if task.stepwise:
        gold = long_dialog(task)
        slipped = {s: long_dialog(task, (s,)) for s in LONG_SLIPS if LONG_HABITS[s](task)}
    else:
        gold, divided = shop_gold(task)[0], shop_divided(task)
        slipped = {} if divided is None else {"divided": divided}
    return {s: next(k for k, (a, b) in enumerate(zip(dialog_steps(gold), dialog_steps(d)))
                    if a != b) for s, d in slipped.items()}


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
        clean_records.append(lab_data.matched_record(episode_id, t, label, kind, indices,
                                                     "clean", dialog))
        contaminated_records.append(lab_data.matched_record(
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
    prefix.append(_tool_message(name, envs.shop_execute(task, name, arguments).text))
    known, computed, said = _shop_state(task, prefix)
    fixes = tuple((f, task.value(f)) for f, v in rewritten.said
                  if v != task.value(f) and all(f != g for g, _ in said))
    repair = _shop_render(task, _shop_next(task, known, computed, fixes + said))
    if not shop_dialog_labels(task, prefix + [repair])[-1]:
        raise RuntimeError(f"shop seed {task.seed}: the repair turn is not correct")
    return [lab_data.matched_record(episode_id, t, False, None, [], "clean", clean[:t] + [wrong],
                                    diagnostic="consistent_incorrect"),
            lab_data.matched_record(episode_id, t, True, None, [j], "contaminated",
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


# ---- the environment -----------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The built-in policy: a tiny Qwen2 trained from scratch on shop dialogs
# ---------------------------------------------------------------------------------------------
# `python -m lab.shop sft --out data/shop-policy` writes what load_model reads: config.json
# (Qwen2ForCausalLM), model.safetensors (Hugging Face key names, tied embeddings) and a byte-level
# BPE tokenizer.json trained on the same text, with the ChatML specials. The data are the gold
# dialogs of `make-data` with a fraction replaced by their contaminated versions, so the
# policy learns the format and the world but also some of the four kinds of mistakes: it solves a
# fair share of held-out tasks, not all, and GRPO has something to improve. Training starts with a
# synthetic copy task (InductionTask) so that the model can copy from its context at all. The loss
# covers the assistant turns only (METHOD.md §3, <|im_end|> included). Same command, same bytes.

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    # Digits one by one (a space may lead one), as Qwen's tokenizer splits them: numbers are
    # read and copied digit by digit.
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r" ?\d"), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tk


def sft_dialogs(episodes: int, contaminated: float, seed: int,
                divided: float = 0.0) -> list[list[dict]]:
    """Chat messages of make-data's training episodes: a fraction `contaminated` of them
    replaced by their contaminated version, and a fraction `divided` of the other non-USD ones
    by the dialog that converts the wrong way round (shop_divided)."""
    with tempfile.TemporaryDirectory() as tmp:
        make_shop_data(tmp, episodes=episodes, seed=seed)
        clean = envs.load_episodes(Path(tmp) / "clean_train.json")
        dirty = lab_data.load_episodes(Path(tmp) / "contaminated_train.json")
    rng = random.Random(f"sft-{seed}")
    habit = random.Random(f"sft-divided-{seed}")  # its own stream: divided=0 changes nothing
    out = []
    for eid in clean:
        rec = dirty[eid] if rng.random() < contaminated else clean[eid]
        if rec is clean[eid] and habit.random() < divided:
            wrong = shop_divided(shop_task_from_id(eid))
            rec = rec if wrong is None else {**rec, "dialogs": wrong}
        out.append(envs.dialog_to_messages(rec["dialogs"], rec["tools"], rec["files"]))
    return out


def long_sft_dialogs(episodes: int, slips: float, seed: int) -> list[list[dict]]:
    """Chat messages of the first `episodes` shop-long training episodes, each of LONG_SLIPS made
    with probability `slips` in a dialog whose task has its habit (LONG_HABITS), drawn on its own
    (three draws per dialog, always: the stream does not depend on the task)."""
    rng = random.Random(f"sft-slips-{seed}")
    out = []
    for i in range(episodes):
        task = long_task(envs.shop_episode_seed("train", seed, i))
        made = tuple(slip for slip in LONG_SLIPS
                     if rng.random() < slips and LONG_HABITS[slip](task))
        out.append(envs.dialog_to_messages(long_dialog(task, made), envs.SHOP_TOOLS, []))
    return out


def sft_config(args, tok) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "vocab_size": tok.tok.get_vocab_size(), "hidden_size": args.hidden,
            "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
            "hidden_act": "silu", "max_position_embeddings": 8192, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False,
            "bos_token_id": None, "eos_token_id": tok.im_end_id, "pad_token_id": tok.pad_id,
            "torch_dtype": "float32",
            # `model.py generate` renders a prompt as this world renders a task
            generate.WORLD_KEY: "shop",
            generate.TOOLS_KEY: envs.tool_instructions(envs.SHOP_TOOLS)}


def sft_batches(lengths: list[int], batch: int, steps: int, seed: int) -> list[list[int]]:
    """`steps` batches of example indices: shuffled every pass, and grouped by length within
    windows of 8 batches so that little compute goes to padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < steps:
        order = torch.randperm(len(lengths), generator=g).tolist()
        for w in range(0, len(order) - batch + 1, 8 * batch):
            window = sorted(order[w:w + 8 * batch], key=lambda i: lengths[i])
            chunks = [window[i:i + batch] for i in range(0, len(window) - batch + 1, batch)]
            out += [chunks[i] for i in torch.randperm(len(chunks), generator=g).tolist()]
    return out[:steps]


SFT_CHECKPOINT = "sft-checkpoint"      # under --out while a run is unfinished


def sft(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    earlier = policy_recipe(args.init) if args.init else []    # read before --out overwrites it
    if args.init:   # continue a saved policy, its tokenizer and shape (first: a bad one fails fast)
        try:
            policy, tok = model.load_model(args.init)
        except (model.CheckpointError, OSError, ValueError) as e:
            raise SystemExit(f"--init {args.init}: cannot continue this policy ({e})") from None
        policy.requires_grad_(True)             # load_model freezes a base for LoRA
        config = json.loads((Path(args.init) / "config.json").read_text())
    dialogs = sft_dialogs(args.episodes, args.contaminated, args.seed, args.divided) \
        if args.world == "shop" else long_sft_dialogs(args.episodes, args.slips, args.seed)
    if not args.init:
        tok = model.Tokenizer(train_tokenizer([chat_text(m) for m in dialogs], args.vocab))
    examples = []
    for messages in dialogs:
        ids, spans = tok.render(messages)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        for s, e in spans:
            mask[s:e] = True
        examples.append((torch.tensor(ids), mask))
    if not args.init:
        config = sft_config(args, tok)
        policy = model.Transformer(model.Config.from_dict(config))
        for name, p in policy.named_parameters():       # GPT-2 style init
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)
    n_params = sum(p.numel() for p in policy.parameters())
    what = f"{args.contaminated:.0%} contaminated, {args.divided:.0%} of the others dividing " \
        "by the rate" if args.world == "shop" else \
        f"shop-long, each slip in {args.slips:.0%} of its tasks"
    print(f"sft: {len(examples)} dialogs ({what}), vocab "
          f"{config['vocab_size']}, {n_params / 1e6:.2f}M parameters"
          f"{', from ' + args.init if args.init else ''}; {args.induction_steps} "
          f"induction steps, then {args.steps} steps of {args.batch} dialogs", flush=True)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    induction = InductionTask(tok, args.seed, [x[m.nonzero()[0, 0]:] for x, m in examples],
                              args.induction_text)
    policy.train()

    def step(loss: torch.Tensor, lr: float) -> float:
        for group in opt.param_groups:
            group["lr"] = lr
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    # A checkpoint every --save-every steps (both phases counted as one sequence); --resume
    # restores the weights, the optimizer, the induction rows' generator and the logged losses,
    # so a resumed run writes the same bytes as one never stopped.
    ckpt = Path(args.out) / SFT_CHECKPOINT
    done, losses, kept, earlier_seconds = 0, [], [], 0.0
    if args.resume:
        done, losses, kept, earlier_seconds = load_sft_checkpoint(ckpt, args, policy, opt,
                                                                  induction)
        print(f"sft: resumed from {ckpt} after {done} of {args.induction_steps + args.steps} "
              "steps", flush=True)

    def checkpoint(n_done: int):
        if args.save_every and n_done % args.save_every == 0 and \
                n_done < args.induction_steps + args.steps:
            save_sft_checkpoint(ckpt, args, n_done, policy, opt, induction, losses, kept,
                                earlier_seconds + time.perf_counter() - t0)

    # 1. the copy circuit first (see InductionTask): linear warmup, then constant
    t_phase, first = time.perf_counter(), done
    for i in range(done, args.induction_steps):
        losses.append(step(masked_lm_loss(policy, *induction.rows(32)),
                           args.lr * min(1.0, (i + 1) / args.warmup)))
        if (i + 1) % 250 == 0 or i + 1 == args.induction_steps:
            rate = (time.perf_counter() - t_phase) / (i + 1 - first)
            print(f"  induction {i + 1}/{args.induction_steps}  loss "
                  f"{sum(losses[-250:]) / len(losses[-250:]):.4f}"
                  f"  ETA {probes.duration(rate * (args.induction_steps - i - 1))}", flush=True)
        checkpoint(i + 1)
    if done <= args.induction_steps:
        losses = []             # the dialog phase logs its own losses
    # 2. the dialogs, with a few induction rows kept in every batch: linear warmup, cosine to 0.1
    batches = sft_batches([len(x) for x, _ in examples], args.batch, args.steps, args.seed)
    t_phase, first = time.perf_counter(), max(0, done - args.induction_steps)
    for i in range(first, args.steps):
        rows = batches[i]
        warm = min(1.0, (i + 1) / args.warmup)
        cos = 0.1 + 0.45 * (1 + math.cos(math.pi * i / max(1, args.steps - 1)))
        pad = torch.nn.utils.rnn.pad_sequence      # to the longest row: pad_id, mask False
        ids = pad([examples[r][0] for r in rows], batch_first=True, padding_value=tok.pad_id)
        mask = pad([examples[r][1] for r in rows], batch_first=True)
        loss = masked_lm_loss(policy, ids, mask)
        extra = masked_lm_loss(policy, *induction.rows(args.induction_rows)) \
            if args.induction_rows else 0.0
        step(loss + extra, args.lr * warm * cos)
        losses.append(loss.item())
        kept.append(extra.item() if torch.is_tensor(extra) else extra)
        if (i + 1) % 50 == 0 or i + 1 == args.steps:
            rate = (time.perf_counter() - t_phase) / (i + 1 - first)
            print(f"  step {i + 1}/{args.steps}  loss {sum(losses[-50:]) / len(losses[-50:]):.4f}"
                  f"  induction loss {sum(kept[-50:]) / len(kept[-50:]):.4f}"
                  f"  ETA {probes.duration(rate * (args.steps - i - 1))}", flush=True)
        checkpoint(args.induction_steps + i + 1)
    policy.eval()
    seconds = earlier_seconds + time.perf_counter() - t0
    out = Path(args.out)
    save_policy(out, policy, tok, config)
    shutil.rmtree(ckpt, ignore_errors=True)
    result = {"train_seconds": round(seconds, 1), "final_loss": round(
        sum(losses[-50:]) / len(losses[-50:]), 4), "parameters": n_params}
    if args.eval_episodes:
        result.update(sft_eval(policy, tok, args))
    write_policy_readme(out, args, config, result, earlier)
    print(f"sft: wrote {out} in {probes.duration(time.perf_counter() - t0)}: " + json.dumps(result),
          flush=True)
    return result


def masked_lm_loss(policy, ids, mask) -> torch.Tensor:
    """Mean cross-entropy of the tokens where mask is True (the head runs on those only)."""
    h = policy.trunk(ids)
    target = mask[:, 1:]
    return F.cross_entropy(policy.lm_head(h[:, :-1][target]).float(), ids[:, 1:][target])


class InductionTask:
    """Rows "x x": a token string x (length 8-32, the same in a batch) and its repeat, the loss on
    the repeat. Only copying by content solves it: find where the current token came before,
    emit the token that followed (an induction head). x is random tokens, or, for a fraction
    `text` of the rows, a window of a training dialog after its prompt: there the tokens repeat
    ("." and digits in every price), as in a rollout, and the copy must key on more than one
    token.

    Why: a rollout copies items, stores and prices from the task and the observations into its
    thoughts and tool calls. Trained on the dialogs alone, a model this small did not find that
    circuit within our budget (held-out loss on the digits of its turns stayed at chance, ~2.2
    nats, after 500 steps). On this task it forms after a plateau of ~1,500 steps (a fraction of
    a minute each hundred); trained first on these rows (--induction-steps), then on the dialogs
    with a few such rows kept in every batch (--induction-rows), the policy copies."""

    def __init__(self, tok, seed: int, windows: list[torch.Tensor] = (), text: float = 0.0,
                 min_len: int = 8, max_len: int = 32):
        self.vocab, self.min_len, self.max_len = tok.tok.get_vocab_size(), min_len, max_len
        self.low = len(SPECIALS)                # the specials take ids 0-2: never drawn
        self.windows = [w for w in windows if len(w) >= max_len]
        self.text = text if self.windows else 0.0
        self.g = torch.Generator().manual_seed(seed + 1)

    def rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=self.g))
        x = torch.randint(self.low, self.vocab, (n, k), generator=self.g)
        for r in range(round(n * self.text)):
            w = self.windows[int(torch.randint(len(self.windows), (1,), generator=self.g))]
            a = int(torch.randint(len(w) - k + 1, (1,), generator=self.g))
            x[r] = w[a:a + k]
        ids = torch.cat([x, x], 1)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, k + 1:] = True          # the repeat's first token cannot be known: no loss there
        return ids, mask


def _policy_tensors(policy) -> dict[str, torch.Tensor]:
    """The weights as saved: the head is tied to the embeddings (tie_word_embeddings)."""
    return {k: v.contiguous() for k, v in policy.state_dict().items() if k != "lm_head.weight"}


def save_policy(out: Path, policy, tok, config: dict):
    out.mkdir(parents=True, exist_ok=True)
    model.write_atomic(out / "model.safetensors",
                       safetensors_bytes(_policy_tensors(policy), {"format": "pt"}))
    grpo.write_json(out / "config.json", config)
    model.write_atomic(out / "tokenizer.json", tok.tok.to_str(pretty=True))


# the flags a resumed sft run must share with the run it continues (the others change nothing
# that is trained)
_SFT_FREE_FLAGS = ("out", "resume", "save_every", "eval_episodes", "command")


def _sft_flags(args) -> dict:
    return {k: v for k, v in sorted(vars(args).items()) if k not in _SFT_FREE_FLAGS}


def save_sft_checkpoint(path: Path, args, done: int, policy, opt, induction, losses, kept,
                        seconds: float):
    """OUT/sft-checkpoint after `done` steps, written whole or not at all (a temporary directory
    renamed over the last one)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(_policy_tensors(policy), tmp / "model.safetensors")
        tensors, meta = grpo.optimizer_to_tensors(opt)
        save_file(tensors, tmp / "optimizer.safetensors")
        save_file({"induction": induction.g.get_state()}, tmp / "rng.safetensors")
        grpo.write_json(tmp / "trainer.json", {"done": done, "flags": _sft_flags(args),
                                               "losses": losses, "kept": kept,
                                               "seconds": seconds, "optimizer": meta})
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:        # a full disk: the last checkpoint stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"{path}: could not be written ({type(e).__name__}: {e}); free the "
                         "space and continue with --resume") from None


def load_sft_checkpoint(path: Path, args, policy, opt, induction) -> tuple:
    """Restore what save_sft_checkpoint wrote: (steps done, losses, kept, seconds so far)."""
    try:
        info = json.loads((path / "trainer.json").read_text())
        changed = [f"--{k.replace('_', '-')} {v} (was {info['flags'].get(k)})"
                   for k, v in _sft_flags(args).items() if info["flags"].get(k) != v]
        if changed:
            raise ValueError("it was trained with other flags: " + ", ".join(changed))
        state = load_file(path / "model.safetensors")
        missing, unexpected = policy.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"weights do not fit the model: missing {missing}, "
                             f"unexpected {unexpected}")
        grpo.optimizer_from_tensors(opt, load_file(path / "optimizer.safetensors"),
                                    info["optimizer"])
        induction.g.set_state(load_file(path / "rng.safetensors")["induction"])
        return int(info["done"]), info["losses"], info["kept"], float(info["seconds"])
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, SafetensorError) as e:
        raise SystemExit(f"{path}: cannot resume from this checkpoint ({type(e).__name__}: "
                         f"{e})") from None


@torch.no_grad()
def sft_eval(policy, tok, args) -> dict:
    """Held-out success: sampled at temperature 1 (what GRPO starts from) and greedy."""
    env = envs.ShopEnv("test", world=args.world)
    n = min(args.eval_episodes, len(env))
    play = argparse.Namespace(max_turns=envs.WORLD_TURNS[args.world], max_new_tokens=96,
                              max_len=4096, temperature=1.0, top_p=1.0)
    result = {"eval_episodes": n}
    for name, greedy in (("success_sampled", False), ("success_greedy", True)):
        g = torch.Generator().manual_seed(args.seed)
        total = 0.0
        for i in range(0, n, 25):
            episodes = [env.episode(j) for j in range(i, min(i + 25, n))]
            total += sum(t.score for t in rollout(policy, tok, episodes, play, greedy=greedy,
                                                  generator=g, stats=False))
        result[name] = round(total / n, 4)
    return result


def policy_recipe(directory) -> list[str]:
    """The commands that rebuilt a saved policy, from the README its sft run wrote ([] if none)."""
    readme = Path(directory) / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    m = re.search(r"```bash\n(.*?)```", text, re.S)
    return m.group(1).strip().splitlines() if m else []


def write_policy_readme(out: Path, args, config: dict, result: dict, earlier: list[str]):
    """README.md of a policy that sft wrote: how to rebuild it (the commands of the policy it was
    continued from first), its size, its training and its held-out success."""
    data = f"--contaminated {args.contaminated} --divided {args.divided} " \
        if args.world == "shop" else f"--world shop-long --slips {args.slips} "
    flags = ("steps", "batch", "lr", "warmup", "induction_steps", "induction_rows",
             "induction_text", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab",
             "seed", "threads")
    command = (f"python -m lab.shop sft --out {args.out} --episodes {args.episodes} {data}"
               + (f"--init {args.init} " if args.init else "")
               + " ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in flags))
    about = ("A tiny Qwen2-architecture model trained from scratch, with its own byte-level BPE "
             "tokenizer (ChatML specials), on the gold dialogs of the built-in `shop` world mixed "
             "with contaminated ones (python -m lab.shop make-data), after a warm-up on a "
             "synthetic copy task that gives it induction heads (shop.py InductionTask). Loss on "
             "assistant tokens only.")
    if args.init:
        about += " Then continued (`--init`, the last command) on the same dialogs" + \
            ("" if args.divided else ".")
    if args.divided:     # sft_dialogs divides in the dialogs not contaminated only
        about += (f"{', where, of those' if args.init else ' Of the dialogs'} not contaminated, "
                  f"{args.divided:.0%} of the non-USD ones convert the wrong way round, dividing "
                  "the dollar total by the rate (shop.shop_divided): a fluent, self-consistent "
                  "habit, given on purpose so that GRPO has something it can unlearn within "
                  "minutes. The policy's other errors are mostly a quantity recalled wrongly "
                  "from the task text on two- and three-line tasks: a missing skill that 20 "
                  "GRPO steps do not teach (README, Results on the built-in world).")
    elif args.init and args.world == "shop":
        about += "."
    title = "# shop-policy: the built-in policy of `python grpo.py`"
    if args.world == "shop-long":
        title = ("# shop-long-policy: the built-in policy of `python grpo.py --env shop-long`")
        about = (f"The policy of the long-horizon world (shop.py, shop-long: 3-4 lines, 9-11 "
                 f"turns), continued (`--init`, the last command) from the policy of the "
                 f"commands before it on the gold shop-long dialogs, where each of three slips "
                 f"is made in {args.slips:.0%} of the tasks that have its habit, drawn on its own "
                 "(shop.LONG_SLIPS, shop.LONG_HABITS): at store A or B the first Lookup at the "
                 "next store, with 4 lines the last running total leaving out the lines before "
                 "it, in EUR or GBP the conversion dividing by the rate. Each is a fluent, "
                 "turn-local habit at its own turn, each alone fails the episode: a rollout that "
                 "fails mostly holds one wrong decision among many right turns, the case a "
                 "per-turn reward is for.")
    lines = [title, "", about, "",
             "Rebuilt, byte for byte, by:", "", "```bash", *earlier, command, "```", "",
             "| | |", "|---|---|",
             f"| parameters | {result['parameters']:,} (hidden {config['hidden_size']}, "
             f"{config['num_hidden_layers']} layers, {config['num_attention_heads']} heads, "
             f"{config['num_key_value_heads']} KV heads, vocab {config['vocab_size']}) |",
             f"| training{' (last command)' if earlier else ''} | {args.induction_steps} induction "
             f"steps, then {args.steps} steps x {args.batch} dialogs, {result['train_seconds']:.0f}"
             f" s on {args.threads} CPU threads, final loss {result['final_loss']} |"]
    if "success_sampled" in result:
        lines += [f"| held-out success, sampled (T = 1) | {result['success_sampled']:.3f} "
                  f"({args.world} test episodes 0-{result['eval_episodes'] - 1}) |",
                  f"| held-out success, greedy | {result['success_greedy']:.3f} |"]
    model.write_atomic(out / "README.md", "\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

# The range of each numeric flag of sft, checked before anything is read or written (nan is in
# none; --lr and the shape: in main). Any BPE vocabulary holds the specials and the 256 bytes; a
# warmup of 1 step is none.
SFT_RANGES = {**dict.fromkeys(("steps", "batch", "warmup", "hidden", "layers", "heads", "kv_heads",
                               "intermediate"), grpo.at_least(1)),
              **dict.fromkeys(("induction_steps", "induction_rows", "save_every",
                               "eval_episodes"), grpo.at_least(0)),
              **dict.fromkeys(("contaminated", "divided", "slips", "induction_text"),
                              runs.within(0, 1)),
              "episodes": runs.within(2, envs.SHOP_SPLIT_SIZE["train"]),
              "seed": runs.within(0, 2**32 - 1), "vocab": grpo.at_least(len(SPECIALS) + 256),
              "threads": grpo.THREADS}


def chat_text(messages, add_generation_prompt=False) -> str:
    """The ChatML text of a chat, as the chat template writes it (the text a tokenizer is trained
    on; Tokenizer.render gives the ids, with the template's special tokens as ids)."""
    system = [] if messages and messages[0]["role"] == "system" else \
        [f"<|im_start|>system\n{model.DEFAULT_SYSTEM}<|im_end|>\n"]
    return "".join(system + [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                             for m in messages]) + \
        ("<|im_start|>assistant\n" if add_generation_prompt else "")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.shop", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-data", help="write the released-schema files of shop episodes",
                       description="Write the released-schema files of `--episodes` shop episodes "
                       "(80:20 train/test), byte for byte the same for one --episodes and --seed: "
                       "episode files, matched files and the diagnostic set (see make_shop_data).")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--episodes", type=int, default=1000, help="number of episodes (default 1000)")
    p.add_argument("--seed", type=int, default=42, help="generation seed (default 42)")

    p = sub.add_parser("sft", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="rebuild the built-in policy", description="Train the built-in policy "
                       "(deterministic): a tiny Qwen2 and its BPE tokenizer on shop gold dialogs "
                       "mixed with contaminated ones, from scratch or (--init) continuing a saved "
                       "one. data/shop-policy/README.md lists the commands that built the shipped "
                       "policy.")
    a = p.add_argument
    a("--out", help="output directory (default: the world's built-in policy, data/shop-policy or "
      "data/shop-long-policy)")
    a("--episodes", type=int, default=2500,
      help="make-data episodes (80%% of them, the train split, are used)")
    a("--contaminated", type=float, default=0.3,
      help="shop: fraction of dialogs replaced by their contaminated version")
    a("--divided", type=float, default=0.0,
      help="shop: fraction of the other non-USD dialogs replaced by one that converts the wrong "
           "way round, dividing by the rate (shop_divided): a habit for GRPO to unlearn")
    a("--world", default="shop", choices=tuple(envs.WORLDS),
      help="the world whose dialogs are trained on (shop-long: continue a shop policy, --init)")
    a("--slips", type=float, default=0.0,
      help="shop-long: probability of each of the three slips (LONG_SLIPS) in a dialog whose "
           "task has its habit (LONG_HABITS), drawn on its own")
    a("--init", default=None, metavar="DIR",
      help="continue from this saved policy (its weights, shape and tokenizer) instead of "
           "training from scratch; the shape and --vocab flags are then ignored")
    a("--steps", type=int, default=2000, help="optimizer steps on the dialogs")
    a("--batch", type=int, default=16, help="dialogs per step")
    a("--lr", type=float, default=3e-3,
      help="peak AdamW learning rate (dialog phase: cosine down to a tenth)")
    a("--warmup", type=int, default=30, help="linear warmup steps of each phase")
    a("--induction-steps", type=int, default=2000,
      help="steps of the induction task (32 rows each) before the dialogs (see InductionTask)")
    a("--induction-rows", type=int, default=16,
      help="induction rows kept in every dialog batch (0: none)")
    a("--induction-text", type=float, default=0.5,
      help="fraction of induction rows copying a dialog window instead of random tokens")
    a("--hidden", type=int, default=64, help="hidden size")
    a("--layers", type=int, default=4, help="transformer blocks")
    a("--heads", type=int, default=4, help="attention heads")
    a("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    a("--intermediate", type=int, default=256, help="MLP size")
    a("--vocab", type=int, default=1024, help="BPE vocabulary size (at most)")
    a("--seed", type=int, default=42, help="seed of the data draw, the init and the order")
    a("--threads", type=int, default=1, help="torch CPU threads (fixed: results depend on it)")
    a("--save-every", type=int, default=100,
      help="write OUT/sft-checkpoint every this many steps (induction and dialog steps counted "
           "together; 0: never); it is removed once the policy is written")
    a("--resume", action="store_true", help="continue from OUT/sft-checkpoint (the same flags; "
      "the result is byte for byte the uninterrupted run's)")
    a("--eval-episodes", type=int, default=100,
      help="held-out shop episodes to measure success on (0: skip)")
    args = ap.parse_args(argv)
    if args.command == "sft":
        args.out = args.out or str(envs.BUILTIN_POLICIES[args.world])
        grpo.check_ranges(ap, args, SFT_RANGES)
        train = args.episodes - (args.world == "shop") * max(1, args.episodes // 5)
        for bad, why in (
                (not 0 < args.lr < math.inf, "--lr must be a positive number"),
                (args.hidden % (2 * args.heads), "--hidden must be a multiple of 2 x --heads"),
                (args.heads % args.kv_heads, "--heads must be a multiple of --kv-heads"),
                (args.batch > train, f"--batch must be at most the {train} training dialogs"),
                (args.init and not Path(args.init).is_dir(), "--init must be a directory"),
                (args.world == "shop-long" and not args.init, "--world shop-long continues a shop "
                 "policy: pass --init DIR (its tokenizer knows the words of both worlds; the "
                 f"first command of {envs.BUILTIN_POLICIES['shop-long']}/README.md trains the "
                 "shipped one)"),
                (args.world == "shop" and args.slips or args.world == "shop-long" and args.divided,
                 "--slips is shop-long's habit and --divided shop's: pass the one of --world")):
            if bad:
                ap.error(why)
        with runs.exclusive_dir(args.out):    # one writer; a stopped run is not overwritten
            if (Path(args.out) / SFT_CHECKPOINT).is_dir() and not args.resume:
                ap.error(f"{Path(args.out) / SFT_CHECKPOINT} holds a stopped run: continue "
                         "it with --resume, or delete it to start over")
            return sft(args)
    try:
        counts = make_shop_data(args.out, args.episodes, args.seed)
    except envs.DataError as e:            # a bad flag: one clear line, no traceback
        sys.exit(f"error: {e}")
    except OSError as e:                   # e.g. --out is a file
        sys.exit(f"error: --out {args.out}: cannot write there ({e.strerror}: {e.filename})")
    print(f"make-data: {args.episodes} episodes (seed {args.seed}) -> {args.out}")
    for name, n in counts.items():
        unit = "turn records" if name.startswith("matched_") else "episodes"
        print(f"  {name:<34} {n:>7,} {unit}")
    return counts


if __name__ == "__main__":
    main()
