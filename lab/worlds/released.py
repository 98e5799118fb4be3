"""Data recipes for the released benchmarks (GTA, ToolBench), beside envs.py which loads and
replays their clean episodes: the contaminated and matched files (download, validation, loading),
the LLM contamination of episodes, the rule-based diagnostic set, episode splits of the test
files, and gold-dialog replay checks.


The commands that run them are lab/data.py's (`python -m lab.data`).
"""
from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import envs
import model
from lab.worlds import toolbench


def matched_record(episode_id: str, turn_idx: int, label: bool, kind, indices: list[int],
                   prefix_type: str, dialog: list[dict], **extra) -> dict:
    """One record of a matched file, in the released key order."""
    return {"episode_id": episode_id, "turn_idx": turn_idx, "label": int(label),
            "contamination_type": kind,
            "has_contaminated_prefix": any(i < turn_idx for i in indices),
            "original_contaminated_turn_indices": list(indices), "prefix_type": prefix_type,
            **extra, "dialogs": dialog}


# ---- The released files beyond the core's episode files: contaminated episodes, matched turns ---

# Every released file of a family; envs.RELEASE_FILES names only the episode files the core plays.
ALL_RELEASE_FILES = {family: [f"{kind}{part}_{split}.json" for kind in ("", "matched_")
                              for part in ("clean", "contaminated") for split in splits]
                     for family, splits in (("gta", ("train", "test")), ("toolbench", ("test",)))}
CONTAMINATION_TYPES = ("reasoning_error", "tool_misuse", "observation_misinterpretation",
                       "stale_memory")
_MATCHED_FIELDS = {
    "episode_id": lambda v: isinstance(v, str),
    "turn_idx": lambda v: type(v) is int,
    "dialogs": lambda v: True,
    "label": lambda v: type(v) is int and v in (0, 1),
    "contamination_type": lambda v: v is None or v in CONTAMINATION_TYPES,
    "has_contaminated_prefix": lambda v: isinstance(v, bool),
    "original_contaminated_turn_indices":
        lambda v: isinstance(v, list) and all(type(x) is int for x in v),
    "prefix_type": lambda v: v in ("clean", "contaminated")}
_CONTAMINATION_KEYS = ("contaminated_turn_indices", "contamination_types",
                       "original_turn_contents")


def download(family: str, data_dir=None, ref: str = envs.RELEASE_REF, force: bool = False) -> Path:
    """Fetch every released file of `family` into data_dir/family/ (returned), each validated
    before it is written (the core fetches only its episode files)."""
    folder = Path(data_dir or envs.default_data_dir()) / family
    for name in ALL_RELEASE_FILES[family]:
        check = check_matched_file if name.startswith("matched_") else check_released_episode_file
        envs.fetch(family, name, folder, check, ref, force)
    return folder


def check_released_episode_file(data, path) -> None:
    """envs.check_episode_file's checks, and a contaminated record's: its contaminated turns are
    assistant turns of a known contamination type."""
    envs.check_episode_file(data, path)
    keys = _CONTAMINATION_KEYS
    for rid, rec in data.items():
        if not any(k in rec for k in keys):
            continue
        where = f"{path}: record {rid}"
        envs.require(all(isinstance(rec.get(k), list) for k in keys) and
                     len({len(rec[k]) for k in keys}) == 1,
                     where, f"{', '.join(keys)} must be lists of one length")
        for idx, kind in zip(rec["contaminated_turn_indices"], rec["contamination_types"]):
            envs.require(type(idx) is int and 0 <= idx < len(rec["dialogs"]) and
                         rec["dialogs"][idx]["role"] == "assistant",
                         where, f"contaminated turn index {idx!r} is not an assistant turn")
            envs.require(kind in CONTAMINATION_TYPES, where,
                         f"unknown contamination type {kind!r}")


def load_released_episodes(path: str | Path) -> dict[str, dict]:
    """An episode file, clean or contaminated, every record validated: envs.load_episodes'
    checks and a contaminated record's fields (check_released_episode_file)."""
    path = Path(path)
    data = envs.read_data_json(path)
    check_released_episode_file(data, path)
    return data


