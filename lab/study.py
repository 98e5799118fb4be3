"""The detection study (paper §3, Table result_pair): features extracted from matched records,
PAIR and every baseline probe trained per seed, and the paper's tables (a)-(e).

Protocol (METHOD.md §8): each probe is trained with seeds 42, 43, 44; a seed draws a class-balanced
subsample of matched_clean_train (the same records are taken from matched_contaminated_train in
mixed mode); results are mean +- std over seeds on matched_clean_test and matched_contaminated_test.

Contamination distance (METHOD.md §8c): d = the number of assistant turns from the nearest earlier
contaminated turn to the evaluated one. The released indices count dialog *messages* (user,
assistant, tool), so their difference is 2 for the immediately preceding assistant turn and bucket
d = 1 would always be empty; the paper reads d = 1 as "the error is the immediately preceding
turn", so `distance` counts assistant turns (the message difference is kept as
`distance_messages`).

Contamination analyses. (b) is also measured on the matched pairs whose two model inputs
differ (by an input digest recorded at extraction): in the released GTA test splits 104 of 177
pairs are the same dialog twice, which can only dilute a drop. There, per method: AUROC clean and
contaminated, the drop with a paired bootstrap 95% interval (1,000 resamples of the pairs, seed
0), and how far the evaluation turn's logit moved between its two prefixes (report.json
`drop_differing`). (e) reads matched_diagnostic_test (shop: `python -m lab.shop make-data`; GTA:
`python -m lab.data make-diagnostic gta`), overall and per rule of its negatives (report.json
`diagnostic`).

    python -m lab.study extract --model DIR --data gta/matched_clean_train.json \\
                                --out feats/matched_clean_train.safetensors
    python -m lab.study train  --features feats --out probes/gta   # PAIR + every baseline probe
    python -m lab.study eval   --probes probes/gta --features feats
    python -m lab.study report --features feats                    # report.md + report.json
"""
from __future__ import annotations
import argparse
import contextlib
import hashlib
import itertools
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import envs
import model as mdl
import pair
import probes
from lab import data as lab_data, runs, traces


SEEDS = (42, 43, 44)
MODES = ("mixed", "clean_only")
TRAIN_SPLITS = {"clean_only": ("matched_clean_train",),
                "mixed": ("matched_clean_train", "matched_contaminated_train")}
TEST_SPLITS = ("matched_clean_test", "matched_contaminated_test")
DIAGNOSTIC_SPLIT = "matched_diagnostic_test"   # python -m lab.shop make-data writes it
DISTANCE_BUCKETS = ("1", "2", "3", "4", "5", "6", "7+")


def contamination_distance(record: dict) -> tuple[int, int]:
    """(assistant turns, messages) from the nearest earlier contaminated turn to the evaluation
    turn; (-1, -1) when no earlier turn is contaminated. See the module docstring."""
    t = record["turn_idx"]
    earlier = [c for c in record.get("original_contaminated_turn_indices") or [] if c < t]
    if not earlier:
        return -1, -1
    c = max(earlier)
    turns = sum(m["role"] == "assistant" for m in record["dialogs"][c + 1:t + 1])
    return turns, t - c


def render_record(record, tokenizer, max_len=4096):
    """ids, span of the evaluation turn (METHOD.md §3) and the number of leading tokens cut to keep
    the last max_len. `record` comes from lab.data.load_matched, which adds the episode's tools and
    files (METHOD.md §2: from the episode file of the same family and id)."""
    messages = lab_data.record_messages(record)
    if messages[-1]["role"] != "assistant":
        raise ValueError("dialog does not end with an assistant message (the evaluation turn)")
    ids, spans = tokenizer.render(messages)
    ids, spans, cut = keep_last(ids, spans, max_len)
    if spans[-1][1] - spans[-1][0] < 1:
        raise ValueError(f"the evaluation turn does not fit in --max-len {max_len}")
    return ids, spans[-1], cut


def input_digest(ids: list[int], span) -> torch.Tensor:
    """sha256 of the exact model input (token ids and evaluation span) as 32 uint8: two records
    with one digest give the same forward, so their features are the same numbers."""
    h = hashlib.sha256(torch.tensor(list(ids) + list(span), dtype=torch.int64).numpy().tobytes())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def extract(net, tokenizer, data_path, out_path, max_len=4096, shard_size=32,
            manifest_extra=None, log=None, records=None, reuse=()) -> dict:
    """Features of every record of a matched file -> a features file (safetensors: the
    raw tensors of probes.RAW_KEYS and the label, stacked over records; the record ids and the
    manifest in its JSON metadata, read back by load_features).

    Completed records are written to OUT.parts/ in shards (atomically); a rerun with the same
    arguments skips them. Records that fail are listed by id, printed and kept in the output's
    metadata; with failures the parts stay, so a rerun retries only those. `reuse`: features
    files of the same model whose records with the same input digest are copied instead of
    run again (in the released GTA test pairs, 104 of 177 contaminated records are the clean
    record token for token)."""
    log = log or sys.stderr
    data_path, out_path = Path(data_path), Path(out_path)
    if records is None:                           # validated; each with its episode's tools
        records = lab_data.load_matched(data_path)
    if not records:
        raise SystemExit(f"{data_path}: no record to extract (an empty list)")
    parts = parts_dir(out_path)
    manifest = {"data": str(data_path.resolve()), "data_sha256": _file_sha256(data_path),
                "max_len": max_len, **(manifest_extra or {})}
    known = _reusable_rows(reuse, manifest)
    # One writer: a second run on the same output would delete this one's shards at its merge.
    with runs.exclusive_dir(parts):
        try:
            return _extract_parts(net, tokenizer, records, data_path, parts, out_path, manifest,
                                  max_len, shard_size, log, known)
        except BaseException:
            if not any(parts.glob("shard_*.safetensors")) and \
                    not (parts / "failed.json").is_file():  # nothing done: nothing left behind
                shutil.rmtree(parts, ignore_errors=True)
            raise


def _reusable_rows(paths, manifest) -> dict[bytes, dict]:
    """digest -> raw features of one record, from features files extracted with the same model,
    dtype and max_len (anything else would copy numbers of another forward)."""
    known = {}
    for path in paths:
        raw, meta = load_features(path)
        for key in ("model_sha256", "dtype", "max_len"):
            if meta.get(key) != manifest.get(key):
                raise probes.FormatError(f"--reuse {path}: {key} {meta.get(key)!r} differs from "
                                         f"this extraction's {manifest.get(key)!r}")
        if "input_digest" not in raw:
            raise probes.FormatError(f"--reuse {path}: no input digests (extracted before "
                                     "they were recorded); extract it again")
        skip = ("record_index", "label", "turn_idx", "distance", "distance_messages")
        for r in range(len(raw["input_digest"])):
            known.setdefault(bytes(raw["input_digest"][r].tolist()),
                             {k: v[r] for k, v in raw.items() if k not in skip})
    return known


def _extract_parts(net, tokenizer, records, data_path, parts, out_path, manifest, max_len,
                   shard_size, log, known=None) -> dict:
    done = _open_parts(parts, manifest)
    todo = [i for i in range(len(records)) if i not in done]
    print(f"extract {data_path.name}: {len(records)} records, {len(done)} already done "
          f"(resuming from {parts})" if done else
          f"extract {data_path.name}: {len(records)} records", file=log)

    failed, buffer, n_reused = [], [], 0
    t0, pacer = time.perf_counter(), runs.Pacer(len(todo), log)
    for n_new, i in enumerate(todo, 1):
        record = records[i]
        rid = f"{record['episode_id']}@{record['turn_idx']}"
        try:
            ids, span, cut = render_record(record, tokenizer, max_len)
            digest = input_digest(ids, span)
            raw = dict((known or {}).get(bytes(digest.tolist()), {}))
            n_reused += bool(raw)
            if not raw:
                with torch.inference_mode():
                    trace = traces.trace_forward(net, ids, span)
                raw = probes.raw_features(trace)
            raw["input_digest"] = digest
            raw["record_index"] = torch.tensor(i)
            raw["truncated"] = torch.tensor(int(cut > 0))
            buffer.append(raw)
        except Exception as e:      # reported by id below and in the output, never dropped
            failed.append({"index": i, "id": rid, "error": f"{type(e).__name__}: {e}"})
            print(f"  record {i} ({rid}) failed: {failed[-1]['error']}", file=log)
        if len(buffer) >= shard_size or n_new == len(todo):
            _write_shard(parts, buffer, failed)
            buffer = []
        if pacer.due(n_new):
            rate = n_new / (time.perf_counter() - t0)
            eta = (len(todo) - n_new) / rate if rate > 0 else 0
            print(f"  {len(done) + n_new}/{len(records)} records  {rate:.2f} rec/s  "
                  f"ETA {runs.hms(eta)}  failed {len(failed)}  reused {n_reused}", file=log)
    if not todo:
        _write_shard(parts, [], [])

    return _merge_parts(parts, records, out_path, manifest, failed, log)


