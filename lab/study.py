"""The detection study (paper §3, Table result_pair): features extracted from matched records,
PAIR and every baseline probe trained per seed, and the paper's tables (a)-(e).

Contamination distance (METHOD.md §8c): d = the number of assistant turns from the nearest earlier
contaminated turn to the evaluated one. The released indices count dialog *messages* (user,
assistant, tool), so their difference is 2 for the immediately preceding assistant turn and bucket
d = 1 would always be empty; the paper reads d = 1 as "the error is the immediately preceding
turn", so `distance` counts assistant turns (the message difference is kept as
`distance_messages`).

This file extracts the features (`extract`: one teacher-forced forward per record, resumable)
and holds the commands. The protocol - the features read as splits, each seed's training set, the
probes fitted on it and the metrics - is lab/detection.py's (seeds 42, 43, 44, each a
class-balanced subsample of matched_clean_train; mean +- std over seeds); the paper's tables
(a)-(e) and the contamination analyses are lab/report.py's.

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
import json
import shutil
import sys
import time
from pathlib import Path

import torch

import envs
import grpo
import model as mdl
import pair
import probes
from lab import data as lab_data, runs, traces
from lab.detection import (DIAGNOSTIC_SPLIT, MODES, SCORES, SEEDS, TEST_SPLITS, TRAIN_SPLITS,
                           fit_baselines, load_features, load_splits, mean_std, metrics, predict,
                           raw_with_coe, training_set, unsupervised_score)
from lab.report import (guess_paper_ref, json_clean, md_table, ms_cell, nested,
                        render_markdown, run_report)


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
        records = lab_data.load_matched(data_path)
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
    net, tokenizer = mdl.load_model(args.model, dtype=mdl.DTYPES[args.dtype], device=args.device)
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
    rows = [[m] + [ms_cell(nested(result, m, s, k)) for s in tests for k in ("auroc", "ece")]
            for m in result]
    print("\n".join(md_table(header, rows)))
    if args.out:
        mdl.write_atomic(Path(args.out), json.dumps(json_clean(result), indent=2) + "\n")
        print(f"wrote {args.out}")


def cmd_report(args):
    out = Path(args.out or args.features)
    print(f"report: fitting every probe for seeds {args.seeds} ...", file=sys.stderr)
    result = run_report(args.features, args.mode, args.seeds, args.C, args.crossfit)
    paper_ref = guess_paper_ref(result) if args.paper_ref == "auto" else (
        None if args.paper_ref == "none" else args.paper_ref)
    result["paper_ref"] = paper_ref
    markdown = render_markdown(result, paper_ref)
    mdl.write_atomic(out / "report.json", json.dumps(json_clean(result), indent=2) + "\n")
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
    p.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda (default cpu)")
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