def check_matched_file(data, path) -> None:
    envs.require(isinstance(data, list), path, "a matched file is a JSON list of records")
    for i, rec in enumerate(data):
        where = f"{path}: record {i}"
        envs.require(isinstance(rec, dict), where, "not an object")
        where += f" (episode {rec.get('episode_id')}, turn {rec.get('turn_idx')})"
        for key, ok in _MATCHED_FIELDS.items():
            envs.require(key in rec, where, f"missing '{key}'")
            if not ok(rec[key]):
                raise envs.DataError(f"{where}: bad '{key}': {rec[key]!r}")
        envs.check_dialog(rec["dialogs"], where)
        envs.require(rec["turn_idx"] == len(rec["dialogs"]) - 1 and
                     rec["dialogs"][-1]["role"] == "assistant",
                     where, "the dialog must end at turn_idx with the assistant evaluation turn")


def play_gold(episode: envs.Episode, dialog: list[dict]) -> list[tuple[str, str | None]]:
    """Step an episode through a gold dialog's assistant turns (METHOD.md §2 text).

    Returns (recorded observation, returned observation) for every gold tool call answered.
    """
    pairs = []
    for i, m in enumerate(dialog):
        if m["role"] != "assistant":
            continue
        result = episode.step(envs.render_assistant(m))
        nxt = dialog[i + 1] if i + 1 < len(dialog) else None
        if nxt is not None and nxt["role"] == "tool":
            pairs.append((envs.render_observation(envs.tool_result_text(nxt)),
                          result.observation))
        if result.done:
            break
    return pairs


# ---------------------------------------------------------------------------------------------
# Contamination of released episodes with an LLM (paper Appendix contam_procedure)
# ---------------------------------------------------------------------------------------------
# For an episode with T assistant turns, turn T is the evaluation turn. Pick j uniformly from
# 1..T-1, a type uniformly among those compatible with turn j (paper Table contam_compat), ask
# the LLM once for a plausible but objectively wrong version of that turn, replace turn j only,
# and log type, dialog index, original turn and raw reply. The choices come from
# random.Random(f"{seed}:{episode id}"), so a run is deterministic given --seed and the reply
# cache, and does not depend on the order of episodes.


_CONTAMINATION_PREAMBLE = """\
You help build a benchmark of errors made by tool-using AI agents. You receive an agent's task,
its trajectory so far, and one target step. Rewrite the target step so that it stays fluent,
confident, and consistent in style and length with the original, yet is objectively incorrect in
the specific way described below - the kind of mistake a reasonable but mistaken agent could
make. Never hint that the step is wrong: no disclaimers, apologies, or meta comments.
"""


CONTAMINATION_SYSTEM = {
    "reasoning_error": _CONTAMINATION_PREAMBLE + """
Error type: reasoning error. Rewrite the step's Thought so that it contains a logically flawed
inference - for example a wrong calculation or comparison, an unjustified conclusion, a mistaken
plan, or two entities confused - while reading as coherent with the conversation. The tool call
(if any) stays as it is and is not part of your reply.
Reply with a JSON object only: {"thought": "<the rewritten thought>"}""",
    "tool_misuse": _CONTAMINATION_PREAMBLE + """
Error type: tool misuse. Rewrite the step's tool call: call an inappropriate tool from the
available list, supply a malformed argument, or call the right tool with semantically wrong
parameters (a wrong value, entity, file, date or unit). The call must stay syntactically valid: a
tool name and a JSON object of arguments. The thought stays as it is.
Reply with a JSON object only: {"action": "<tool name>", "action_input": {<arguments>}}""",
    "observation_misinterpretation": _CONTAMINATION_PREAMBLE + """
Error type: observation misinterpretation. Rewrite the step's Thought so that it reaches a
conclusion inconsistent with the immediately preceding observation - for example claiming a call
succeeded when it failed, reading the wrong field or number, or misreporting a value. The tool
call (if any) stays as it is and is not part of your reply.
Reply with a JSON object only: {"thought": "<the rewritten thought>"}""",
    "stale_memory": _CONTAMINATION_PREAMBLE + """
Error type: stale memory. Rewrite the step so that it relies on information from earlier in the
trajectory in a way that contradicts later evidence - for example it carries an outdated value,
a superseded plan, or an earlier result that a later observation corrected, as if it were
current. Rewrite the Thought and, if the step calls a tool, the call consistently with the stale
belief (keep the call unchanged if the stale belief does not affect it).
Reply with a JSON object only: {"thought": "<the rewritten thought>"} for a step without a tool
call, else {"thought": "...", "action": "<tool name>", "action_input": {<arguments>}}""",
}