def parts_dir(out_path) -> Path:
    """Where extract keeps the shards of OUT until they are merged into it."""
    return Path(out_path).with_name(Path(out_path).name + ".parts")


def _open_parts(parts: Path, manifest: dict) -> set[int]:
    """The record indices already extracted under `parts` (creating it for a fresh run)."""
    path = parts / "manifest.json"
    # Resumed by content: the data's and the model's hashes, not their paths (a moved copy
    # resumes; weights swapped under the same path do not).
    manifest = {k: v for k, v in manifest.items() if k not in ("data", "model")}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError as e:
            raise probes.FormatError(f"{path}: not JSON ({e}); delete {parts} to start "
                                     "over") from None
        if not isinstance(old, dict):
            raise probes.FormatError(f"{path}: not a manifest (a JSON object); delete {parts} "
                                     "to start over")
        if old != manifest:
            diff = sorted(k for k in set(old) | set(manifest) if old.get(k) != manifest.get(k))
            raise SystemExit(f"{parts} holds a run with different arguments ({', '.join(diff)}); "
                             "rerun with the same ones or delete that directory")
    else:
        parts.mkdir(parents=True, exist_ok=True)
        mdl.write_atomic(path, json.dumps(manifest, indent=2) + "\n")
    done = set()
    for shard in sorted(parts.glob("shard_*.safetensors")):
        tensors = probes.read_safetensors(shard, "shard")[0]
        if "record_index" not in tensors:
            raise probes.FormatError(f"{shard}: not a shard of this extraction (no "
                                     f"record_index); delete {parts} to start over")
        done.update(tensors["record_index"].tolist())
    return done


def _write_shard(parts: Path, buffer: list[dict], failed: list[dict]) -> None:
    if buffer:
        stacked = {k: torch.stack([r[k] for r in buffer]) for k in buffer[0]}
        first = int(stacked["record_index"][0])
        probes.save_safetensors(stacked, parts / f"shard_{first:07d}.safetensors", {})
    mdl.write_atomic(parts / "failed.json", json.dumps(failed, indent=1) + "\n")


def _merge_parts(parts, records, out_path, manifest, failed, log) -> dict:
    shards = [probes.read_safetensors(p, "shard")[0]
              for p in sorted(parts.glob("shard_*.safetensors"))]
    if not shards:
        raise SystemExit(f"no record of {manifest['data']} could be extracted; see the errors "
                         f"above and {parts / 'failed.json'}")
    tensors = {k: torch.cat([s[k] for s in shards]) for k in shards[0]}
    order = tensors["record_index"].argsort()
    tensors = {k: v[order] for k, v in tensors.items()}
    # Every record is extracted exactly once or listed as failed, else no file: shards lost
    # (deleted by hand, or by another writer before the lock existed) would drop records silently.
    index = tensors["record_index"].tolist()
    missing = sorted(set(range(len(records))) - set(index) - {f["index"] for f in failed})
    if missing or len(set(index)) != len(index) or not set(index) <= set(range(len(records))):
        raise SystemExit(f"{parts}: {len(missing)} records of {manifest['data']} neither "
                         f"extracted nor listed as failed (e.g. {missing[:5]}), or shards that do "
                         f"not belong to it; {out_path} not written. Rerun the same command to "
                         f"extract what is missing (or delete {parts} to start over)")
    chosen = [records[i] for i in tensors["record_index"].tolist()]
    distances = [contamination_distance(r) for r in chosen]
    tensors["label"] = torch.tensor([int(r["label"]) for r in chosen])
    tensors["turn_idx"] = torch.tensor([int(r["turn_idx"]) for r in chosen])
    tensors["distance"] = torch.tensor([d for d, _ in distances])
    tensors["distance_messages"] = torch.tensor([m for _, m in distances])
    L, H = tensors["attn_max"].shape[1:]
    meta = {**manifest, "n_records": len(chosen), "n_in_data": len(records),
            "n_truncated": int(tensors["truncated"].sum()), "failed": failed,
            "dims": {"d": tensors["h_mean"].shape[1], "L": L, "H": H},
            "episode_id": [str(r["episode_id"]) for r in chosen],
            "contamination_type": [r.get("contamination_type") for r in chosen],
            "prefix_type": [r.get("prefix_type") for r in chosen],
            "has_contaminated_prefix": [r.get("has_contaminated_prefix") for r in chosen],
            # the adversarial set's kind and rule (envs.py make-diagnostic); None elsewhere
            "diagnostic": [r.get("diagnostic") for r in chosen],
            "diagnostic_rule": [r.get("diagnostic_rule") for r in chosen]}
    probes.save_safetensors(tensors, out_path, {"pair_features": json.dumps(meta)})
    print(f"wrote {out_path}: {len(chosen)} records, {meta['n_truncated']} truncated to their "
          f"last {manifest['max_len']} tokens, {len(failed)} failed", file=log)
    if failed:
        print(f"FAILED records ({len(failed)}), listed in the metadata of {out_path}; rerun the "
              "same command to retry only them:", file=log)
        for f in failed:
            print(f"  {f['index']} {f['id']}: {f['error']}", file=log)
    else:
        shutil.rmtree(parts)
    return meta


@dataclass
class Split:
    """One features file: raw tensors stacked over records, labels and string columns."""
    name: str
    raw: dict
    y: torch.Tensor
    episode_id: list[str]
    meta: dict

    def keys(self) -> list[tuple[str, int]]:
        return list(zip(self.episode_id, self.raw["turn_idx"].tolist()))

    def take(self, idx) -> "Split":
        idx = torch.as_tensor(idx, dtype=torch.long)
        return Split(self.name, {k: v[idx] for k, v in self.raw.items()}, self.y[idx],
                     [self.episode_id[i] for i in idx.tolist()], self.meta)


def load_split(path, name=None) -> Split:
    raw, meta = load_features(path)
    return Split(name or Path(path).stem, raw, raw["label"].long(), list(meta["episode_id"]),
                 meta)


def load_splits(features_dir, names) -> dict[str, Split]:
    """The named features files of a directory (<name>.safetensors); absent ones are skipped."""
    features_dir = Path(features_dir)
    if not features_dir.is_dir():
        raise FileNotFoundError(f"features directory not found: {features_dir}")
    splits = {n: load_split(features_dir / f"{n}.safetensors", n) for n in names
              if (features_dir / f"{n}.safetensors").is_file()}
    path = {n: features_dir / f"{n}.safetensors" for n in splits}
    first, *rest = splits.values() if splits else [None]
    for split in rest:                  # all from one model, or the probes learn a mixture
        probes.check_same_source(probes.source(first.meta), path[first.name],
                                 probes.source(split.meta), path[split.name])
    return splits


def concat_splits(splits: list[Split]) -> Split:
    common = set.intersection(*(set(s.raw) for s in splits))
    raw = {k: torch.cat([s.raw[k] for s in splits]) for k in common}
    return Split("+".join(s.name for s in splits), raw, torch.cat([s.y for s in splits]),
                 sum((s.episode_id for s in splits), []), splits[0].meta)


