"""The built-in tool world, `shop`, and the recipe of the tiny policy that plays it: what
`python grpo.py` runs on when no model and no data are given. A port of PAIR never needs this file.

    python -m lab.shop make-data --out data/shop --episodes 1000   # released-schema files, offline
    python -m lab.shop sft --out DIR    # train a policy (data/shop-policy/README.md: the commands)

This file holds the two commands and the dialogs that `sft` trains each world's policy on. The
shop world itself (tasks, tools that really execute, exact labels, `ShopEnv`) is envs.py's; the
long worlds `shop-long` and `shop-copy` (their tasks, gold dialogs and the slips of their
policies, joined to the built-in worlds in WORLDS) are lab/worlds/shop.py's; shop's gold dialogs,
rule-based contaminations and the released-schema files of `make-data` lab/worlds/shopdata.py's;
the policies' recipe (tokenizer, training, checkpoints) lab/policies/sft.py's. The probes of a
policy of these worlds, fitted on its own labelled turns, are lab/methods/onpolicy.py's.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
from pathlib import Path

import envs
import grpo
from lab.infra import runs
from lab.policies.sft import SPECIALS, SFT_CHECKPOINT, sft
from lab.worlds import released, stale
from lab.worlds.shop import (LONG_HABITS, LONG_SLIPS, LONG_WORLD, WORLDS,
                             copy_decisions, copy_task, long_dialog, long_task, shop_task_from_id)
from lab.worlds.shopdata import make_shop_data, shop_divided


# ---- The dialogs sft trains a built-in policy on ----------------------------------------------

def sft_dialogs(episodes: int, contaminated: float, seed: int,
                divided: float = 0.0) -> list[list[dict]]:
    """Chat messages of make-data's training episodes: a fraction `contaminated` of them
    replaced by their contaminated version, and a fraction `divided` of the other non-USD ones
    by the dialog that converts the wrong way round (shop_divided)."""
    with tempfile.TemporaryDirectory() as tmp:
        make_shop_data(tmp, episodes=episodes, seed=seed)
        clean = envs.load_episodes(Path(tmp) / "clean_train.json")
        dirty = released.load_released_episodes(Path(tmp) / "contaminated_train.json")
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


def copy_sft_dialogs(episodes: int, slips: float, seed: int) -> list[list[dict]]:
    """Chat messages of the first `episodes` shop-copy training episodes, each decision misread
    with probability `slips`, drawn on its own in turn order (copy_decisions), the value copied
    instead drawn uniformly among its slip's values."""
    rng = random.Random(f"sft-copy-{seed}")
    out = []
    for i in range(episodes):
        task_seed = envs.shop_episode_seed("train", seed, i)
        misread = {}
        for decision, values in copy_decisions(task_seed).items():
            if rng.random() < slips and values:
                misread[decision] = rng.choice(values)
        dialog = long_dialog(copy_task(task_seed), misread=misread)
        out.append(envs.dialog_to_messages(dialog, envs.SHOP_TOOLS, []))
    return out


def sft_world_dialogs(args) -> list[list[dict]]:
    """The chat dialogs `sft` trains the policy of args.world on."""
    if args.world == "shop":
        return sft_dialogs(args.episodes, args.contaminated, args.seed, args.divided)
    if args.world == "shop-copy":
        return copy_sft_dialogs(args.episodes, args.slips, args.seed)
    if args.world == stale.STALE_WORLD.name:
        return stale.stale_sft_dialogs(args.episodes, args.slips, args.seed)
    return long_sft_dialogs(args.episodes, args.slips, args.seed)


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
    a("--world", default="shop", choices=tuple(WORLDS),
      help="the world whose dialogs are trained on (shop-long, shop-copy: continue a saved "
           "policy, --init)")
    a("--slips", type=float, default=0.0,
      help="shop-long: probability of each of the three slips (LONG_SLIPS) in a dialog whose "
           "task has its habit (LONG_HABITS), drawn on its own; shop-copy: probability of each "
           "decision's slip (COPY_DECISIONS), drawn on its own; shop-stale: probability of each "
           "decision's stale value (stale.DECISIONS), drawn on its own")
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
        args.out = args.out or str(WORLDS[args.world].policy)
        grpo.check_ranges(ap, args, SFT_RANGES)
        train = args.episodes - (args.world == "shop") * max(1, args.episodes // 5)
        for bad, why in (
                (not 0 < args.lr < math.inf, "--lr must be a positive number"),
                (args.hidden % (2 * args.heads), "--hidden must be a multiple of 2 x --heads"),
                (args.heads % args.kv_heads, "--heads must be a multiple of --kv-heads"),
                (args.batch > train, f"--batch must be at most the {train} training dialogs"),
                (args.init and not Path(args.init).is_dir(), "--init must be a directory"),
                (args.world != "shop" and not args.init, f"--world {args.world} continues a "
                 "saved policy: pass --init DIR (its tokenizer knows the words of both worlds; "
                 f"the first command of {LONG_WORLD.policy}/README.md trains the "
                 "shipped one)"),
                (args.world == "shop" and args.slips or args.world != "shop" and args.divided,
                 "--slips is the long worlds' and --divided shop's: pass the one of --world")):
            if bad:
                ap.error(why)
        with runs.exclusive_dir(args.out):    # one writer; a stopped run is not overwritten
            if (Path(args.out) / SFT_CHECKPOINT).is_dir() and not args.resume:
                ap.error(f"{Path(args.out) / SFT_CHECKPOINT} holds a stopped run: continue "
                         "it with --resume, or delete it to start over")
            return sft(args, sft_world_dialogs, WORLDS[args.world])
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