def assistant_positions(dialog: list[dict]) -> list[int]:
    return [i for i, m in enumerate(dialog) if m["role"] == "assistant"]


def compatible_types(dialog: list[dict], idx: int) -> list[str]:
    """Contamination types that fit the assistant turn dialog[idx] (paper Table contam_compat)."""
    positions = assistant_positions(dialog)
    prev = max((p for p in positions if p < idx), default=0)
    kinds = ["reasoning_error"]
    if dialog[idx].get("tool_calls"):
        kinds.append("tool_misuse")
    if any(m["role"] == "tool" for m in dialog[prev:idx]):
        kinds.append("observation_misinterpretation")
    if len(positions) >= 3:
        kinds.append("stale_memory")
    return kinds


def contamination_messages(record: dict, idx: int, kind: str) -> list[dict]:
    """The system + user prompt asking to rewrite the assistant turn dialog[idx] as `kind`."""
    dialog = record["dialogs"]
    turn_no = assistant_positions(dialog).index(idx) + 1
    n_turns = len(assistant_positions(dialog))
    tools = "\n".join(f"- {t['name']}: {' '.join((t.get('description') or '').split())}"
                      for t in record["tools"]) or "(none)"
    history = envs.dialog_to_messages(dialog[:idx], record["tools"], record["files"])[1:]
    trajectory = "\n\n".join(("Agent:\n" if m["role"] == "assistant" else "") + m["content"]
                             for m in history) or "(the target step is the first step)"
    parts = [f"Task given to the agent:\n{envs.render_task(dialog[0]['content'], record['files'])}",
             f"Available tools:\n{tools}",
             f"Trajectory before the target step:\n{trajectory}"]
    if kind == "observation_misinterpretation":
        obs = next(m for m in reversed(dialog[:idx]) if m["role"] == "tool")
        parts.append("The observation immediately before the target step:\n"
                     + envs.render_observation(envs.tool_result_text(obs)))
    parts.append(f"Target step (step {turn_no} of {n_turns}), to rewrite with a "
                 f"{kind.replace('_', ' ')} error:\n{envs.render_assistant(dialog[idx])}")
    parts.append("Reply with the JSON object described in your instructions.")
    return [{"role": "system", "content": CONTAMINATION_SYSTEM[kind]},
            {"role": "user", "content": "\n\n".join(parts)}]


def _reply_fields(kind: str, has_call: bool) -> tuple[bool, bool]:
    """(rewrites the thought, rewrites the tool call) for a contamination type."""
    return kind != "tool_misuse", kind == "tool_misuse" or (kind == "stale_memory" and has_call)


def contaminated_turn(message: dict, kind: str, reply: dict) -> dict:
    """The assistant turn with the fields `kind` rewrites replaced by the LLM's reply."""
    has_call = bool(message.get("tool_calls"))
    new_thought, new_call = _reply_fields(kind, has_call)
    new = dict(message)
    if new_thought:
        for key in ("explanation",) + (("content",) if has_call else ()):
            new.pop(key, None)      # those keys are read as thought (assistant_parts)
        new["thought"] = reply["thought"]
    if new_call:
        new["tool_calls"] = [{"type": "function", "function": {
            "name": reply["action"], "arguments": reply["action_input"]}}]
    return new