def balanced_indices(y: torch.Tensor, seed: int) -> torch.Tensor:
    """A class-balanced subsample: every record of the minority class and as many of the
    majority class, drawn with `seed`."""
    g = torch.Generator().manual_seed(seed)
    pos, neg = (y == 1).nonzero().flatten(), (y == 0).nonzero().flatten()
    m = min(len(pos), len(neg))
    if m == 0:
        raise probes.FormatError("the training split holds a single class")
    pick = [c[torch.randperm(len(c), generator=g)[:m]] for c in (pos, neg)]
    return torch.cat(pick).sort().values


def training_set(splits: dict[str, Split], mode: str, seed: int) -> Split:
    """The seed's balanced subsample of matched_clean_train, plus (mixed) the same records of
    matched_contaminated_train: its evaluation turns are identical, only the prefix differs."""
    need = TRAIN_SPLITS[mode]
    missing = [n for n in need if n not in splits]
    if missing:
        raise FileNotFoundError(f"mode {mode!r} needs the features of {missing} "
                                f"(<name>.safetensors in the features directory)")
    clean = splits["matched_clean_train"]
    chosen = clean.take(balanced_indices(clean.y, seed))
    if mode == "clean_only":
        return chosen
    contam = splits["matched_contaminated_train"]
    row = {k: i for i, k in enumerate(contam.keys())}
    twins = [row[k] for k in chosen.keys() if k in row]
    if len(twins) < len(chosen.y):
        print(f"warning: {len(chosen.y) - len(twins)} records of the clean subsample have no "
              "matched_contaminated_train twin (failed extraction?)", file=sys.stderr)
    return concat_splits([chosen, contam.take(twins)])


def fit_baselines(train: Split, C=0.01, info=None) -> dict[str, probes.Probe]:
    """Every supervised baseline probe (METHOD.md §5) on one training set."""
    return {name: probes.Probe(info={"feature": name, **(info or {})})
            .fit(probes.feature(name, train.raw), train.y, C) for name in probes.FEATURES}


def predict(model, raw) -> torch.Tensor:
    """P(correct) of a Probe or a Pair."""
    if isinstance(model, pair.Pair):
        return model.scores(raw)[1]
    return model.predict_proba(probes.feature(model.info["feature"], raw))


METHODS = {   # name -> (label in the tables, P(correct)?)
    "last_token": ("Last-token", True), "mean_pooled": ("Mean-Pooled", True),
    "multi_layer": ("Multi-layer", True), "attention": ("Attention", True),
    "hidden_attn": ("Hidden + Attn", True), "multi_attn": ("Multi-Attn", True),
    "lookback": ("Lookback Lens", True), "head_entropy": ("Head Entropy", True),
    "neg_entropy": ("-Entropy (unsup.)", False), "coe_r": ("CoE-R (unsup.)", False),
    "coe_c": ("CoE-C (unsup.)", False), "pair": ("PAIR", True),
    "pair_clean_only": ("PAIR (clean_only)", True),
}


# Paper Table result_pair (Qwen2.5-7B-Instruct): AUROC, its std, ECE, its std (None: not given).
PAPER_DETECTION = {
    "gta": {"last_token": (0.8967, 0.012, 0.1294, 0.018),
            "mean_pooled": (0.8851, 0.014, 0.1521, 0.020),
            "multi_layer": (0.9082, 0.010, 0.1342, 0.017),
            "attention": (0.8709, 0.015, 0.0954, 0.014),
            "hidden_attn": (0.8978, 0.013, 0.1378, 0.018),
            "multi_attn": (0.9034, 0.011, 0.1356, 0.018),
            "lookback": (0.8745, 0.014, 0.1182, 0.015),
            "head_entropy": (0.8821, 0.013, 0.1432, 0.019),
            "coe_c": (0.7491, 0.022, None, None),
            "pair": (0.9217, 0.009, 0.1198, 0.014)},
    "toolbench": {"last_token": (0.7654, 0.008, 0.2562, 0.014),
                  "mean_pooled": (0.7372, 0.009, 0.2871, 0.016),
                  "multi_layer": (0.7821, 0.007, 0.2476, 0.013),
                  "attention": (0.6847, 0.011, 0.1998, 0.011),
                  "hidden_attn": (0.7598, 0.008, 0.2683, 0.015),
                  "multi_attn": (0.7765, 0.007, 0.1961, 0.011),
                  "lookback": (0.7295, 0.010, 0.1685, 0.010),
                  "head_entropy": (0.7561, 0.009, 0.2329, 0.013),
                  "coe_c": (0.5953, 0.013, None, None),
                  "pair": (0.8129, 0.006, 0.2236, 0.012)},
}


HIDDEN_PROBES = ("last_token", "mean_pooled", "multi_layer")


ATTENTION_PROBES = ("attention", "multi_attn", "lookback", "head_entropy")


BOOTSTRAP_DRAWS, BOOTSTRAP_SEED = 1000, 0


def differing_pairs(clean: Split, contaminated: Split) -> tuple[list[int], list[int]] | None:
    """Rows (in clean, in contaminated) of the matched pairs whose model inputs differ; None
    when the features carry no input digests. In the released GTA test splits 104 of 177 pairs
    are the same dialog twice (no earlier turn was contaminated): they can only dilute a drop."""
    if "input_digest" not in clean.raw or "input_digest" not in contaminated.raw:
        return None
    row = {k: j for j, k in enumerate(contaminated.keys())}
    a, b = [], []
    for i, k in enumerate(clean.keys()):
        j = row.get(k)
        if j is not None and not torch.equal(clean.raw["input_digest"][i],
                                             contaminated.raw["input_digest"][j]):
            a.append(i)
            b.append(j)
    return a, b


def paired_bootstrap_drop(y_a, s_a: list, y_b, s_b: list, draws=BOOTSTRAP_DRAWS,
                          seed=BOOTSTRAP_SEED) -> dict:
    """AUROC(a) - AUROC(b) on n pairs (row i of a and of b are one pair), averaged over the
    probe seeds (s_a, s_b: one (n,) score tensor per seed), and its 95% percentile interval
    from `draws` resamples of the pairs with replacement. A given seed draws the same pairs for
    every method. Draws whose resample holds one class (AUROC undefined) are dropped and
    counted."""
    y_a, y_b = torch.as_tensor(y_a), torch.as_tensor(y_b)
    n = len(y_a)

    def drop(idx):
        d = [probes.auroc(y_a[idx], a[idx]) - probes.auroc(y_b[idx], b[idx])
             for a, b in zip(s_a, s_b)]
        d = [x for x in d if x == x]
        return sum(d) / len(d) if d else float("nan")

    point = drop(torch.arange(n))
    if point != point:
        return {"drop": None, "ci95": None, "draws": 0, "undefined_draws": draws}
    g = torch.Generator().manual_seed(seed)
    boot = [drop(torch.randint(n, (n,), generator=g)) for _ in range(draws)]
    kept = torch.tensor([x for x in boot if x == x], dtype=torch.float64)
    lo, hi = torch.quantile(kept, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"drop": point, "ci95": [lo, hi], "draws": len(kept),
            "undefined_draws": draws - len(kept)}


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.double().clamp(1e-12, 1 - 1e-12)
    return (p / (1 - p)).log()


