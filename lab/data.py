"""Data recipes for the released benchmarks (GTA, ToolBench), beside envs.py which loads and
replays their clean episodes: the contaminated and matched files (download, validation, loading),
the LLM contamination of episodes, the rule-based diagnostic set, episode splits of the test
files, and gold-dialog replay checks.

    python -m lab.data download gta                       # every released file of a family
    python -m lab.data contaminate --data clean_train.json --out contaminated_train.json
    python -m lab.data make-diagnostic gta                # matched_diagnostic_test.json, no LLM
    python -m lab.data split-episodes toolbench --out OUT/toolbench
    python -m lab.data replay gta --split test            # play the gold dialogs, report

This file holds the commands; what they run is lab/worlds/released.py's.
"""
from __future__ import annotations

import argparse
import json
import sys

import envs
from lab.worlds import toolbench
from lab.worlds.released import (ALL_RELEASE_FILES, contaminate_file, download,
                                 make_gta_diagnostic, replay_report, split_episodes)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.data", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("download", help="fetch the released splits from the authors' repository")
    p.add_argument("family", choices=sorted(ALL_RELEASE_FILES), help="which benchmark's files")
    p.add_argument("--data-dir", default=None,
                   help="root folder (files go to DIR/<family>/); default $PAIR_DATA or "
                        "~/.cache/pair/data")
    p.add_argument("--ref", default=envs.RELEASE_REF, help="git commit or branch of the repository")
    p.add_argument("--force", action="store_true", help="download files that already exist")

    p = sub.add_parser("contaminate", help="rewrite one turn per episode with an LLM (paper "
                                           "Appendix contam_procedure)")
    p.add_argument("--data", required=True, help="episode file to contaminate "
                                                 "(clean_<split>.json schema)")
    p.add_argument("--out", required=True, help="output episode file (contaminated schema)")
    p.add_argument("--seed", type=int, default=42, help="seed of the turn and type choices")
    p.add_argument("--model", default="gpt-4o-mini", help="chat model name at the endpoint "
                   "($OPENAI_BASE_URL, key in $OPENAI_API_KEY)")
    p.add_argument("--cache-dir", default=None, help="LLM reply cache (default "
                                                     "~/.cache/pair/llm)")
    p.add_argument("--min-turns", type=int, default=3,
                   help="skip episodes with fewer assistant turns (paper: 3)")
    p.add_argument("--max-turns", type=int, default=8,
                   help="skip episodes with more assistant turns (paper: 8)")

    p = sub.add_parser("make-diagnostic", help="write the adversarial diagnostic set of a "
                                               "released benchmark from its data (no LLM)")
    p.add_argument("family", choices=["gta"], help="which benchmark (GTA: the rules in "
                   "lab/worlds/released.py)")
    p.add_argument("--data-dir", default=None,
                   help="root folder of the released files (DIR/<family>/); default $PAIR_DATA "
                        "or ~/.cache/pair/data")
    p.add_argument("--out", default=None, help="output folder (default: DIR/<family>/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the positions drawn (default 0)")

    p = sub.add_parser("split-episodes", help="split a benchmark's released test files by "
                                              "episode into train and test halves")
    p.add_argument("family", choices=sorted(ALL_RELEASE_FILES), help="which benchmark")
    p.add_argument("--data-dir", default=None,
                   help="root folder of the released files (DIR/<family>/)")
    p.add_argument("--out", required=True, help="output folder for the eight files")
    p.add_argument("--seed", type=int, default=0, help="seed of the episode draw (default 0)")
    p.add_argument("--fraction", type=float, default=0.5,
                   help="fraction of the episodes that go to train (default 0.5)")
    p.add_argument("--episodes", type=int, default=None,
                   help="first draw this many episodes (a seeded subsample; default: all)")

    p = sub.add_parser("replay", help="play the gold dialogs through a replay env and report")
    p.add_argument("family", choices=["gta", "toolbench"], help="which benchmark")
    p.add_argument("--split", default="test", choices=["train", "test"], help="released split")
    p.add_argument("--data-dir", default=None, help="root folder of the released files")
    p.add_argument("--match", default="strict", choices=["strict", "loose"],
                   help="GTA answer matching mode")
    p.add_argument("--judge-model", default=None,
                   help="ToolBench: score gold answers with this judge model (default: no "
                        "scoring)")
    args = ap.parse_args(argv)
    try:
        _run(args)
    except (envs.DataError, toolbench.LLMError, OSError) as e:  # expected failures (an --out
        sys.exit(f"error: {e}")                                 # under a file too): one line


def _run(args):
    if args.command == "download":
        print(download(args.family, args.data_dir, args.ref, args.force))
    elif args.command == "contaminate":
        client = toolbench.ChatClient(args.model, cache_dir=args.cache_dir)
        counts = contaminate_file(args.data, args.out, client, args.seed, args.min_turns,
                                  args.max_turns)
        print(json.dumps({"out": args.out, "counts": counts,
                          "requests": client.requests_made}))
    elif args.command == "make-diagnostic":
        print(json.dumps(make_gta_diagnostic(args.data_dir, args.out, args.seed)))
    elif args.command == "split-episodes":
        print(json.dumps(split_episodes(args.data_dir, args.family, args.out, args.seed,
                                        args.fraction, args.episodes)))
    elif args.command == "replay":
        if args.family == "gta":
            env = envs.make("gta", args.split, args.data_dir, match=args.match)
        else:
            env = toolbench.ToolBenchEnv(args.split, args.data_dir, judge_model=args.judge_model)
        score = args.family == "gta" or args.judge_model is not None
        print(json.dumps(replay_report(env, args.match, score)))


if __name__ == "__main__":
    main()