def contaminate_record(client: toolbench.ChatClient, key: str, record: dict, seed: int
                       ) -> tuple[dict | None, str]:
    """(contaminated record, "ok") or (None, why it was left out)."""
    dialog = record["dialogs"]
    positions = assistant_positions(dialog)
    rng = random.Random(f"{seed}:{key}")
    j = rng.randrange(1, len(positions))                 # 1..T-1, never the evaluation turn
    idx = positions[j - 1]
    kind = rng.choice(compatible_types(dialog, idx))
    has_call = bool(dialog[idx].get("tool_calls"))
    new_thought, new_call = _reply_fields(kind, has_call)

    def check(obj):
        if new_thought and not (isinstance(obj.get("thought"), str) and obj["thought"].strip()):
            raise ValueError("missing 'thought'")
        if new_call and not (isinstance(obj.get("action"), str) and obj["action"].strip()
                             and isinstance(obj.get("action_input"), dict)):
            raise ValueError("missing 'action' or 'action_input' (a JSON object)")
        if model.holds_lone_surrogate(obj):
            # the contaminated file is written as UTF-8, which cannot hold it
            raise ValueError("a \\ud800-\\udfff escape that is not half of a surrogate pair")
    try:
        reply, raw = client.chat_json(contamination_messages(record, idx, kind), check=check,
                                      max_tokens=1024)
    except toolbench.BadReply as e:  # one call per turn (paper): a bad reply leaves the episode out
        print(f"episode {key}: {e}", file=sys.stderr)
        return None, "bad_reply"
    turn = contaminated_turn(dialog[idx], kind, reply)
    if envs.render_assistant(turn) == envs.render_assistant(dialog[idx]):
        return None, "unchanged"
    out = dict(record)
    out["dialogs"] = dialog[:idx] + [turn] + dialog[idx + 1:]
    out["contaminated_turn_indices"] = [idx]
    out["contamination_types"] = [kind]
    out["original_turn_contents"] = [dialog[idx]]
    out["contamination_responses"] = [raw]
    return out, "ok"


def contaminate_file(data: str | Path, out: str | Path, client: toolbench.ChatClient,
                     seed: int = 42, min_turns: int = 3, max_turns: int = 8) -> dict[str, int]:
    """Contaminate every episode of an episode file whose assistant-turn count T lies in
    [min_turns, max_turns] (the paper's filters); write the released schema atomically."""
    if min_turns < 2:
        raise envs.DataError(f"--min-turns {min_turns}: at least 2 (a turn before the "
                             "evaluation turn)")
    if min_turns > max_turns:
        raise envs.DataError(f"--min-turns {min_turns} > --max-turns {max_turns}: no episode "
                             "would do")
    if Path(out).resolve() == Path(data).resolve():
        raise envs.DataError(f"--out {out} is --data: it would replace the episodes it reads")
    episodes = envs.load_episodes(data)
    result, counts = {}, {}
    for key, record in episodes.items():
        if "contaminated_turn_indices" in record:
            raise envs.DataError(f"{data}: record {key}: already contaminated")
        n_turns = len(assistant_positions(record["dialogs"]))
        if not min_turns <= n_turns <= max_turns:
            status = "turns_out_of_range"
        else:
            new, status = contaminate_record(client, key, record, seed)
            if new is not None:
                result[key] = new
        counts[status] = counts.get(status, 0) + 1
    if not result:
        raise envs.DataError(f"{data}: no episode was contaminated ({counts}); {out} not written")
    check_released_episode_file(result, out)
    model.write_atomic(Path(out), json.dumps(result, indent=2, ensure_ascii=False).encode("utf-8"))
    return counts


# make-diagnostic gta: the adversarial diagnostic set (paper Appendix diagnostic, METHOD.md §8e).
#   looks-wrong-but-right (label 1): every released matched_contaminated_test record with
#     has_contaminated_prefix and label 1 - the gold evaluation turn after a contaminated prefix.
#   looks-right-but-wrong (label 0), after the gold (clean) prefix, at most one per rule and
#     episode, at a position drawn with the seed among those where the rule applies:
#     repeat_previous_call - the previous assistant message (thought and tool call) verbatim: a
#       redundant retrieval (GTA tools are deterministic, a repeat learns nothing); not used
#       where the gold turn itself makes that call;
#     unused_observation_number - the gold turn with a number it copies from an earlier
#       observation replaced, in its call and its thought, by another number of the earlier
#       observations that no gold assistant turn and no reference answer contains: a fluent call
#       of a task tool on a value the solution never uses. OCR box coordinates "(x1, y1, x2, y2)"
#       are not values a solution copies, so they are not taken.
# The paper built its set with an LLM; these rules need none, and each negative is checked to
# differ from the gold turn at its position.
DIAGNOSTIC_RULES = ("repeat_previous_call", "unused_observation_number")