def drop_on_differing(clean: Split, contaminated: Split, scores: dict, probability: dict,
                      draws=BOOTSTRAP_DRAWS, seed=BOOTSTRAP_SEED) -> dict:
    """METHOD.md §8b on the pairs whose prefixes differ: per method AUROC clean and contaminated,
    the drop with its paired bootstrap interval, and how far the evaluation turn's score moved
    between its two prefixes: mean |logit(p_clean) - logit(p_contaminated)| over the pairs, also
    divided by the std of that probe's logits over both test splits (a probe with larger
    weights moves more in raw logits). scores[method][split]: one (N,) tensor per seed."""
    pairs = differing_pairs(clean, contaminated)
    if pairs is None:
        return {"skipped": "the features carry no input digests (extracted before they were "
                           "recorded): extract them again"}
    a, b = pairs
    out = {"n_pairs": len(a), "n_pairs_all": len(clean.y), "positives": int(clean.y[a].sum()),
           "draws": draws, "seed": seed, "methods": {}}
    if not a:
        return {**out, "skipped": "no pair differs"}
    y_a, y_b = clean.y[a], contaminated.y[b]
    for method, per_split in scores.items():
        s_a = [s[a] for s in per_split["matched_clean_test"]]
        s_b = [s[b] for s in per_split["matched_contaminated_test"]]
        row = {"clean": mean_std([probes.auroc(y_a, s) for s in s_a]),
               "contaminated": mean_std([probes.auroc(y_b, s) for s in s_b]),
               **paired_bootstrap_drop(y_a, s_a, y_b, s_b, draws, seed)}
        if probability[method]:
            moved, rel = [], []
            for sa, sb, whole_a, whole_b in zip(s_a, s_b, per_split["matched_clean_test"],
                                                per_split["matched_contaminated_test"]):
                d = (_logit(sa) - _logit(sb)).abs().mean().item()
                spread = torch.cat([_logit(whole_a), _logit(whole_b)]).std().item()
                moved.append(d)
                rel.append(d / spread if spread > 0 else float("nan"))
            row["mean_abs_dlogit"], row["rel_abs_dlogit"] = mean_std(moved), mean_std(rel)
        out["methods"][method] = row
    groups = {"hidden": HIDDEN_PROBES, "attention": ATTENTION_PROBES}
    out["groups"] = {}
    for group, names in groups.items():
        rows = [out["methods"][m] for m in names if "mean_abs_dlogit" in out["methods"].get(m, {})]
        if rows:
            out["groups"][group] = {
                "probes": [m for m in names if m in out["methods"]],
                "mean_abs_dlogit": sum(r["mean_abs_dlogit"]["mean"] for r in rows) / len(rows),
                "rel_abs_dlogit": sum(r["rel_abs_dlogit"]["mean"] for r in rows) / len(rows)}
    return out


def diagnostic_summary(split: Split, scores: dict) -> dict:
    """Table (e): AUROC on the adversarial set, overall and per rule of its negatives (each
    rule's negatives against every positive)."""
    rules = split.meta.get("diagnostic_rule") or [None] * len(split.y)
    neg_rules = sorted({r for r, y in zip(rules, split.y.tolist()) if y == 0 and r})
    out = {"n": len(split.y), "positives": int(split.y.sum()),
           "by_rule_n": {r: rules.count(r) for r in sorted(set(filter(None, rules)))},
           "methods": {}}
    pos = [i for i, y in enumerate(split.y.tolist()) if y == 1]
    for method, per_split in scores.items():
        seeds = per_split[DIAGNOSTIC_SPLIT]
        row = {"auroc": mean_std([probes.auroc(split.y, s) for s in seeds]), "by_rule": {}}
        for rule in neg_rules:
            idx = pos + [i for i, r in enumerate(rules) if r == rule]
            row["by_rule"][rule] = mean_std([probes.auroc(split.y[idx], s[idx]) for s in seeds])
        out["methods"][method] = row
    return out


def stat_subsets() -> list[tuple[str, ...]]:
    """The 15 non-empty subsets of the four attention statistics, smallest first."""
    return [c for k in range(1, 5) for c in itertools.combinations(probes.ATTN_STATS, k)]


def distance_bucket(d: int) -> str | None:
    return None if d < 1 else ("7+" if d >= 7 else str(d))


def mean_std(values: list[float]) -> dict:
    """Mean and sample std (ddof 1) over seeds, ignoring NaN (a metric undefined on a split)."""
    v = [x for x in values if x == x]
    if not v:
        return {"mean": None, "std": None, "values": values}
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return {"mean": m, "std": s, "values": values}


def run_report(features_dir, mode="mixed", seeds=SEEDS, C=0.01, crossfit=0, log=None):
    """Everything of METHOD.md §8 (a)-(e) from the features of the matched splits, as JSON."""
    log = log or sys.stderr
    names = TRAIN_SPLITS["mixed"] + TEST_SPLITS + (DIAGNOSTIC_SPLIT,)
    splits = load_splits(features_dir, names)
    missing = [n for n in TEST_SPLITS + TRAIN_SPLITS[mode] if n not in splits]
    if missing:
        raise FileNotFoundError(f"{features_dir}: missing features of {missing} "
                                "(name them <data file stem>.safetensors)")
    tests = {n: splits[n] for n in TEST_SPLITS + (DIAGNOSTIC_SPLIT,) if n in splits}
    tests["all_test"] = concat_splits([splits[n] for n in TEST_SPLITS])
    # per-seed values: detection[method][split][metric] -> list over seeds
    detection, distance, ablation = {}, {}, {}
    kept, probability_of = {}, {}   # method -> split -> [(N,) scores per seed]; P(correct)?
    n_train, fit_seconds = {}, []
    t0 = time.perf_counter()

    def add(table, keys, value):
        node = table
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node.setdefault(keys[-1], []).append(value)

    def score_all(method, scorer, probability):
        for split_name, split in tests.items():
            p = scorer(split.raw)
            kept.setdefault(method, {}).setdefault(split_name, []).append(p)
            probability_of[method] = probability
            scores = metrics(split.y, p, split.episode_id, probability)
            for metric, value in scores.items():
                add(detection, (method, split_name, metric), value)
            if split_name == "matched_contaminated_test":
                buckets = [distance_bucket(d) for d in split.raw["distance"].tolist()]
                for b in DISTANCE_BUCKETS:
                    idx = [i for i, x in enumerate(buckets) if x == b]
                    if idx:
                        m = metrics(split.y[idx], p[idx], None, probability)
                        for metric in ("accuracy", "auroc"):
                            if metric in m:
                                add(distance, (method, b, metric), m[metric])
                        distance.setdefault("_n", {})[b] = len(idx)

    for seed in seeds:
        t = time.perf_counter()
        train = training_set(splits, mode, seed)
        n_train[seed] = {"n": len(train.y), "positives": int(train.y.sum())}
        info = {"seed": seed, "C": C, "mode": mode}
        models = fit_baselines(train, C, info)
        # (d) PAIR's stage 2 on every subset of the four statistics (stage 1 shared); the full
        # set is PAIR itself
        stage1, s_bc = pair.fit_stage1(train.raw, train.y, C, crossfit, train.episode_id, seed,
                                       stage1=models["last_token"])
        for subset in stat_subsets():
            model = pair.fit_stage2(stage1, s_bc, train.raw, train.y, C, subset, info)
            for split_name in TEST_SPLITS + ("all_test",):
                split = tests[split_name]
                add(ablation, ("+".join(subset), split_name),
                    probes.auroc(split.y, model.scores(split.raw)[1]))
        models["pair"] = model
        clean = training_set(splits, "clean_only", seed)
        models["pair_clean_only"] = pair.fit_pair(
            clean.raw, clean.y, C, crossfit, clean.episode_id, seed,
            info={**info, "mode": "clean_only"},
            stage1=models["last_token"] if mode == "clean_only" else None)
        fit_seconds.append(time.perf_counter() - t)
        for name, model in models.items():
            score_all(name, lambda raw, m=model: predict(m, raw), True)
        print(f"  seed {seed}: {len(models)} models + 15 ablations fitted "
              f"({time.perf_counter() - t:.1f}s)", file=log)
    for name in SCORES:           # unsupervised: no training, one value per split
        score_all(name, lambda raw, n=name: unsupervised_score(n, raw), False)

    def summarize(node):
        if isinstance(node, list):
            return mean_std(node)
        return {k: (v if k == "_n" else summarize(v)) for k, v in node.items()}

    t_drop = time.perf_counter()
    drop_differing = drop_on_differing(splits["matched_clean_test"],
                                       splits["matched_contaminated_test"], kept, probability_of)
    drop_differing["seconds"] = time.perf_counter() - t_drop
    diagnostic = (diagnostic_summary(tests[DIAGNOSTIC_SPLIT], kept)
                  if DIAGNOSTIC_SPLIT in tests else None)
    meta = splits["matched_clean_test"].meta
    return {
        "features_dir": str(features_dir), "mode": mode, "seeds": list(seeds), "C": C,
        "crossfit": crossfit, "model": meta.get("model"), "dtype": meta.get("dtype"),
        "data": {n: s.meta.get("data") for n, s in splits.items()},
        "n_records": {n: len(s.y) for n, s in tests.items()},
        "positives": {n: int(s.y.sum()) for n, s in tests.items()},
        "n_train": n_train, "fit_seconds_per_seed": fit_seconds,
        "seconds": time.perf_counter() - t0,
        "detection": summarize(detection), "distance": summarize(distance),
        "ablation": summarize(ablation), "drop_differing": drop_differing,
        "diagnostic": diagnostic,
    }


