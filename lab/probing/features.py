"""The detection study's features and trained probes, as a library: the features of a matched
file (`extract`: one teacher-forced forward per record, resumable, with the contamination
distance of each record) and the probes a `python -m lab.study train --out` directory holds, read
by a run's `--probes` (`study_probes`). The commands are lab/study.py's; the protocol (splits,
training sets, metrics) lab/probing/detection.py's; the paper's tables lab/probing/report.py's.

Contamination distance (METHOD.md §8c): d = the number of assistant turns from the nearest earlier
contaminated turn to the evaluated one. The released indices count dialog *messages* (user,
assistant, tool), so their difference is 2 for the immediately preceding assistant turn and bucket
d = 1 would always be empty; the paper reads d = 1 as "the error is the immediately preceding
turn", so `distance` counts assistant turns (the message difference is kept as
`distance_messages`).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch

import grpo
import model as mdl
import probes
from lab.infra import runs
from lab.probing import traces
from lab.probing.detection import load_features, raw_with_coe
from lab.worlds import released


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
    messages = released.record_messages(record)
    if messages[-1]["role"] != "assistant":
        raise ValueError("dialog does not end with an assistant message (the evaluation turn)")
    ids, spans = tokenizer.render(messages)
    ids, spans, cut = keep_last(ids, spans, max_len)
    if spans[-1][1] - spans[-1][0] < 1:
        raise ValueError(f"the evaluation turn does not fit in --max-len {max_len}")
    return ids, spans[-1], cut


def keep_last(ids: list[int], spans: list[tuple], max_len: int):
    """Keep the last max_len tokens (METHOD.md §3); spans shift with them, a span cut in part is
    clipped at 0 and one cut entirely becomes (0, 0). Returns (ids, spans, n_cut)."""
    cut = max(0, len(ids) - max_len)
    if not cut:
        return ids, list(spans), 0
    shifted = [(max(0, s - cut), max(0, e - cut)) for s, e in spans]
    return ids[cut:], shifted, cut


def input_digest(ids: list[int], span) -> torch.Tensor:
    """sha256 of the exact model input (token ids and evaluation span) as 32 uint8: two records
    with one digest give the same forward, so their features are the same numbers."""
    h = hashlib.sha256(torch.tensor(list(ids) + list(span), dtype=torch.int64).numpy().tobytes())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)


def extract(net, tokenizer, data_path, out_path, max_len=4096, shard_size=32,
            manifest_extra=None, log=None, records=None, reuse=()) -> dict:
    """Features of every record of a matched file -> a features file (safetensors: the
    raw tensors of detection.RAW_KEYS and the label, stacked over records; the record ids and
    the manifest in its JSON metadata, read back by load_features).

    Completed records are written to OUT.parts/ in shards (atomically); a rerun with the same
    arguments skips them. Records that fail are listed by id, printed and kept in the output's
    metadata; with failures the parts stay, so a rerun retries only those. `reuse`: features
    files of the same model whose records with the same input digest are copied instead of
    run again (in the released GTA test pairs, 104 of 177 contaminated records are the clean
    record token for token)."""
    log = log or sys.stderr
    data_path, out_path = Path(data_path), Path(out_path)
    if records is None:                           # validated; each with its episode's tools
        records = released.load_matched(data_path)
    if not records:
        raise SystemExit(f"{data_path}: no record to extract (an empty list)")
    parts = parts_dir(out_path)
    manifest = {"data": str(data_path.resolve()), "data_sha256": grpo.file_sha256(data_path),
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
                raw = raw_with_coe(trace)
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


def claim_parts(parts: Path, manifest: dict) -> None:
    """Create `parts` holding `manifest` for a fresh extraction, or check that the manifest there
    is this one: a resumed extraction only continues work made with the same arguments."""
    path = parts / "manifest.json"
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


def _open_parts(parts: Path, manifest: dict) -> set[int]:
    """The record indices already extracted under `parts` (creating it for a fresh run)."""
    # Resumed by content: the data's and the model's hashes, not their paths (a moved copy
    # resumes; weights swapped under the same path do not).
    claim_parts(parts, {k: v for k, v in manifest.items() if k not in ("data", "model")})
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


def subsample_episodes(records: list[dict], n: int, seed: int) -> list[dict]:
    """The records of n episodes drawn with `seed`, in file order. The draw depends only on the
    set of episode ids, so the clean and contaminated files of a family keep the same pairs."""
    unique = sorted({r["episode_id"] for r in records})
    order = torch.randperm(len(unique), generator=torch.Generator().manual_seed(seed))
    keep = {unique[j] for j in order[:n].tolist()}
    return [r for r in records if r["episode_id"] in keep]


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