_NUMBER = re.compile(r"(?<![\w.,])\d+(?:\.\d+)?(?![\w]|[.,]\d)")


_BOX = re.compile(r"\(\d+, \d+, \d+, \d+\)")


def _tool_call(message: dict) -> tuple[str, str] | None:
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not calls:
        return None
    fn = calls[0]["function"]
    return fn["name"], json.dumps(fn["arguments"], sort_keys=True)


def _numbers(text: str) -> list[str]:
    return _NUMBER.findall(_BOX.sub(" ", text))


def _swap_number(text: str, old: str, new: str) -> str:
    return re.sub(r"(?<![\w.,])" + re.escape(old) + r"(?![\w]|[.,]\d)", new, text)


def _gold_numbers(record: dict) -> set[str]:
    """Every number a gold assistant turn or a reference answer contains."""
    texts = [json.dumps(m, ensure_ascii=False) for m in record["dialogs"]
             if m["role"] == "assistant"]
    texts.append(json.dumps(record.get("gt_answer"), ensure_ascii=False))
    return {n for text in texts for n in _NUMBER.findall(text)}


def repeat_previous_call(dialog: list[dict], t: int) -> dict | None:
    prev = dialog[t - 2] if t >= 2 else {}
    if _tool_call(prev) is None or _tool_call(dialog[t]) == _tool_call(prev):
        return None
    return json.loads(json.dumps(prev))


def unused_observation_number(record: dict, t: int, rng: random.Random) -> dict | None:
    dialog, gold = record["dialogs"], record["dialogs"][t]
    if _tool_call(gold) is None:
        return None
    seen = {n for m in dialog[:t] if m["role"] == "tool"
            for n in _numbers(envs.tool_result_text(m))}
    arguments = gold["tool_calls"][0]["function"]["arguments"]
    copied = sorted({n for v in arguments.values() if isinstance(v, str)
                     for n in _numbers(v)} & seen)
    unused = sorted(seen - _gold_numbers(record))
    if not copied or not unused:
        return None
    old, new = rng.choice(copied), rng.choice(unused)
    turn = json.loads(json.dumps(gold))
    fn = turn["tool_calls"][0]["function"]
    fn["arguments"] = {k: _swap_number(v, old, new) if isinstance(v, str) else v
                       for k, v in fn["arguments"].items()}
    if isinstance(turn.get("thought"), str):
        turn["thought"] = _swap_number(turn["thought"], old, new)
    return turn if _tool_call(turn) != _tool_call(gold) else None


def gta_diagnostic(clean: dict[str, dict], contaminated_matched: list[dict],
                   seed: int = 0) -> list[dict]:
    """The diagnostic records of the GTA test split, episode by episode in file order."""
    positives: dict[str, list[dict]] = {}
    for rec in contaminated_matched:
        if rec["has_contaminated_prefix"] and rec["label"] == 1:
            positives.setdefault(rec["episode_id"], []).append(
                {**{k: v for k, v in rec.items() if k != "dialogs"},
                 "diagnostic": "inconsistent_correct",
                 "diagnostic_rule": "gold_after_contaminated_prefix", "dialogs": rec["dialogs"]})
    out = []
    for eid, record in clean.items():
        dialog = record["dialogs"]
        rng = random.Random(f"gta-diagnostic-{seed}-{eid}")
        turns = [t for t in assistant_positions(dialog) if t >= 1]
        for rule in DIAGNOSTIC_RULES:
            made = [(t, repeat_previous_call(dialog, t) if rule == DIAGNOSTIC_RULES[0]
                     else unused_observation_number(record, t, rng)) for t in turns]
            made = [(t, turn) for t, turn in made if turn is not None]
            if made:
                t, turn = rng.choice(made)
                out.append(matched_record(eid, t, False, None, [], "clean",
                                          dialog[:t] + [turn], diagnostic="consistent_incorrect",
                                          diagnostic_rule=rule))
        out += positives.pop(eid, [])
    if positives:
        raise envs.DataError(f"matched_contaminated_test episodes {sorted(positives)} are not in "
                             "clean_test.json")
    return out