def guess_paper_ref(result: dict) -> str | None:
    """The paper's dataset whose name is a path component of the data or features paths."""
    paths = [str(v) for v in result["data"].values()] + [result["features_dir"]]
    parts = {part.lower() for path in paths for part in Path(path).parts}
    return next((name for name in PAPER_DETECTION if name in parts), None)


def _ms(node, digits=3) -> str:
    if not node or node.get("mean") is None:
        return "—"
    return f"{node['mean']:.{digits}f} ± {node['std']:.{digits}f}"


def _get(result, *keys):
    node = result
    for k in keys:
        node = node.get(k) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def render_markdown(result: dict, paper_ref: str | None) -> str:
    det = result["detection"]
    methods = [m for m in METHODS if m in det]
    k = result["crossfit"]
    stage2_input = f"out-of-fold (K={k})" if k > 1 else "in-sample"
    lines = [f"# PAIR detection report — {result['features_dir']}", "",
             f"Model `{result['model']}` ({result['dtype']}); train mode `{result['mode']}` "
             f"(PAIR (clean_only) is trained on matched_clean_train alone); C = {result['C']}; "
             f"stage 2 on {stage2_input} s_bc; seeds {', '.join(map(str, result['seeds']))} "
             f"(each a class-balanced "
             f"subsample: {', '.join(str(v['n']) for v in result['n_train'].values())} "
             f"training records). Mean ± sample std over seeds; unsupervised scores need no "
             f"training (std 0) and have no calibration (—).", "",
             "Test records: " + ", ".join(f"{n} {result['n_records'][n]} "
                                          f"({result['positives'][n]} correct)"
                                          for n in result["n_records"]), ""]
    # (a)
    header = ["Method", "AUROC clean", "AUROC contaminated", "AUROC both", "ECE clean",
              "ECE contaminated", "ECE both"]
    if paper_ref:
        header += [f"paper AUROC ({paper_ref}, 7B)", f"paper ECE ({paper_ref}, 7B)"]
    rows = []
    for m in methods:
        row = [METHODS[m][0]]
        row += [_ms(_get(det, m, s, "auroc")) for s in TEST_SPLITS + ("all_test",)]
        row += [_ms(_get(det, m, s, "ece")) for s in TEST_SPLITS + ("all_test",)]
        if paper_ref:
            ref = PAPER_DETECTION[paper_ref].get(m)
            row += ["—" if ref is None else f"{ref[0]:.4f} ± {ref[1]:.3f}",
                    "—" if ref is None or ref[2] is None else f"{ref[2]:.4f} ± {ref[3]:.3f}"]
        rows.append(row)
    lines += ["## (a) Detection (paper Table result_pair)", ""] + _table(header, rows)
    if paper_ref:
        lines += ["", f"The paper's numbers are for Qwen2.5-7B-Instruct on {paper_ref}; the "
                  "paper does not say which test split they pool, so they sit beside each of "
                  "ours. Its Hidden + Attn concatenates the multi-layer hidden state; ours is "
                  "[last_token; attention] (METHOD.md §4)."]
    header = ["Method"] + [f"{metric} {s}" for metric in ("AUPRC", "Brier", "pairwise")
                           for s in ("clean", "contaminated")]
    rows = [[METHODS[m][0]] + [_ms(_get(det, m, s, k)) for k in ("auprc", "brier", "pairwise")
                               for s in TEST_SPLITS] for m in methods if METHODS[m][1]]
    lines += ["", "Other metrics (pairwise = within-episode ranking accuracy):", ""]
    lines += _table(header, rows)
    # (b)
    rows = []
    for m in methods:
        a = _get(det, m, "matched_clean_test", "auroc")
        b = _get(det, m, "matched_contaminated_test", "auroc")
        if a and b and a["mean"] is not None and b["mean"] is not None:
            drop = a["mean"] - b["mean"]
            relative = f"{100 * drop / a['mean']:+.1f}%" if a["mean"] else "n/a"   # AUROC 0
            rows.append([METHODS[m][0], f"{a['mean']:.3f}", f"{b['mean']:.3f}", f"{drop:+.3f}",
                         relative])
    lines += ["", "## (b) AUROC drop clean → contaminated prefix", "",
              "Whole splits (every record, including pairs whose two dialogs are identical):",
              ""]
    lines += _table(["Method", "clean", "contaminated", "drop", "relative"], rows)
    lines += _render_differing(result, methods)
    # (c)
    dist = result["distance"]
    counts = dist.get("_n", {})
    buckets = [b for b in DISTANCE_BUCKETS if b in counts]
    lines += ["", "## (c) Distance sensitivity (matched_contaminated_test)", "",
              "d = assistant turns from the nearest earlier contaminated turn to the evaluation "
              "turn; accuracy at threshold 0.5 (AUROC for unsupervised scores; — where a bucket "
              "holds one class).", ""]
    if buckets:
        header = ["Method"] + [f"d={b} (n={counts[b]})" for b in buckets]
        rows = []
        for m in methods:
            metric = "accuracy" if METHODS[m][1] else "auroc"
            rows.append([METHODS[m][0] + ("" if METHODS[m][1] else " [AUROC]")]
                        + [_ms(_get(dist, m, b, metric)) for b in buckets])
        lines += _table(header, rows)
    else:
        lines += ["No record of matched_contaminated_test has an earlier contaminated turn."]
    # (d)
    abl = result["ablation"]
    rows = [[k.replace("+", " + ")] + [_ms(_get(abl, k, s)) for s in TEST_SPLITS + ("all_test",)]
            for k in abl]
    lines += ["", "## (d) Ablation: attention statistics in PAIR's stage 2 (AUROC)", ""]
    lines += _table(["Statistics", "clean", "contaminated", "both"], rows)
    # (e)
    lines += ["", "## (e) Adversarial diagnostic set", ""]
    diag = result.get("diagnostic")
    if DIAGNOSTIC_SPLIT in result["n_records"] and diag:
        rules = [r for r in diag["by_rule_n"] if diag["by_rule_n"][r] and any(
            r in row["by_rule"] for row in diag["methods"].values())]
        lines += [f"{diag['n']} records ({diag['positives']} correct): consistent-but-incorrect "
                  "turns after a clean prefix (label 0) vs correct turns after a contaminated "
                  "prefix (label 1)" + ("; records per rule: " + ", ".join(
                      f"{r} {n}" for r, n in diag["by_rule_n"].items()) if diag["by_rule_n"]
                      else "") + ". AUROC below 0.5 = "
                  "the probe ranks the fluent wrong turn above the right turn after errors: it "
                  "tracks belief-consistency. Per rule: that rule's negatives against every "
                  "positive.", ""]
        lines += _table(["Method", "AUROC"] + [f"vs {r}" for r in rules],
                        [[METHODS[m][0], _ms(diag["methods"][m]["auroc"])]
                         + [_ms(diag["methods"][m]["by_rule"].get(r)) for r in rules]
                         for m in methods if m in diag["methods"]])
    else:
        lines += [f"No {DIAGNOSTIC_SPLIT}.safetensors in the features directory."]
    return "\n".join(lines) + "\n"


