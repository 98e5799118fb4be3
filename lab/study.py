"""The detection study (paper §3, Table result_pair): features extracted from matched records,
PAIR and every baseline probe trained per seed, and the paper's tables (a)-(e).

This file holds the commands. The features (`extract`: one teacher-forced forward per record,
resumable; each record's contamination distance, METHOD.md §8c) are lab/probing/features.py's.
The protocol - the features read as splits, each seed's training set, the probes fitted on it and
the metrics - is lab/probing/detection.py's (seeds 42, 43, 44, each a class-balanced subsample of
matched_clean_train; mean +- std over seeds); the paper's tables (a)-(e) and the contamination
analyses are lab/probing/report.py's.

    python -m lab.study extract --model DIR --data gta/matched_clean_train.json \\
                                --out feats/matched_clean_train.safetensors
    python -m lab.study train  --features feats --out probes/gta   # PAIR + every baseline probe
    python -m lab.study eval   --probes probes/gta --features feats
    python -m lab.study report --features feats                    # report.md + report.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import envs
import model as mdl
import pair
import probes
from lab.infra import runs
from lab.probing.detection import (DIAGNOSTIC_SPLIT, MODES, SCORES, SEEDS, TEST_SPLITS,
                                   TRAIN_SPLITS, fit_baselines, load_features, load_splits,
                                   mean_std, metrics, predict, training_set, unsupervised_score)
from lab.probing.features import extract, parts_dir, subsample_episodes
from lab.probing.report import (guess_paper_ref, json_clean, md_table, ms_cell, nested,
                                render_markdown, run_report)
from lab.worlds import released

def cmd_extract(args):
    records = released.load_matched(args.data)      # a bad data file fails before the model loads
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




if __name__ == "__main__":
    main()