def family_folder(data_dir, family: str) -> Path:
    """DATA_DIR/<family>/. A --data-dir that is the family's folder itself (it holds the
    released files) is refused with one line, not answered with a download beside it."""
    root = Path(data_dir or envs.default_data_dir())
    if not (root / family).is_dir() and (root / "matched_clean_test.json").is_file():
        raise envs.DataError(f"--data-dir {root}: holds the {family} files itself; --data-dir is "
                             f"the folder above it ({root.parent}), which holds {family}/")
    return root / family


def make_gta_diagnostic(data_dir=None, out_dir=None, seed: int = 0) -> dict[str, int]:
    """Write matched_diagnostic_test.json and its episode file diagnostic_test.json (the clean
    test episodes, for the tool lists) to out_dir (default: the released gta folder)."""
    folder = family_folder(data_dir, "gta")
    if not (folder / "matched_contaminated_test.json").is_file():
        download("gta", folder.parent)
    clean = envs.load_episodes(folder / "clean_test.json")
    matched = envs.read_data_json(folder / "matched_contaminated_test.json")
    check_matched_file(matched, folder / "matched_contaminated_test.json")
    records = gta_diagnostic(clean, matched, seed)
    check_matched_file(records, "matched_diagnostic_test.json")
    used = {r["episode_id"] for r in records}
    out_dir = Path(out_dir or folder)
    model.write_atomic(out_dir / "diagnostic_test.json", json.dumps(
        {k: v for k, v in clean.items() if k in used}, indent=2).encode())
    model.write_atomic(out_dir / "matched_diagnostic_test.json", json.dumps(records).encode())
    counts: dict[str, int] = {}
    for r in records:
        counts[r["diagnostic_rule"]] = counts.get(r["diagnostic_rule"], 0) + 1
    return {"records": len(records), "episodes": len(used), **counts}


# split-episodes: a train split from released test files (ToolBench has none, METHOD.md §1).
# The episodes of the test files are drawn into two halves with a seed; each half gets all four
# files (episode and matched, clean and contaminated) named as released. *Departure*: the paper
# trained on ToolBench train episodes, which are not public; probes fitted on half of the test
# episodes and scored on the other half answer the same question on fewer data.
SPLIT_FILES = ("clean", "contaminated", "matched_clean", "matched_contaminated")


def split_episodes(data_dir, family: str, out_dir, seed: int = 0, fraction: float = 0.5,
                   episodes: int | None = None) -> dict[str, int]:
    """Write {clean,contaminated,matched_clean,matched_contaminated}_{train,test}.json of the
    family's test episodes split by episode (`fraction` to train), optionally of a seeded
    subsample of `episodes` episodes first. Returns records per file written."""
    if not 0 < fraction < 1:
        raise envs.DataError(f"--fraction {fraction}: must be strictly between 0 and 1")
    folder = family_folder(data_dir, family)
    if Path(out_dir).resolve() == folder.resolve():
        raise envs.DataError(f"--out {out_dir}: that is where the released files are, and the "
                             "split would overwrite their test files: write it to another folder "
                             f"(e.g. OUT/{family}, then --data-dir OUT)")
    if not all((folder / f"{name}_test.json").is_file() for name in SPLIT_FILES):
        download(family, folder.parent)
    data = {}
    for name in SPLIT_FILES:
        path = folder / f"{name}_test.json"
        data[name] = envs.read_data_json(path)
        check = check_matched_file if name.startswith("matched_") else check_released_episode_file
        check(data[name], path)
    ids = sorted(data["clean"])
    rng = random.Random(f"split-{family}-{seed}")
    rng.shuffle(ids)
    if episodes is not None:
        if episodes < 2:
            raise envs.DataError(f"--episodes {episodes}: need at least 2 (one per half)")
        ids = ids[:episodes]
    n_train = max(1, min(len(ids) - 1, round(fraction * len(ids))))
    halves = {"train": set(ids[:n_train]), "test": set(ids[n_train:])}
    counts = {}
    for split, keep in halves.items():
        for name in SPLIT_FILES:
            if name.startswith("matched_"):
                part = [r for r in data[name] if r["episode_id"] in keep]
            else:
                part = {k: v for k, v in data[name].items() if k in keep}
            target = Path(out_dir) / f"{name}_{split}.json"
            model.write_atomic(target, json.dumps(part, indent=None if name.startswith("matched_")
                                                  else 2).encode())
            counts[target.name] = len(part)
    return counts