def _render_differing(result: dict, methods: list[str]) -> list[str]:
    dd = result.get("drop_differing") or {}
    lines = ["", "On the pairs whose two dialogs differ (an earlier turn was contaminated):", ""]
    if "skipped" in dd:
        return lines + [f"Not computed: {dd['skipped']}."]
    lines += [f"{dd['n_pairs']} of {dd['n_pairs_all']} pairs differ ({dd['positives']} with a "
              f"correct evaluation turn). Drop = AUROC clean − AUROC contaminated on those "
              f"pairs, mean over seeds; 95% interval from a paired bootstrap ({dd['draws']} "
              f"resamples of the pairs, seed {dd['seed']}). |Δ logit| = mean over the pairs of "
              "how far the evaluation turn's logit moved between its clean and its "
              "contaminated prefix; relative = divided by the std of that probe's logits over "
              "both test splits.", ""]
    rows = []
    for m in methods:
        row = dd["methods"].get(m)
        if row is None:
            continue
        ci = row.get("ci95")
        rows.append([METHODS[m][0], _ms(row["clean"]), _ms(row["contaminated"]),
                     "undefined (one class)" if row["drop"] is None else
                     f"{row['drop']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]",
                     _ms(row.get("mean_abs_dlogit")), _ms(row.get("rel_abs_dlogit"))])
    lines += _table(["Method", "clean", "contaminated", "drop [95% CI]", "|Δ logit|",
                     "relative |Δ logit|"], rows)
    for group, g in dd.get("groups", {}).items():
        lines.append(f"\nMean over the {group} probes ({', '.join(g['probes'])}): |Δ logit| "
                     f"{g['mean_abs_dlogit']:.3f}, relative {g['rel_abs_dlogit']:.3f}.")
    return lines


