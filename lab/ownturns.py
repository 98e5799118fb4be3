"""The model's own turns on GTA, labelled (issue 68): at each assistant turn of a released GTA
episode, given the gold dialog before it, the model writes the turn itself, k samples at
temperature 1 and the greedy one, through the product's generation path (probes.generate: the
statistics and hidden states every probe reads come from the sampling pass, no second forward).
Each turn is labelled against its episode's gold dialog and reference answer by the rule below,
and its features are written as `lab.study extract` writes them, so lab.detection reads them.

    python -m lab.ownturns extract --model DIR --split train --out OUT/train   # resumable
    python -m lab.ownturns extract --model DIR --split train --besides OUT/train --out OUT/more
    python -m lab.ownturns report --out OUT/train --show 10        # counts so far, 10 turns
    python -m lab.ownturns detect --corpus OUT/train OUT/test --out OUT   # every method's AUROC

The second line grows a corpus with the split's other episodes (--besides: none sampled twice).
`extract --raise-k OUT/train --seed 1 --out OUT/raised` samples k more turns where k were too
few: at the prefixes of OUT/train holding a right turn whose samples do not hold both classes
(most often: the greedy turn right, every sample wrong); detect joins them to those prefixes.

The prompt is the gold prefix as a rollout renders it (envs.dialog_to_messages, then the ChatML
template with the assistant header). Its forward runs once per prefix: all its tokens but the
last are prefilled into a one-row KV cache, every sampled row and the greedy row start from a copy
of that row, and probes.generate appends the last prompt token and decodes. Each prefix samples
with its own generator, seeded by --seed, the episode id and the turn, so a prefix gives the same
turns whatever else is extracted, and a resumed run the same files as one never stopped.

The labelling rule (1 right, 0 wrong, None undecided: counted, with its reason, and left out):
- malformed (envs.parse_react gives a ParseError): wrong when the turn ended (its <|im_end|>);
  undecided when --max-new-tokens cut it first, since a run allowing more tokens might have
  finished the step (a cut turn whose first step parses is labelled by the rules below).
- a final answer: right iff it matches the reference by GTA's loose matching (envs.gta_match,
  as the paper evaluates), wherever the gold dialog answers; undecided where matching cannot
  score the episode (envs.gta_skip_reason: no reference, a reference list, an image answer).
- a call, the first of these that applies:
  right when it is the call of the gold turn it replaces (the replay cache's key, envs.cache_key,
  of the arguments normalized: strings by case and spacing, numbers by value);
  wrong when it calls a tool GTA answers "not available" (envs.GTA_UNAVAILABLE) or a tool the
  episode does not list;
  wrong when it repeats a call the gold prefix already made and was answered (it cannot
  advance the task; lab.data's diagnostic rule repeat_previous_call counts it wrong too);
  undecided when it is a call the gold dialog makes at a later turn (the gold's order need not
  be the only one);
  right when it and the gold turn both call the Calculator and their expressions have the same
  value (envs.calculate); wrong when another value or an error;
  wrong otherwise: a listed tool with arguments the gold dialog never used.

What OUT holds: parts/ (the manifest and the shards of every turn sampled, the undecided ones
included, kept after the merge), own_turns.safetensors (the labelled turns, study layout: the
raw features of lab.detection.RAW_KEYS, label, turn_idx and the columns of TURN_KEYS, the episode
ids, kinds, reasons and texts in its metadata), turns.jsonl (every turn, its text and its label
or undecided reason) and summary.json (the counts). Rerunning extract with the same arguments
resumes after the last shard written, or merges again (with this file's rule) when all are done.
The generation path gives each token's log-probability, not the distribution's entropy: a turn
keeps its mean token log-probability; the entropy read is the attention's (attn_entropy).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import envs
import grpo
import model as mdl
import probes
from lab.infra import runs
from lab.probing import detection, features
from lab.probing import owndetect

FORMAT = "ownturns/1"
SAMPLE_TEMPERATURE = 1.0
# Per-turn columns of a shard and of own_turns.safetensors beside the raw features.
TURN_KEYS = ("prefix", "sample", "greedy", "turn_idx", "logprob_mean", "n_tokens", "finished",
             "prompt_tokens")
KINDS = ("call", "final", "malformed")


# ---- The prefixes: every assistant turn of the chosen episodes ----------------------------------

@dataclass
class Prefix:
    index: int              # in the extraction's list of prefixes
    episode_id: str
    turn_idx: int           # the gold assistant message replaced, an index into its dialogs
    ids: list[int]          # the prompt: the gold dialog before it, with the assistant header


def choose_episodes(env: envs.GTAEnv, n: int | None, seed: int,
                    besides: frozenset[str] = frozenset()) -> list[str]:
    """Every episode of the split not in `besides`, or n of them drawn with `seed` (lab.study's
    draw), in file order."""
    ids = [key for key in env.ids if key not in besides]
    if n is None:
        return ids
    return [r["episode_id"] for r in features.subsample_episodes(
        [{"episode_id": key} for key in ids], n, seed)]


def manifest_at(out: str, split: str, data_path: Path, flag: str) -> dict:
    """The manifest of the extraction in `out`, which must be of the same split of the same
    data file (`data_path`, the split's); `flag` names the option that read it."""
    path = Path(out) / "parts" / "manifest.json"
    if not path.is_file():
        raise SystemExit(f"{flag} {out}: {path} not found (not an extraction directory)")
    m = json.loads(path.read_text())
    if m.get("split") != split or m.get("data_sha256") != grpo.file_sha256(data_path):
        raise SystemExit(f"{flag} {out}: it sampled another split or data file than "
                         f"{data_path} ({split})")
    return m


def episodes_sampled(out: str, env: envs.GTAEnv, split: str, data_path: Path) -> set[str]:
    """The episodes the extraction in `out` samples (its manifest's draw): what --besides
    leaves out."""
    m = manifest_at(out, split, data_path, "--besides")
    if m.get("raise_k"):
        return {key.rsplit("/", 1)[0] for key in m["raise_k"]}
    return set(choose_episodes(env, m["episodes"], m["episode_seed"],
                               frozenset(m.get("besides", ()))))


def prefixes_to_raise(dirs: list[str], split: str, data_path: Path,
                      seed: int) -> set[tuple[str, int]]:
    """(episode id, turn) of every prefix of the merged extractions in `dirs` that holds a right
    turn while its sampled turns do not hold both classes: where k samples were too few for a
    group to show the model's right and wrong turns side by side (--raise-k). Their --seed must
    differ from `seed`, or the new samples would repeat theirs."""
    labels: dict[tuple[str, int], dict[str, set]] = {}
    for out in dirs:
        m = manifest_at(out, split, data_path, "--raise-k")
        if m.get("seed") == seed:
            raise SystemExit(f"--raise-k {out}: it sampled with --seed {seed}; give another "
                             f"--seed, or the new turns repeat its turns")
        path = Path(out) / "turns.jsonl"
        if not path.is_file():
            raise SystemExit(f"--raise-k {out}: {path} not found; finish its extraction first")
        for line in path.read_text().splitlines():
            t = json.loads(line)
            if t["label"] is None:
                continue
            entry = labels.setdefault((t["episode_id"], t["turn_idx"]),
                                      {"all": set(), "sampled": set()})
            entry["all"].add(t["label"])
            if not t["greedy"]:
                entry["sampled"].add(t["label"])
    return {key for key, e in labels.items() if 1 in e["all"] and len(e["sampled"]) < 2}


def prefixes(env: envs.GTAEnv, episode_ids: list[str], tok: mdl.Tokenizer) -> list[Prefix]:
    out = []
    for key in episode_ids:
        record = env.records[key]
        dialog = record["dialogs"]
        for t, message in enumerate(dialog):
            if message["role"] != "assistant":
                continue
            messages = envs.dialog_to_messages(dialog[:t], record["tools"], record["files"])
            ids = tok.render(messages, add_generation_prompt=True)[0]
            out.append(Prefix(len(out), key, t, ids))
    return out


def prefix_seed(seed: int, episode_id: str, turn_idx: int) -> int:
    digest = hashlib.sha256(f"{seed}\0{episode_id}\0{turn_idx}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1         # a non-negative int64


# ---- Sampling: k turns at temperature 1 and the greedy one from one forward of the prompt -------

def rows_of(cache: list[mdl.KVCache], rows: int) -> list[mdl.KVCache]:
    """A new cache of `rows` rows, each a copy of row 0 of `cache` (its capacity, its length)."""
    out = []
    for c in cache:
        _, kv, capacity, head_dim = c.k.shape
        n = int(c.lengths[0])
        copy = mdl.KVCache(rows, kv, head_dim, capacity, c.k.dtype, c.k.device)
        copy.k[:, :, :n] = c.k[:1, :, :n]
        copy.v[:, :, :n] = c.v[:1, :, :n]
        copy.lengths = torch.full((rows,), n, dtype=torch.long)
        out.append(copy)
    return out


@torch.no_grad()
def own_turns(net: mdl.Transformer, tok: mdl.Tokenizer, ids: list[int], k: int,
              max_new_tokens: int, generator: torch.Generator,
              greedy: bool = True) -> list[probes.TurnTrace]:
    """k turns sampled at SAMPLE_TEMPERATURE, then (with `greedy`) the greedy turn, after the
    prompt `ids`. The prompt but its last token is prefilled once; probes.generate needs a token
    to append, so each row appends the last one to its copy of that cache and decodes (see the
    module docstring)."""
    base = net.new_cache(1, capacity=len(ids) + max_new_tokens + 1)
    probes.prefill_last(net, base, [ids[:-1]])
    stop = [tok.im_end_id]
    sampled = probes.generate(net, rows_of(base, k), [ids[-1:]] * k, max_new_tokens,
                              SAMPLE_TEMPERATURE, stop_ids=stop, generator=generator)
    if not greedy:
        return sampled
    return sampled + probes.generate(net, rows_of(base, 1), [ids[-1:]], max_new_tokens, 0.0,
                                     stop_ids=stop)


def turn_text(tok: mdl.Tokenizer, trace: probes.TurnTrace) -> str:
    """What the environment reads of a turn: its text without the closing <|im_end|>."""
    said = trace.tokens[:-1] if trace.finished else trace.tokens
    return tok.decode(said)


# ---- The labelling rule (module docstring) ------------------------------------------------------

@dataclass
class Verdict:
    kind: str               # one of KINDS
    label: int | None       # 1 right, 0 wrong, None undecided
    reason: str


def normalized(value):
    """An argument as the rule compares it: strings lower-cased with single spaces, numbers (and
    strings that are numbers) as floats, lists and objects element by element."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    text = " ".join(str(value).split()).lower()
    try:
        number = float(text)
    except ValueError:
        return text
    if math.isfinite(number):
        return number
    return text


def call_key(name: str, arguments: dict) -> tuple[str, str]:
    return envs.cache_key(name, normalized(arguments))


def gold_calls(dialog: list[dict]) -> dict[tuple[str, str], list[int]]:
    """call_key -> the indices of the gold assistant messages making that call; the name read
    back through parse_react, as envs.ReplayCache keys it."""
    calls = {}
    for t, message in enumerate(dialog):
        if message["role"] != "assistant":
            continue
        _, call, _ = envs.assistant_parts(message)
        if call is None:
            continue
        arguments = call.get("arguments") or {}
        parsed = envs.parse_react(envs.render_action(None, call["name"], arguments))
        name = parsed.name if isinstance(parsed, envs.Action) else call["name"]
        calls.setdefault(call_key(name, arguments), []).append(t)
    return calls


def calculator_value(arguments: dict) -> float | None:
    """The value of a Calculator call's expression, None when it has none or it fails."""
    expression = arguments.get("expression")
    if not isinstance(expression, str):
        return None
    result = envs.calculate(expression)
    try:
        return float(result)
    except ValueError:          # "Error: ..."
        return None


def label_turn(text: str, record: dict, turn_idx: int, finished: bool = True) -> Verdict:
    """The rule of the module docstring: the turn `text` written in place of gold assistant
    message turn_idx of `record` (a GTA episode: dialogs, tools, gt_answer); `finished` False
    when the token budget cut the turn before its end."""
    step = envs.parse_react(text)
    if isinstance(step, envs.ParseError):
        if not finished:
            return Verdict("malformed", None, "truncated")
        return Verdict("malformed", 0, "parse_error")
    dialog = record["dialogs"]
    if isinstance(step, envs.Final):
        skip = envs.gta_skip_reason(record["gt_answer"], dialog)
        if skip is not None:
            return Verdict("final", None, f"no_reference:{skip}")
        if envs.gta_match(step.answer, record["gt_answer"], "loose"):
            return Verdict("final", 1, "answer_match")
        return Verdict("final", 0, "answer_mismatch")
    made = gold_calls(dialog).get(call_key(step.name, step.arguments), [])
    if turn_idx in made:
        return Verdict("call", 1, "gold_call")
    if step.name in envs.GTA_UNAVAILABLE:
        return Verdict("call", 0, "unavailable_tool")
    if step.name not in {tool["name"] for tool in record["tools"]}:
        return Verdict("call", 0, "unlisted_tool")
    if made and min(made) < turn_idx:
        return Verdict("call", 0, "repeated_call")
    if made:
        return Verdict("call", None, "later_gold_call")
    _, gold, _ = envs.assistant_parts(dialog[turn_idx])
    if step.name == "Calculator" and gold is not None and gold["name"] == "Calculator":
        mine = calculator_value(step.arguments)
        theirs = calculator_value(gold.get("arguments") or {})
        if mine is None:
            return Verdict("call", 0, "calculator_error")
        if theirs is not None and math.isclose(mine, theirs, rel_tol=1e-9, abs_tol=1e-12):
            return Verdict("call", 1, "same_value")
        return Verdict("call", 0, "other_value")
    return Verdict("call", 0, "unseen_arguments")


# ---- The shards: every turn of a few prefixes, written atomically -------------------------------

def manifest_of(args, net, data_path: Path, n_prefixes: int) -> dict:
    """What the turns depend on; a resumed run must match it (the model's and data's paths
    aside: a moved copy resumes)."""
    return {"format": FORMAT, "split": args.split, "data_sha256": grpo.file_sha256(data_path),
            "model_sha256": mdl.checkpoint_sha256(net.checkpoint_dir), "dtype": args.dtype,
            "k": args.k, "temperature": SAMPLE_TEMPERATURE, "max_new_tokens": args.max_new_tokens,
            "seed": args.seed, "episodes": args.episodes, "episode_seed": args.episode_seed,
            "threads": args.threads, "prefixes": n_prefixes}


def open_parts(parts: Path, manifest: dict) -> set[int]:
    """The prefixes already sampled under `parts` (created with the manifest for a fresh run)."""
    features.claim_parts(parts, manifest)
    done = set()
    for _, texts, tensors in read_shards(parts):
        done.update(tensors["prefix"].tolist())
    return done


def read_shards(parts: Path):
    """(path, per-turn strings, tensors) of every shard, in order."""
    for path in sorted(parts.glob("shard_*.safetensors")):
        tensors, meta = probes.read_safetensors(path, "shard")
        strings = probes.json_entry(meta, "ownturns", path)
        if not isinstance(strings, dict) or "prefix" not in tensors:
            raise probes.FormatError(f"{path}: not a shard of `python -m lab.ownturns extract`; "
                                     f"delete {parts} to start over")
        yield path, strings, tensors


def write_shard(parts: Path, rows: list[dict], strings: dict[str, list]) -> None:
    tensors = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    first = int(tensors["prefix"][0])
    probes.save_safetensors(tensors, parts / f"shard_{first:07d}.safetensors",
                            {"ownturns": json.dumps(strings)})


def turn_rows(prefix: Prefix, traces: list[probes.TurnTrace], tok,
              greedy: bool) -> tuple[list[dict], list]:
    """One row of tensors per turn of a prefix (with `greedy`, the greedy one last), and the
    turns' texts."""
    rows, texts = [], []
    for s, trace in enumerate(traces):
        raw = detection.raw_with_coe(trace)
        raw.update(prefix=torch.tensor(prefix.index), sample=torch.tensor(s),
                   greedy=torch.tensor(int(greedy and s == len(traces) - 1)),
                   turn_idx=torch.tensor(prefix.turn_idx),
                   logprob_mean=torch.tensor(sum(trace.logprobs) / len(trace.logprobs)),
                   n_tokens=torch.tensor(len(trace.tokens)),
                   finished=torch.tensor(int(trace.finished)),
                   prompt_tokens=torch.tensor(len(prefix.ids)))
        rows.append(raw)
        texts.append(turn_text(tok, trace))
    return rows, texts


def extract(net, tok, env: envs.GTAEnv, todo: list[Prefix], parts: Path, args, log) -> None:
    """Sample the prefixes of `todo`, --shard-size prefixes a shard; a progress line a shard."""
    t0 = time.perf_counter()
    n_turns = 0
    counts = {1: 0, 0: 0, None: 0}
    # --raise-k samples no greedy turn: the corpora it raises hold the prefix's greedy one
    greedy = not args.raise_k
    for a in range(0, len(todo), args.shard_size):
        rows, strings = [], {"episode_id": [], "text": []}
        for prefix in todo[a:a + args.shard_size]:
            g = torch.Generator().manual_seed(prefix_seed(args.seed, prefix.episode_id,
                                                          prefix.turn_idx))
            traces = own_turns(net, tok, prefix.ids, args.k, args.max_new_tokens, g, greedy)
            new, texts = turn_rows(prefix, traces, tok, greedy)
            rows += new
            strings["text"] += texts
            strings["episode_id"] += [prefix.episode_id] * len(new)
            for text, trace in zip(texts, traces):
                record = env.records[prefix.episode_id]
                counts[label_turn(text, record, prefix.turn_idx, trace.finished).label] += 1
        write_shard(parts, rows, strings)
        n_turns += len(rows)
        done = min(a + args.shard_size, len(todo))
        rate = n_turns / (time.perf_counter() - t0)
        left = (len(todo) - done) * (args.k + greedy) / rate
        print(f"  {done}/{len(todo)} prefixes  {n_turns} turns  {rate:.4f} turns/s  "
              f"ETA {runs.hms(left)}  right {counts[1]} wrong {counts[0]} "
              f"undecided {counts[None]}", file=log, flush=True)


# ---- The merge: labelled turns in the study's layout, every turn in turns.jsonl -----------------

@dataclass
class Turn:
    episode_id: str
    turn_idx: int
    prefix: int
    sample: int
    greedy: bool
    text: str
    verdict: Verdict
    logprob_mean: float
    n_tokens: int
    finished: bool


def load_turns(parts: Path, env: envs.GTAEnv) -> tuple[list[Turn], dict[str, torch.Tensor]]:
    """Every turn of the shards, labelled now by label_turn, in (prefix, sample) order, and
    their tensors stacked in the same order."""
    shards = list(read_shards(parts))
    if not shards:
        raise SystemExit(f"{parts}: no shard written yet")
    tensors = {k: torch.cat([t[k] for _, _, t in shards]) for k in shards[0][2]}
    episode_ids = [e for _, s, _ in shards for e in s["episode_id"]]
    texts = [x for _, s, _ in shards for x in s["text"]]
    order = (tensors["prefix"] * (int(tensors["sample"].max()) + 1) + tensors["sample"]).argsort()
    tensors = {k: v[order] for k, v in tensors.items()}
    turns = []
    for r, i in enumerate(order.tolist()):
        key, t = episode_ids[i], int(tensors["turn_idx"][r])
        if key not in env.records:
            raise probes.FormatError(f"{parts}: episode {key!r} is not in the split's file")
        turns.append(Turn(key, t, int(tensors["prefix"][r]), int(tensors["sample"][r]),
                          bool(tensors["greedy"][r]), texts[i],
                          label_turn(texts[i], env.records[key], t,
                                     bool(tensors["finished"][r])),
                          float(tensors["logprob_mean"][r]), int(tensors["n_tokens"][r]),
                          bool(tensors["finished"][r])))
    return turns, tensors


def summarize(turns: list[Turn]) -> dict:
    """The corpus counts the issue's targets read: labelled turns per class and kind, undecided
    per reason, episodes, and prefixes whose turns hold both classes (all of them, and the
    sampled ones alone)."""
    labelled = [t for t in turns if t.verdict.label is not None]
    y = torch.tensor([t.verdict.label for t in labelled])
    prefix = [t.prefix for t in labelled]
    every = torch.ones(len(labelled), dtype=torch.bool)
    sampled = torch.tensor([not t.greedy for t in labelled], dtype=torch.bool)
    reasons = {}
    for t in turns:
        label = {1: "right", 0: "wrong", None: "undecided"}[t.verdict.label]
        key = f"{label}:{t.verdict.kind}:{t.verdict.reason}"
        reasons[key] = reasons.get(key, 0) + 1
    return {"turns": len(turns), "prefixes": len({t.prefix for t in turns}),
            "labelled": len(labelled), "right": sum(t.verdict.label == 1 for t in labelled),
            "wrong": sum(t.verdict.label == 0 for t in labelled),
            "undecided": len(turns) - len(labelled),
            "episodes_labelled": len({t.episode_id for t in labelled}),
            "prefixes_both": owndetect.prefixes_both(y, prefix, every),
            "prefixes_both_sampled": owndetect.prefixes_both(y, prefix, sampled),
            "greedy_right": sum(t.greedy and t.verdict.label == 1 for t in turns),
            "greedy_labelled": sum(t.greedy for t in labelled),
            "truncated": sum(not t.finished for t in turns),
            "by_reason": dict(sorted(reasons.items()))}


def merge(parts: Path, out: Path, env: envs.GTAEnv, manifest: dict, log) -> dict:
    """own_turns.safetensors, turns.jsonl and summary.json from every shard (module docstring)."""
    turns, tensors = load_turns(parts, env)
    if len({t.prefix for t in turns}) != manifest["prefixes"]:
        raise SystemExit(f"{parts}: {manifest['prefixes']} prefixes to sample, "
                         f"{len({t.prefix for t in turns})} in its shards: rerun the same command")
    keep = [r for r, t in enumerate(turns) if t.verdict.label is not None]
    idx = torch.tensor(keep, dtype=torch.long)
    features = {k: v[idx] for k, v in tensors.items()}
    chosen = [turns[r] for r in keep]
    features["label"] = torch.tensor([t.verdict.label for t in chosen])
    features["kind"] = torch.tensor([KINDS.index(t.verdict.kind) for t in chosen])
    summary = summarize(turns)
    L, H = features["attn_max"].shape[1:]
    meta = {**manifest, "n_records": len(chosen), "n_turns": len(turns), "kinds": list(KINDS),
            "dims": {"d": features["h_mean"].shape[1], "L": L, "H": H},
            "episode_id": [t.episode_id for t in chosen],
            "kind": [t.verdict.kind for t in chosen],
            "reason": [t.verdict.reason for t in chosen], "text": [t.text for t in chosen]}
    probes.save_safetensors(features, out / "own_turns.safetensors",
                            {"pair_features": json.dumps(meta)})
    lines = [json.dumps({"episode_id": t.episode_id, "turn_idx": t.turn_idx, "prefix": t.prefix,
                         "sample": t.sample, "greedy": t.greedy, "kind": t.verdict.kind,
                         "label": t.verdict.label, "reason": t.verdict.reason,
                         "logprob_mean": t.logprob_mean, "n_tokens": t.n_tokens,
                         "finished": t.finished, "text": t.text}, ensure_ascii=False)
             for t in turns]
    mdl.write_atomic(out / "turns.jsonl", "\n".join(lines) + "\n")
    mdl.write_atomic(out / "summary.json", json.dumps({**manifest, **summary}, indent=2) + "\n")
    print(f"wrote {out / 'own_turns.safetensors'}: {summary['labelled']} labelled turns "
          f"({summary['right']} right, {summary['wrong']} wrong) of {summary['turns']}, "
          f"{summary['undecided']} undecided", file=log)
    return summary


# ---- Commands -----------------------------------------------------------------------------------

def load_split(args) -> envs.GTAEnv:
    return envs.GTAEnv(args.split, args.data_dir, match="loose")


def cmd_extract(args) -> None:
    log = sys.stderr
    torch.set_num_threads(args.threads)
    env = load_split(args)              # a bad data file fails before the model loads
    data_path = envs.episode_file("gta", args.split, args.data_dir)
    besides = frozenset().union(*(episodes_sampled(d, env, args.split, data_path)
                                  for d in args.besides))
    chosen = choose_episodes(env, args.episodes, args.episode_seed, besides)
    raise_k = set()
    if args.raise_k:
        raise_k = prefixes_to_raise(args.raise_k, args.split, data_path, args.seed)
        raised_episodes = {e for e, _ in raise_k}
        chosen = [key for key in chosen if key in raised_episodes]
    t0 = time.perf_counter()
    net, tok = mdl.load_model(args.model, dtype=mdl.DTYPES[args.dtype])
    net.eval()
    print(f"loaded {args.model} ({args.dtype}) in {time.perf_counter() - t0:.1f}s", file=log)
    todo = prefixes(env, chosen, tok)
    if args.raise_k:
        todo = [Prefix(i, p.episode_id, p.turn_idx, p.ids) for i, p in enumerate(
            p for p in todo if (p.episode_id, p.turn_idx) in raise_k)]
    manifest = manifest_of(args, net, data_path, len(todo))
    if besides:
        manifest["besides"] = sorted(besides)
    if args.raise_k:
        manifest["raise_k"] = [f"{e}/{t}" for e, t in sorted(raise_k)]
    out = Path(args.out)
    parts = out / "parts"
    done = open_parts(parts, manifest)
    left = [p for p in todo if p.index not in done]
    print(f"extract gta {args.split}: {len(todo)} prefixes of {len(chosen)} episodes, "
          f"{args.k} samples{'' if args.raise_k else ' + greedy'} each, {len(done)} prefixes "
          f"already done", file=log, flush=True)
    extract(net, tok, env, left, parts, args, log)
    summary = merge(parts, out, env, manifest, log)
    print(json.dumps({k: v for k, v in summary.items() if k != "by_reason"}), file=log)


def cmd_report(args) -> None:
    parts = Path(args.out) / "parts"
    manifest = json.loads((parts / "manifest.json").read_text())
    args.split = manifest["split"]
    env = load_split(args)
    turns, _ = load_turns(parts, env)
    print(json.dumps(summarize(turns), indent=2))
    labelled = [t for t in turns if t.verdict.label is not None]
    for t in random.Random(args.seed).sample(labelled, min(args.show, len(labelled))):
        gold = envs.render_assistant(env.records[t.episode_id]["dialogs"][t.turn_idx])
        print(f"\n=== {t.episode_id} turn {t.turn_idx} sample {t.sample}"
              f"{' (greedy)' if t.greedy else ''}: {t.verdict.kind} "
              f"{'right' if t.verdict.label else 'wrong'} ({t.verdict.reason})\n"
              f"--- own turn:\n{t.text}\n--- gold turn:\n{gold}")


def cmd_detect(args) -> None:
    corpus = owndetect.load_corpus(args.corpus)
    result = owndetect.detect(corpus, args.released, args.folds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result["corpus"] = [str(d) for d in args.corpus]
    result["released_features"] = args.released
    mdl.write_atomic(out / "detection.json", json.dumps(result, indent=2) + "\n")
    text = owndetect.render(result)
    mdl.write_atomic(out / "detection.md", text)
    print(text)
    print(f"wrote {out / 'detection.md'} and detection.json ({result['seconds']:.0f}s)",
          file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lab.ownturns",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the labelling rule.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("extract", help="sample, label and read the model's own GTA turns")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--data-dir", default=None,
                   help="released data directory holding gta/clean_<split>.json "
                        "(default: $PAIR_DATA, else the project's cache)")
    p.add_argument("--split", required=True, choices=("train", "test"), help="GTA split")
    p.add_argument("--out", required=True, help="output directory (module docstring)")
    p.add_argument("--k", type=runs.int_at_least(1), default=4,
                   help="turns sampled at temperature 1 per prefix, besides the greedy one "
                        "(default 4)")
    p.add_argument("--max-new-tokens", type=runs.int_at_least(1), default=128,
                   help="tokens a turn at most (default 128: 90%% of GTA's gold turns are "
                        "shorter)")
    p.add_argument("--episodes", type=runs.int_at_least(1), default=None,
                   help="sample the turns of this many episodes, drawn with --episode-seed "
                        "(default: every episode of the split)")
    p.add_argument("--episode-seed", type=int, default=0, help="seed of the --episodes draw")
    p.add_argument("--besides", nargs="+", default=[], metavar="DIR",
                   help="leave out the episodes the extractions in these directories sample "
                        "(of the same split), to grow a corpus with new episodes only")
    p.add_argument("--raise-k", nargs="+", default=[], metavar="DIR",
                   help="sample --k more turns, and no greedy one, at the prefixes of these "
                        "extractions (of the same split, sampled with another --seed) that hold "
                        "a right turn while their samples do not hold both classes; detect "
                        "pools a prefix's turns over the corpora")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed; each prefix draws from its own generator (default 0)")
    p.add_argument("--threads", type=runs.int_at_least(1), default=1,
                   help="torch CPU threads (default 1)")
    p.add_argument("--dtype", default="float32", choices=tuple(mdl.DTYPES),
                   help="model weights dtype (default float32, as lab.study extract)")
    p.add_argument("--shard-size", type=runs.int_at_least(1), default=4,
                   help="prefixes per shard; a killed run resumes after the last shard "
                        "(default 4)")
    p.set_defaults(func=cmd_extract)
    p = sub.add_parser("report", help="the counts of an extraction so far, and turns to read")
    p.add_argument("--out", required=True, help="the extraction's output directory")
    p.add_argument("--data-dir", default=None, help="as given to extract")
    p.add_argument("--show", type=runs.int_at_least(0), default=0,
                   help="print this many labelled turns drawn at random, with the gold turn")
    p.add_argument("--raise-k", nargs="+", default=[], metavar="DIR",
                   help="sample --k more turns, and no greedy one, at the prefixes of these "
                        "extractions (of the same split, sampled with another --seed) that hold "
                        "a right turn while their samples do not hold both classes; detect "
                        "pools a prefix's turns over the corpora")
    p.add_argument("--seed", type=int, default=0, help="seed of the --show draw")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("detect", help="AUROC of every method on the own turns, out of fold by "
                                      "episode, pooled and within prefixes; with --released, "
                                      "beside and across the released turns")
    p.add_argument("--corpus", nargs="+", required=True,
                   help="extraction directories (holding own_turns.safetensors), pooled")
    p.add_argument("--released", default=None,
                   help="features directory of the released GTA turns (`python -m lab.study "
                        "extract`, the same model and dtype): matched_clean_train and the test "
                        "splits")
    p.add_argument("--folds", type=runs.int_at_least(2), default=owndetect.FOLDS,
                   help=f"folds of episodes (default {owndetect.FOLDS})")
    p.add_argument("--out", required=True, help="directory for detection.md and detection.json")
    p.set_defaults(func=cmd_detect)
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.func is cmd_extract:
            with runs.exclusive_dir(args.out):
                args.func(args)
        else:
            args.func(args)
    except (OSError, envs.DataError, mdl.CheckpointError, probes.FormatError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