def replay_report(env: envs.Env, match: str | None = None, score: bool = True) -> dict:
    """Play every gold dialog of a replay env: observation mismatches, mean gold score, skips."""
    mismatches, scores, skips = 0, [], {}
    for key in env.ids:
        ep = env.episode(key)
        pairs = play_gold(ep, env.records[key]["dialogs"])
        mismatches += sum(recorded != got for recorded, got in pairs)
        if not score:
            continue
        s = ep.score(match) if isinstance(ep, envs.GTAEpisode) else ep.score()
        if s is None:
            skips[ep.skip_reason] = skips.get(ep.skip_reason, 0) + 1
        else:
            scores.append(s)
    report = {"episodes": len(env), "observation_mismatches": mismatches}
    if score:
        report.update(scored=len(scores), skipped=skips,
                      mean_gold_score=sum(scores) / len(scores) if scores else None)
    return report


def nearest(cache: envs.ReplayCache, name: str, arguments) -> str | None:
    """ToolBench's optional fuzzy fallback (METHOD.md §10): the same tool's entry of highest
    Jaccard overlap of argument tokens (lowercased words of the canonical JSON, keys included);
    ties go to the entry recorded first."""
    tokens = set(re.findall(r"\w+", envs.cache_key(name, arguments)[1].lower()))
    best, best_sim = None, -1.0
    for key in cache.entries:
        if key[0] != name:
            continue
        other = set(re.findall(r"\w+", key[1].lower()))
        union = tokens | other
        sim = len(tokens & other) / len(union) if union else 1.0
        if sim > best_sim:
            best, best_sim = key, sim
    return cache.serve(best) if best is not None else None


class FuzzyToolBenchEpisode(toolbench.ToolBenchEpisode):
    """ToolBench replay whose cache misses fall back to the nearest recorded call."""

    def call_tool(self, name: str, arguments: dict) -> str:
        hit = self.cache.lookup(name, arguments)
        if hit is None:
            hit = nearest(self.cache, name, arguments)
        return hit if hit is not None else envs.simulator_miss(name, arguments)


def load_matched(path: str | Path) -> list[dict]:
    """A matched file, every record validated, each given the `tools` and `files` of its episode
    (from the episode file of the same family: matched_clean_train -> clean_train.json)."""
    path = Path(path)
    data = envs.read_data_json(path)
    check_matched_file(data, path)
    if not path.name.startswith("matched_"):
        raise envs.DataError(f"{path}: a matched file is named matched_<family>_<split>.json")
    episode_path = path.with_name(path.name[len("matched_"):])
    episodes = load_released_episodes(episode_path)
    out = []
    for i, rec in enumerate(data):
        ep = episodes.get(rec["episode_id"])
        if ep is None:
            raise envs.DataError(f"{path}: record {i} (episode {rec['episode_id']}): episode "
                                 f"not found in {episode_path}")
        out.append({**rec, "tools": ep["tools"], "files": ep["files"]})
    return out


def record_messages(record: dict) -> list[dict]:
    """Messages of an episode record, or of a matched record returned by load_matched."""
    return envs.dialog_to_messages(record["dialogs"], record["tools"], record.get("files") or ())