def _table(header, rows) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _json_clean(node):
    """NaN -> None so the JSON is standard."""
    if isinstance(node, dict):
        return {str(k): _json_clean(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_json_clean(v) for v in node]
    if isinstance(node, float) and node != node:
        return None
    return node


def subsample_episodes(records: list[dict], n: int, seed: int) -> list[dict]:
    """The records of n episodes drawn with `seed`, in file order. The draw depends only on the
    set of episode ids, so the clean and contaminated files of a family keep the same pairs."""
    unique = sorted({r["episode_id"] for r in records})
    order = torch.randperm(len(unique), generator=torch.Generator().manual_seed(seed))
    keep = {unique[j] for j in order[:n].tolist()}
    return [r for r in records if r["episode_id"] in keep]


def cmd_extract(args):
    records = lab_data.load_matched(args.data)      # a bad data file fails before the model loads
    extra = {}
    if args.episodes is not None:
        n_episodes = len({r["episode_id"] for r in records})
        records = subsample_episodes(records, args.episodes, args.episode_seed)
        extra["subsample"] = {"episodes": min(args.episodes, n_episodes), "of": n_episodes,
                              "seed": args.episode_seed, "records": len(records)}
        print(f"subsample: {len(records)} records of {extra['subsample']['episodes']} of "
              f"{n_episodes} episodes (seed {args.episode_seed})", file=sys.stderr)
    t0 = time.perf_counter()
    net, tokenizer = mdl.load_model(args.model, dtype=mdl.DTYPES[args.dtype])
    model_sha256 = mdl.checkpoint_sha256(net.checkpoint_dir)
    print(f"loaded {args.model} ({args.dtype}, sha256 {model_sha256[:12]}) in "
          f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    extract(net, tokenizer, args.data, args.out, args.max_len, args.shard_size, records=records,
            manifest_extra={"model": str(Path(args.model).resolve()) if Path(args.model).exists()
                            else args.model, "model_sha256": model_sha256, "dtype": args.dtype,
                            **extra},
            reuse=args.reuse)


def cmd_train(args):
    splits = load_splits(args.features, TRAIN_SPLITS["mixed"])
    out = Path(args.out)
    summary = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        train = training_set(splits, args.mode, seed)
        info = {"seed": seed, "C": args.C, "mode": args.mode, "features": str(args.features),
                "n_train": len(train.y), **probes.source(train.meta)}
        models = fit_baselines(train, args.C, info)
        pair_model = pair.fit_pair(train.raw, train.y, args.C, args.crossfit, train.episode_id,
                                   seed,
                                   info=info, stage1=models["last_token"])
        for name, probe in models.items():
            probe.save(out / f"seed{seed}" / f"{name}.safetensors")
        pair_model.save(out / f"seed{seed}" / f"pair_{args.mode}")
        summary.append({"seed": seed, "n_train": len(train.y), "seconds":
                        time.perf_counter() - t0})
        print(f"seed {seed}: PAIR ({args.mode}) and {len(models)} probes on {len(train.y)} "
              f"records in {summary[-1]['seconds']:.1f}s -> {out / f'seed{seed}'}")
    mdl.write_atomic(out / "train.json", json.dumps({"mode": args.mode, "C": args.C,
                                                     "crossfit": args.crossfit, "runs": summary},
                                                    indent=2) + "\n")


def cmd_eval(args):
    root = Path(args.probes)
    seed_dirs = sorted(p for p in root.glob("seed*") if p.is_dir())
    listed = root / "train.json"
    if listed.is_file():
        # the seeds the last `python -m lab.study train --out` wrote: an older run's seed<S>/ left
        # in the directory (another C, another mode) must not be averaged in
        try:
            seeds = {int(r["seed"]) for r in json.loads(listed.read_text())["runs"]}
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise probes.FormatError(f"{listed}: not a train.json written by "
                                     f"`python -m lab.study train` "
                                     f"({type(e).__name__}: {e})") from None
        stale = [p.name for p in seed_dirs if p.name[4:] not in {str(s) for s in seeds}]
        if stale:
            print(f"ignoring {', '.join(stale)} in {root}: not written by the "
                  f"`python -m lab.study train` "
                  f"that wrote {listed.name} (seeds {sorted(seeds)})", file=sys.stderr)
        seed_dirs = [p for p in seed_dirs if p.name not in stale]
    if not seed_dirs:
        raise SystemExit(f"{root}: no seed*/ directories (written by `python -m lab.study train`)")
    names = list(args.splits) if args.splits else list(TEST_SPLITS) + [DIAGNOSTIC_SPLIT]
    tests = load_splits(args.features, names)
    if not tests:
        raise SystemExit(f"{args.features}: none of {names} found")
    values = {}
    for seed_dir in seed_dirs:
        models = {p.stem: probes.Probe.load(p) for p in sorted(seed_dir.glob("*.safetensors"))}
        models.update({p.name: pair.Pair.load(p) for p in sorted(seed_dir.glob("pair_*"))})
        for name, m in models.items():
            for split_name, split in tests.items():
                probes.check_same_source(probes.source(m.info), seed_dir / name,
                                         probes.source(split.meta), f"{args.features}/"
                                         f"{split_name}.safetensors")
            for split_name, split in tests.items():
                scores = metrics(split.y, predict(m, split.raw), split.episode_id)
                for k, v in scores.items():
                    values.setdefault(name, {}).setdefault(split_name, {}).setdefault(
                        k, []).append(v)
    for name in SCORES:
        for split_name, split in tests.items():
            p = unsupervised_score(name, split.raw)
            for k, v in metrics(split.y, p, split.episode_id, False).items():
                values.setdefault(name, {}).setdefault(split_name, {})[k] = [v]
    result = {m: {s: {k: mean_std(v) for k, v in d.items()} for s, d in per.items()}
              for m, per in values.items()}
    header = ["Method"] + [f"{k} {s}" for s in tests for k in ("AUROC", "ECE")]
    rows = [[m] + [_ms(_get(result, m, s, k)) for s in tests for k in ("auroc", "ece")]
            for m in result]
    print("\n".join(_table(header, rows)))
    if args.out:
        mdl.write_atomic(Path(args.out), json.dumps(_json_clean(result), indent=2) + "\n")
        print(f"wrote {args.out}")


def cmd_report(args):
    out = Path(args.out or args.features)
    print(f"report: fitting every probe for seeds {args.seeds} ...", file=sys.stderr)
    result = run_report(args.features, args.mode, args.seeds, args.C, args.crossfit)
    paper_ref = guess_paper_ref(result) if args.paper_ref == "auto" else (
        None if args.paper_ref == "none" else args.paper_ref)
    result["paper_ref"] = paper_ref
    markdown = render_markdown(result, paper_ref)
    mdl.write_atomic(out / "report.json", json.dumps(_json_clean(result), indent=2) + "\n")
    mdl.write_atomic(out / "report.md", markdown)
    print(markdown)
    print(f"wrote {out / 'report.md'} and {out / 'report.json'} "
          f"({result['seconds']:.1f}s)", file=sys.stderr)


def crossfit_folds(text: str) -> int:
    """An argparse type: 0 (in-sample) or K >= 2 folds."""
    try:
        k = runs.int_at_least(0)(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if k == 1:
        raise argparse.ArgumentTypeError("one fold leaves no record to fit on: 0 (in-sample) or "
                                         "K >= 2")
    return k


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lab.study",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for the method.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("extract", help="features of a matched file: one forward per record")
    p.add_argument("--model", required=True,
                   help="Hugging Face checkpoint directory (or a Hub name)")
    p.add_argument("--data", required=True,
                   help="matched_*.json file (released schema); the tool lists come from the "
                        "episode file of the same family beside it "
                        "(clean_train.json, METHOD.md §2)")
    p.add_argument("--out", required=True, help="features file to write (.safetensors)")
    p.add_argument("--max-len", type=runs.int_at_least(1), default=4096,
                   help="keep the last MAX_LEN tokens of longer sequences (default 4096)")
    p.add_argument("--dtype", default="float32", choices=tuple(mdl.DTYPES),
                   help="model weights dtype (default float32)")
    p.add_argument("--shard-size", type=runs.int_at_least(1), default=32,
                   help="records per checkpoint shard; an interrupted run resumes after the last "
                        "shard written (default 32)")
    p.add_argument("--reuse", nargs="+", default=[], metavar="FEATURES",
                   help="features files of the same model, dtype and max-len: a record whose "
                        "model input (token ids and span) is in one of them is copied, not run "
                        "again (e.g. the clean split when extracting the contaminated one)")
    p.add_argument("--episodes", type=runs.int_at_least(1), default=None,
                   help="keep the records of this many episodes only, drawn with "
                        "--episode-seed (the same draw for the clean and contaminated files); "
                        "default: every record")
    p.add_argument("--episode-seed", type=int, default=0,
                   help="seed of the --episodes draw (default 0)")
    p.set_defaults(func=cmd_extract, writes=lambda a: [parts_dir(a.out)])

    def training_flags(p):
        p.add_argument("--mode", default="mixed", choices=MODES,
                       help="training data: mixed = clean + contaminated train (the paper's), "
                            "clean_only = matched_clean_train (default mixed)")
        p.add_argument("--crossfit", type=crossfit_folds, default=0, metavar="K",
                       help="fit stage 2 on out-of-fold stage-1 scores over K >= 2 episode "
                            "folds (default 0: in-sample, as released)")
        p.add_argument("--seeds", type=runs.int_at_least(0), nargs="+", default=list(SEEDS),
                       help="seeds, each drawing a class-balanced subsample (default 42 43 44)")
        p.add_argument("--C", type=runs.positive_number, default=0.01,
                       help="inverse L2 strength of every probe (default 0.01)")

    p = sub.add_parser("train", help="fit PAIR and every baseline probe per seed")
    p.add_argument("--features", required=True,
                   help="directory with matched_clean_train.safetensors (and, for mixed, "
                        "matched_contaminated_train.safetensors)")
    p.add_argument("--out", required=True,
                   help="output directory: seed<S>/pair_<mode>/ and seed<S>/<feature>.safetensors")
    training_flags(p)
    p.set_defaults(func=cmd_train, writes=lambda a: [a.out])

    p = sub.add_parser("eval", help="evaluate trained probes on test features")
    p.add_argument("--probes", required=True, help="directory written by "
                   "`python -m lab.study train`")
    p.add_argument("--features", required=True, help="directory holding the test features")
    p.add_argument("--splits", nargs="+", default=None,
                   help="features file stems to evaluate (default: matched_clean_test "
                        "matched_contaminated_test matched_diagnostic_test, those present)")
    p.add_argument("--out", default=None, help="JSON file for the metrics")
    p.set_defaults(func=cmd_eval, writes=lambda a: [])

    p = sub.add_parser("report", help="the paper's tables (a)-(e) as Markdown and JSON")
    p.add_argument("--features", required=True,
                   help="directory with matched_{clean,contaminated}_{train,test}.safetensors "
                        "(and optionally matched_diagnostic_test.safetensors)")
    p.add_argument("--out", default=None,
                   help="directory for report.md and report.json (default: --features)")
    p.add_argument("--paper-ref", default="auto", choices=["auto", "gta", "toolbench", "none"],
                   help="put the paper's Table result_pair beside ours (auto: by dataset name)")
    training_flags(p)
    p.set_defaults(func=cmd_report, writes=lambda a: [a.out or a.features])

    p = sub.add_parser("fit", help="fit one probe on a features file")
    p.add_argument("--features", required=True,
                   help="features file from `python -m lab.study extract`")
    p.add_argument("--feature", required=True, choices=probes.FEATURES,
                   help="feature set (METHOD.md §4)")
    p.add_argument("--C", type=runs.positive_number, default=0.01,
                   help="inverse L2 strength (default 0.01)")
    p.add_argument("--out", required=True, help="probe file to write (.safetensors)")
    p.set_defaults(func=cmd_fit, writes=lambda a: [])

    p = sub.add_parser("score", help="score a features file with a probe and print metrics")
    p.add_argument("--probe", required=True, help="probe file written by `fit`")
    p.add_argument("--features", required=True,
                   help="features file from `python -m lab.study extract`")
    p.set_defaults(func=cmd_score, writes=lambda a: [])
    return ap


def cmd_fit(args) -> None:
    raw, meta = load_features(args.features)
    probe = probes.Probe(info={"feature": args.feature, "train": meta.get("data"),
                               **probes.source(meta)})
    probe.fit(probes.feature(args.feature, raw), raw["label"], C=args.C)
    probe.save(args.out)
    print(f"fitted {args.feature} probe on {probe.info['n']} records "
          f"(d={probe.info['d']}) in {probe.info['fit_seconds']:.2f}s -> {args.out}")


def cmd_score(args) -> None:
    probe = probes.Probe.load(args.probe)
    name = probe.info.get("feature")
    if name not in probes.FEATURES:
        sys.exit(f"{args.probe}: probe metadata names no known feature set ({name!r})")
    raw, meta = load_features(args.features)
    probes.check_same_source(probes.source(probe.info), args.probe, probes.source(meta),
                             args.features)
    p = probe.predict_proba(probes.feature(name, raw))
    print(json.dumps(metrics(raw["label"], p, meta.get("episode_id")), indent=2))


def load_features(path) -> tuple[dict[str, torch.Tensor], dict]:
    """A features file -> (tensors stacked over records, JSON metadata)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"features file not found: {path}")
    tensors, meta = probes.read_safetensors(path, "features")
    meta = probes._json_entry(meta, "pair_features", path)
    missing = [k for k in probes.RAW_KEYS + ("label",) if k not in tensors]
    if not isinstance(meta, dict) or missing:
        raise probes.FormatError(f"{path}: not a features file written by "
                                 f"`python -m lab.study extract` "
                                 f"(missing {missing or 'metadata'})")
    if not isinstance(meta.get("episode_id", []), list):
        raise probes.FormatError(f"{path}: its metadata's episode_id must be a list (one per "
                                 "record)")
    n = {len(v) for v in tensors.values() if v.dim() > 0}
    if len(n) != 1 or len(meta.get("episode_id", ())) not in n:
        raise probes.FormatError(f"{path}: columns of different lengths (records {sorted(n)}, "
                                 f"episode ids {len(meta.get('episode_id', ()))})")
    if tensors["h_mean"].dim() != 2 or tensors["attn_max"].dim() != 3:
        raise probes.FormatError(f"{path}: h_mean must be (records, d) and attn_max "
                                 "(records, L, H)")
    probes._check_finite(tensors, path)
    labels = set(tensors["label"].unique().tolist())
    if not labels <= {0, 1}:
        raise probes.FormatError(f"{path}: labels must be 0 (wrong) or 1 (right), got "
                                 f"{sorted(labels)[:5]}")
    meta["dims"] = features_dims(tensors)     # what the tensors hold, whatever was recorded
    return tensors, meta


def keep_last(ids: list[int], spans: list[tuple], max_len: int):
    """Keep the last max_len tokens (METHOD.md §3); spans shift with them, a span cut in part is
    clipped at 0 and one cut entirely becomes (0, 0). Returns (ids, spans, n_cut)."""
    cut = max(0, len(ids) - max_len)
    if not cut:
        return ids, list(spans), 0
    shifted = [(max(0, s - cut), max(0, e - cut)) for s, e in spans]
    return ids[cut:], shifted, cut


def auprc(y, s) -> float:
    """Average precision: sum over distinct thresholds (descending) of (R_k - R_{k-1}) P_k, as
    scikit-learn's average_precision_score. NaN without positives."""
    y, s = probes.labels_scores(y, s)
    n_pos = y.sum()
    if n_pos == 0:
        return float("nan")
    values, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    pos = torch.zeros_like(values).index_add_(0, inverse, y)            # positives per value
    tp = pos.flip(0).cumsum(0)                                          # score >= threshold
    predicted = counts.flip(0).double().cumsum(0)
    precision, recall = tp / predicted, tp / n_pos
    delta_recall = torch.diff(recall, prepend=recall.new_zeros(1))
    return (delta_recall * precision).sum().item()


def ece(y, p, n_bins: int = 15) -> float:
    """Expected calibration error: bins (lo, hi] of equal width over P(correct), p = 0 in the
    first bin; sum_b (n_b / N) |mean label - mean p| over the bin."""
    y, p = probes.labels_scores(y, p)
    edges = torch.arange(n_bins + 1, dtype=torch.float64) / n_bins
    # searchsorted (left) gives i with edges[i-1] < p <= edges[i]: bin i-1
    bins = (torch.searchsorted(edges, p, right=False) - 1).clamp(0, n_bins - 1)
    sum_y = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bins, y)
    sum_p = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bins, p)
    # (n_b / N) |mean_b y - mean_b p| = |sum_b y - sum_b p| / N
    return ((sum_y - sum_p).abs().sum() / p.numel()).item()


def brier(y, p) -> float:
    y, p = probes.labels_scores(y, p)
    return ((p - y) ** 2).mean().item()


def pairwise_accuracy(y, s, groups) -> float:
    """Within-episode ranking: over every (correct, incorrect) pair of turns of the same episode,
    the fraction where the correct turn scores higher (ties 1/2). NaN when there is no pair."""
    y, s = probes.labels_scores(y, s)
    groups = list(groups)
    if len(groups) != y.numel():
        raise ValueError(f"{y.numel()} labels but {len(groups)} episode ids")
    by_group: dict = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    wins, pairs = 0.0, 0
    for idx in by_group.values():
        idx = torch.tensor(idx)
        pos, neg = s[idx][y[idx] == 1], s[idx][y[idx] == 0]
        diff = pos[:, None] - neg[None, :]                              # (P, Q)
        wins += (diff > 0).sum().item() + 0.5 * (diff == 0).sum().item()
        pairs += diff.numel()
    return wins / pairs if pairs else float("nan")


def accuracy(y, p, threshold: float = 0.5) -> float:
    y, p = probes.labels_scores(y, p)
    return ((p > threshold).double() == y).double().mean().item()


def metrics(y, p, groups=None, probability=True) -> dict[str, float]:
    """All metrics of METHOD.md §8 for one set of P(correct); an unsupervised score
    (probability=False: -entropy, CoE) has a ranking but no scale, and is reported by AUROC only."""
    if not probability:
        return {"auroc": probes.auroc(y, p)}
    out = {"auroc": probes.auroc(y, p), "auprc": auprc(y, p), "ece": ece(y, p),
           "brier": brier(y, p), "accuracy": accuracy(y, p)}
    if groups is not None:
        out["pairwise"] = pairwise_accuracy(y, p, groups)
    return out


def features_dims(tensors: dict) -> dict:
    L, H = tensors["attn_max"].shape[1:]
    return {"d": int(tensors["h_mean"].shape[1]), "L": int(L), "H": int(H)}


def unsupervised_score(name: str, raw: dict[str, torch.Tensor]) -> torch.Tensor:
    """An unsupervised correctness score -> (N,) float64; higher = more likely correct."""
    if name == "neg_entropy":
        # a sharper attention (lower Renyi-2 entropy) reads as a more confident turn
        return -raw["attn_entropy"].double().flatten(1).mean(dim=1)
    if name in ("coe_r", "coe_c"):
        return raw[name].double()
    raise ValueError(f"unknown score {name!r}; expected one of {SCORES}")


# Unsupervised scores (no training): higher = more likely correct.
SCORES = ("neg_entropy", "coe_r", "coe_c")


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.func in (cmd_extract, cmd_eval, cmd_fit):
        refuse_dir_out(args.out)
    try:
        with contextlib.ExitStack() as stack:
            # Claimed before any work (extract: before the model loads): a busy output is
            # refused at once, not after minutes.
            for directory in args.writes(args):
                stack.enter_context(runs.exclusive_dir(directory))
            args.func(args)
    except (OSError, envs.DataError, mdl.CheckpointError, probes.FormatError) as e:
        sys.exit(f"error: {e}")         # bad input (or an --out under a file): one line


def refuse_dir_out(path) -> None:
    """An --out that names a file to write, checked before any work: not a directory (else
    write_atomic would fail only at the end, naming its temporary file)."""
    if path is not None and Path(path).is_dir():
        raise SystemExit(f"error: --out {path} is a directory; name the file to write")


def seed_dir(where: Path, log) -> Path:
    """`train --out DIR` fits the probes into DIR/seed<S>/: take the smallest seed and say so.
    Any other path is used as it is."""
    seeds = sorted((int(p.name[4:]), p) for p in (where.glob("seed*") if where.is_dir() else ())
                   if p.name[4:].isdigit() and p.is_dir())
    if not seeds:
        return where
    seed, chosen = seeds[0]
    log(f"--probes {where}: the probes of seed {seed} ({chosen}), the smallest of "
        f"{', '.join(str(s) for s, _ in seeds)}; --probes {where / 'seed<S>'} takes another",
        flush=True)
    return chosen


# Where PAIR lies in a seed's directory, first found first: the paper's training mode, the probes
# fitted on the fly, the clean_only mode
PAIR_DIRS = ("pair_mixed", "pair", "pair_clean_only")


def study_probes(args, log) -> Path:
    """--probes a `train --out` directory, or one seed<S>/ of it: the directory the run reads
    the `--reward` probe from (PAIR: the first of PAIR_DIRS there)."""
    where = seed_dir(Path(args.probes), log)
    if args.reward == "pair":
        found = [d for d in (where, *(where / name for name in PAIR_DIRS))
                 if (d / "pair.json").is_file()]
        if not found:
            raise SystemExit(f"--probes {where}: no pair.json there nor in "
                             f"{', '.join(n + '/' for n in PAIR_DIRS)} of it: train PAIR with "
                             "`python -m lab.study train`")
        where = found[0]
    return where


if __name__ == "__main__":
    main()
