"""A GRPO run around the algorithm: its processes, its directory, its checkpoints and its report.

grpo.py holds the method (rollout -> rewards -> advantages -> update, and the training loop);
this file holds what makes a run of it safe to start, kill and resume:
  * processes: under torchrun every process plays its share of the prompts, and gradients and
    metric sums are all-reduced (`World`, `all_sum`, ...); one process is the same code path;
  * the run directory: one run per --out (locked), checked against --resume before anything is
    loaded (`check_out`, `prepare_out`);
  * checkpoints: the adapter in PEFT's layout, the optimizer, every process's RNG states and the
    step, written to a temporary directory renamed into place, so that a kill leaves the last
    checkpoint whole and a resumed run gives the metrics of an uninterrupted one;
  * the report: a progress line per step, and the summary (base, selected and final held-out
    success) when the run ends.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import adapters
import baselines
import common
import envs
import model
import onpolicy
import shop
import weights
from rollout import rollout


# ---------------------------------------------------------------------------------------------
# Flags: the paper's Table grpo_config, and a preset for the tiny built-in policy
# ---------------------------------------------------------------------------------------------

PAPER_HPARAMS = dict(batch=1, group=4, max_turns=10, max_new_tokens=1024, temperature=1.0,
                     top_p=1.0, lr=3e-7, warmup=0.05, beta=0.01, eps=0.2, steps=500,
                     save_every=50, lora_r=16, lora_alpha=32.0, lora_dropout=0.05, oversample=1,
                     eval_batch=16)
# The built-in policy has ~0.3M parameters, not 7B, and its turns are short. Its rollouts are
# sampled at T = 0.7: closer to the greedy decoding it is evaluated with, and shorter (at T = 1 it
# rambles to --max-new-tokens far more often). Four prompts per step so that a step rarely has no
# informative group; lr 3e-4 (1e-3 and above erode held-out success within 10 steps); no LoRA
# dropout, which at this size costs a fifth of the update and only adds noise. Greedy evaluation
# decodes 128 episodes at a time (the turns of greedy rows end close together). One torch thread:
# a model this small gains little from a second (1.17x alone), and two threads waiting for each
# other beside any other busy process ran 1.8x to 40x slower, one thread not at all. Everything
# not listed keeps the paper's value.
TINY = dict(batch=4, group=8, max_new_tokens=96, temperature=0.7, lr=3e-4, lora_dropout=0.0,
            steps=20, save_every=10, eval_batch=128, threads=1)
# What the probes of the built-in policy are fitted on (--probe-corpus; onpolicy.py fits them)
PROBE_CORPORA = ("on-policy", "contaminated", "both")
# Defaults of flags that a --preset may set, and which Table grpo_config does not give
DEFAULTS = dict(weight_decay=0.0, advantage="process")
# --preset release: the authors' release as it ran (its GRPO loop and policy wrapper), where it
# departs from the defaults: torch's AdamW weight decay 0.01, a constant lr with no warmup (its
# "constant" schedule builds no scheduler at all), nucleus sampling at top-p 0.95, and its
# advantage and update (--advantage release: every turn weighing the same, the mean log-ratio as
# the KL estimate, log pi at T = 1). Not reproduced: the cap of its update's forward at the last
# 2,560 tokens of each turn's context (METHOD.md §9).
PRESETS = {"release": dict(weight_decay=0.01, warmup=0.0, top_p=0.95, advantage="release")}
# The flags of Table grpo_config (and the paper's 50-step checkpoints); the paper states no
# sampling temperature, top-p, LoRA alpha or dropout: those defaults are the release's (T 1.0,
# alpha 32, dropout 0.05) or, top-p 1.0, this repository's (the release samples at 0.95)
PAPER_STATED = ("batch", "group", "max_turns", "max_new_tokens", "lr", "warmup", "beta", "eps",
                "steps", "save_every", "lora_r")
SOURCE = {"temperature": "the release's; the paper states none", "lora_alpha": "the release's",
          "lora_dropout": "the release's", "top_p": "the paper states none; the release's 0.95 "
          "with --preset release"}
# --advantage: how per-turn rewards become advantages (grpo.ADVANTAGES, grpo.advantages)
ADVANTAGE_FORMS = ("process", "release", "position", "outcome-turn")


def is_builtin(args) -> bool:
    """The built-in world's own policy (TINY preset)."""
    return args.env in shop.WORLDS and \
        Path(args.model).resolve() == shop.BUILTIN_POLICIES[args.env].resolve()


def resolve_preset(args, world) -> None:
    """Fill the flags left unset: the tiny preset for the built-in policy, else the paper's."""
    preset = dict(PAPER_HPARAMS, **TINY) if is_builtin(args) else dict(PAPER_HPARAMS)
    if args.env in shop.WORLDS:         # shop-long's episodes are longer than the paper's 10
        preset["max_turns"] = shop.MAX_TURNS[args.env]
    preset.update(DEFAULTS, **PRESETS.get(args.preset, {}))
    given = {k for k in preset if getattr(args, k) is not None}
    for k, v in preset.items():
        if k not in given:
            setattr(args, k, v)
    if args.micro_batch is None:
        args.micro_batch = args.group
    if args.reward in baselines.TREE_SEARCH:
        baselines.tree_defaults(args)
        for name in ("tree_m", "tree_n", "tree_l"):
            if getattr(args, name) < 1:
                raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(args, name)}")
        if args.outcome_weight:
            raise SystemExit(f"--outcome-weight: --reward {args.reward} learns from the outcome "
                             "alone already; leave it at 0")
        if args.advantage != "process":
            what = f"--preset {args.preset}" if "advantage" not in given and args.preset else \
                f"--advantage {args.advantage}"
            raise SystemExit(f"{what}: --reward {args.reward} derives its advantages from its "
                             "trees; leave --advantage at process")
    if world.main and is_builtin(args):
        def flags(keys):
            return ", ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in keys)
        print("preset for the tiny built-in policy (the paper's 7B values for everything else): "
              + flags(k for k in TINY if k not in given)
              + (f"; from the command line: {flags(k for k in TINY if k in given)}"
                 if given & set(TINY) else ""), flush=True)
    if world.main and args.preset:
        print(f"--preset {args.preset}: " + ", ".join(
            f"--{k.replace('_', '-')} {getattr(args, k)}" + (" (from the command line)"
                                                             if k in given else "")
            for k in PRESETS[args.preset]), flush=True)


def preset_help(key: str, what: str) -> str:
    """`what` and the flag's effective default, read from the presets themselves: TINY's with
    the built-in policy, the paper's (Table grpo_config) with any other model."""
    tiny, paper = dict(PAPER_HPARAMS, **TINY)[key], PAPER_HPARAMS[key]
    source = "the paper's" if key in PAPER_STATED else SOURCE.get(key)
    if tiny == paper:
        return f"{what} (default: {paper}{', ' + source if source else ''})"
    return f"{what} (default: {tiny} with the built-in policy, {paper} otherwise" \
        f"{': ' + source if source else ''})"


def train_parser(rewards) -> argparse.ArgumentParser:
    """grpo.py's flags; `rewards`: the names --reward takes (grpo.REWARDS)."""
    ap = argparse.ArgumentParser(
        prog="grpo.py", formatter_class=common.HelpFormatter,
        usage="%(prog)s [flags]           train (the flags below)\n"
              "       %(prog)s compare [flags]   rewards x seeds -> one table (compare --help)",
        description="Multi-turn GRPO with LoRA and step-level rewards (METHOD.md §9). "
                    "With no flag: "
                    "the shop environment, the built-in policy, PAIR probes fitted on the fly.",
        epilog="A default given as two values is the tiny preset's with the built-in policy "
               "(printed at start) and the paper's Table grpo_config with any other model. "
               "Scale out with `torchrun --nproc_per_node N grpo.py ...` (prompts sharded, "
               "gradients all-reduced) or split one model with --devices cuda:0,cuda:1.")
    a = ap.add_argument
    a("--env", default="shop", choices=(*shop.WORLDS, "gta", "toolbench"),
      help="environment: a built-in world (shop.py; shop-long is the long-horizon one) or a "
           "released dataset replayed (envs.py)")
    a("--data-dir", default=None, help="gta / toolbench: the released files' root (default: "
      "$PAIR_DATA, else ~/.cache/pair/data; `python envs.py download` fills it)")
    a("--model", default=None,
      help="policy: a checkpoint directory or a Hugging Face model name (default: the built-in "
           "world's own policy, data/shop-policy or data/shop-long-policy)")
    a("--reward", default="pair", choices=tuple(rewards), help="per-turn reward source")
    a("--alpha", type=float, default=5.0,
      help="PAIR momentum scaling (METHOD.md §7); 0 = vanilla PAIR, r_t = s~_t")
    a("--outcome-weight", type=float, default=0.0,
      help="add this times the task score to the last turn's reward (METHOD.md §9)")
    a("--advantage", default=None, choices=ADVANTAGE_FORMS,
      help="how per-turn rewards become advantages and the loss (METHOD.md §9): process = "
           "DeepSeekMath process supervision, pooled normalization and returns to go, "
           "token-normalized loss; release = the authors' release, each turn's reward against "
           "its rollout's mean plus the rollout's normalized total, every turn weighing the "
           "same; position = process on each turn's reward minus the group's mean at its turn "
           "index; outcome-turn = the outcome's group advantage on every token plus "
           "--turn-weight x the turn's own position-centred reward, no sum over later turns "
           "(default: process; release with --preset release)")
    a("--turn-weight", type=float, default=1.0,
      help="--advantage outcome-turn: lambda, the weight of the turn's own centred reward "
           "beside the outcome's group advantage")
    a("--preset", default=None, choices=tuple(PRESETS),
      help="release = the authors' release as it ran: --weight-decay 0.01, --warmup 0, --top-p "
           "0.95, --advantage release (its update and KL estimate); flags given win")
    a("--probes", default=None,
      help="trained probes: a `pair.py train --out` directory (its smallest seed<S>/ is used, "
           "pair_mixed/ in it for --reward pair) or one seed<S>/ of it, a PAIR directory, a "
           "probe file; default on shop: fitted on the fly for this policy (--probe-corpus), "
           "cached under $PAIR_CACHE")
    a("--probe-corpus", default="on-policy", choices=PROBE_CORPORA,
      help="shop, probes fitted on the fly: on-policy = rollouts of the base policy on training "
           "episodes, labelled by the world; contaminated = `shop.py make-data` gold dialogs and "
           "their rule-based contaminations (the released recipe); both = the two together")
    a("--probe-reads", default="policy", choices=("policy", "base"),
      help="where PAIR and the probes read a turn's statistics: policy = the generation pass "
           "(the paper); base = the same tokens teacher-forced through the frozen base model "
           "(one extra forward per step; a drifting policy cannot move what the probe reads)")
    a("--probe-retrain-every", type=int, default=0,
      help="shop: every N steps, fit the head the reward reads again (PAIR's stage 2, or the "
           "probe) on the policy's own turns of the last N steps, labelled by the world "
           "(0: never; the paper tried it and kept it off)")
    a("--corpus-episodes", type=int, default=100,
      help="on-policy corpus: training episodes sampled")
    a("--corpus-samples", type=int, default=4,
      help="on-policy corpus: rollouts per episode (also for the held-out own turns)")
    a("--corpus-heldout", type=int, default=50,
      help="validation episodes whose rollouts score the fitted probes (held-out own turns)")
    a("--probe-episodes", type=int, default=200,
      help="contaminated corpus: episodes of `shop.py make-data` (80%% of them train)")
    a("--judge-model", default="gpt-4o-mini",
      help="llm_judge: model name at the OpenAI-compatible endpoint (OPENAI_BASE_URL, "
           "OPENAI_API_KEY)")
    a("--tips-refresh", type=int, default=10,
      help="tips: steps between refreshes of the lagged teacher (a LoRA snapshot)")
    a("--tips-gamma", type=float, default=1.0, help="tips: discount gamma of the shaping term")
    a("--tree-m", type=int, default=None,
      help="tree_grpo: trees per prompt, each grown from one chain; at2po: chain rollouts under "
           "its one root (default --group / 2)")
    a("--tree-n", type=int, default=None,
      help="tree_grpo: nodes drawn per tree per round, one branch each (default 2); at2po: the "
           "top-K nodes regenerated per round (default --group / 4)")
    a("--tree-l", type=int, default=None,
      help="tree_grpo, at2po: expansion rounds (default 1 for tree_grpo, 2 for at2po)")
    a("--at2po-penalty", type=float, default=0.05,
      help="at2po: branching penalty alpha, score = entropy - alpha x siblings (the release's)")
    a("--at2po-clip", type=float, nargs=2, default=[3e-3, 4e-3], metavar=("LOW", "HIGH"),
      help="at2po: clip range of the turn-level ratio, [1 - LOW, 1 + HIGH] (the release's)")
    g = ap.add_argument_group("rollout")
    g.add_argument("--steps", type=int, default=None, help=preset_help("steps", "training steps"))
    g.add_argument("--batch", type=int, default=None,
                   help=preset_help("batch", "prompts per step"))
    g.add_argument("--group", type=int, default=None,
                   help=preset_help("group", "rollouts per prompt, G"))
    g.add_argument("--max-turns", type=int, default=None,
                   help=preset_help("max_turns", "assistant turns per rollout") +
                   f"; --env shop-long: {shop.MAX_TURNS['shop-long']}")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help=preset_help("max_new_tokens", "generated tokens per turn"))
    g.add_argument("--max-len", type=int, default=8192,
                   help="KV cache capacity per rollout; a rollout that would outgrow it ends")
    g.add_argument("--temperature", type=float, default=None,
                   help=preset_help("temperature", "sampling temperature"))
    g.add_argument("--top-p", type=float, default=None,
                   help=preset_help("top_p", "nucleus sampling mass"))
    g = ap.add_argument_group("optimization")
    g.add_argument("--lr", type=float, default=None,
                   help=preset_help("lr", "AdamW learning rate"))
    g.add_argument("--warmup", type=float, default=None,
                   help=preset_help("warmup", "fraction of steps of linear warmup, then constant"))
    g.add_argument("--beta", type=float, default=None, help=preset_help("beta", "KL coefficient"))
    g.add_argument("--eps", type=float, default=None,
                   help=preset_help("eps", "PPO clip epsilon"))
    g.add_argument("--oversample", type=int, default=None,
                   help=preset_help("oversample", "DAPO dynamic sampling: play up to K x --batch "
                                    "prompts per step and keep the first --batch whose group "
                                    "gives some turn an advantage (1: off)"))
    g.add_argument("--ppo-epochs", type=int, default=1,
                   help="passes over each batch (1: on-policy, rho = 1)")
    g.add_argument("--micro-batch", type=int, default=None,
                   help="rollouts per forward in the update (default: --group)")
    g.add_argument("--micro-batch-tokens", type=int, default=16384,
                   help="at most this many padded tokens per forward in the update (a longer "
                   "rollout goes alone): with its blocks recomputed in the backward pass, the "
                   "update holds about 0.2 GiB per 1,000 tokens at 7B")
    g.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip")
    g.add_argument("--weight-decay", type=float, default=None,
                   help="AdamW weight decay (default: 0; 0.01 with --preset release, torch's "
                        "default, which the release keeps)")
    g.add_argument("--lora-r", type=int, default=None, help=preset_help("lora_r", "LoRA rank"))
    g.add_argument("--lora-alpha", type=float, default=None,
                   help=preset_help("lora_alpha", "LoRA alpha"))
    g.add_argument("--lora-dropout", type=float, default=None,
                   help=preset_help("lora_dropout", "LoRA dropout"))
    g.add_argument("--lora-targets", default=",".join(model.LORA_TARGETS),
                   help="comma-separated projections that get an adapter")
    g = ap.add_argument_group("run")
    g.add_argument("--out", default=None,
                   help="run directory (default: runs/<env>-<reward>-<date>-<time>, new)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest checkpoint; with no run "
                        "there, stop and say so")
    g.add_argument("--resume-if-present", action="store_true",
                   help="continue the run in --out if there is one, else start it (for scripts)")
    g.add_argument("--save-every", type=int, default=None,
                   help=preset_help("save_every", "checkpoint (and evaluate) every N steps"))
    g.add_argument("--eval-episodes", type=int, default=0,
                   help="test episodes per evaluation (0 = the whole test split; shop: 600)")
    g.add_argument("--val-episodes", type=int, default=None,
                   help="validation episodes per evaluation, for checkpoint selection (shop: its "
                        "validation split, 200; replay environments: set aside from the end of "
                        "the training split, default 10%% of it)")
    g.add_argument("--eval-batch", type=int, default=None,
                   help=preset_help("eval_batch", "episodes decoded together in an evaluation"))
    g.add_argument("--no-eval", action="store_true", help="skip the held-out evaluations")
    g.add_argument("--seed", type=int, default=42, help="seed of everything")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="model weights dtype (the adapter stays float32)")
    g.add_argument("--devices", default=None,
                   help="split the model over these devices, e.g. cuda:0,cuda:1 (default: the "
                        "process's GPU under torchrun, else the CPU)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 with the built-in policy; else torch's "
                   "choice, or $OMP_NUM_THREADS)")
    return ap


# The range of every numeric flag, checked before anything is loaded: a wrong value must not
# cost a model load and minutes of probe fitting first (nan fails every check).
FLAG_RANGES = {
    **{k: common.at_least(1) for k in ("steps", "batch", "group", "max_turns", "max_new_tokens",
                                 "max_len", "oversample", "ppo_epochs", "micro_batch", "lora_r",
                                 "micro_batch_tokens", "save_every", "eval_batch",
                                 "corpus_episodes", "corpus_samples",
                                 "corpus_heldout", "tips_refresh", "tree_m", "tree_n", "tree_l")},
    "threads": common.THREADS,
    **{k: common.at_least(0) for k in ("eval_episodes", "val_episodes", "probe_retrain_every")},
    "seed": ((lambda v: 0 <= v < 2 ** 32), "in [0, 2**32) (numpy's seeds)"),
    "probe_episodes": common.at_least(2),
    "temperature": ((lambda v: model.MIN_TEMPERATURE <= v < math.inf),
                    f"a finite number >= {model.MIN_TEMPERATURE}"),
    **{k: common.positive() for k in ("lr", "eps", "grad_clip", "lora_alpha")},
    **{k: common.finite(0.0) for k in ("beta", "weight_decay", "at2po_penalty", "alpha")},
    **{k: common.finite() for k in ("outcome_weight", "tips_gamma", "turn_weight")},
    "top_p": ((lambda v: 0 < v <= 1), "in (0, 1]"),
    "warmup": ((lambda v: 0 <= v <= 1), "in [0, 1]"),
    "lora_dropout": ((lambda v: 0 <= v < 1), "in [0, 1)"),
    "at2po_clip": ((lambda v: 0 <= v < 1), "two numbers in [0, 1)"),
}


def parse_args(argv, rewards) -> argparse.Namespace:
    """grpo.py's command line, checked, with --out defaulting to a new runs/ directory."""
    ap = train_parser(rewards)
    args = ap.parse_args(argv)
    if args.model is None:
        args.model = str(shop.BUILTIN_POLICIES.get(args.env, shop.BUILTIN_POLICY))
    common.check_ranges(ap, args, FLAG_RANGES)
    if args.resume and args.resume_if_present:
        ap.error("--resume and --resume-if-present: pass one")
    if args.devices is not None:
        try:
            model.parse_devices(args.devices)
        except ValueError as e:
            ap.error(str(e))
    bad = [t for t in args.lora_targets.split(",") if t not in model.LORA_TARGETS]
    if bad:
        ap.error(f"--lora-targets {args.lora_targets!r}: {bad} not among the blocks' linear "
                 f"layers {','.join(model.LORA_TARGETS)}")
    if args.out is None:
        if args.resume:
            ap.error("--resume: nothing to resume without --out (the run directory to continue)")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--out is required with several processes")
        args.out = str(Path("runs") / f"{args.env}-{args.reward}-{time.strftime('%Y%m%d-%H%M%S')}")
    return args


# ---------------------------------------------------------------------------------------------
# Processes: torchrun shards the prompts; gradients and metric sums are all-reduced
# ---------------------------------------------------------------------------------------------

@dataclass
class World:
    rank: int = 0
    size: int = 1
    device: str = "cpu"             # where all-reduced tensors live (cuda for nccl)

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_world(args) -> World:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    gpu = torch.cuda.is_available() and not (args.devices or "cuda").startswith("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if gpu:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if gpu else "gloo")
    return World(dist.get_rank(), dist.get_world_size(), f"cuda:{local}" if gpu else "cpu")


def all_sum(world: World, values: list[float]) -> list[float]:
    if world.size == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    return t.tolist()


def barrier(world):
    if world.size > 1:
        dist.barrier()


def all_max(world: World, value: float) -> float:
    if world.size == 1:
        return float(value)
    t = torch.tensor([value], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gather_floats(world: World, values: list[float], size: int) -> list[float]:
    """Concatenate every process's list (each at most `size` long)."""
    if world.size == 1:
        return list(values)
    t = torch.full((size,), float("nan"), dtype=torch.float64, device=world.device)
    t[:len(values)] = torch.tensor(values, dtype=torch.float64)
    parts = [torch.empty_like(t) for _ in range(world.size)]
    dist.all_gather(parts, t)
    return [v for part in parts for v in part.tolist() if not math.isnan(v)]


# ---------------------------------------------------------------------------------------------
# The run directory: one run per --out, checked against --resume first
# ---------------------------------------------------------------------------------------------

# flags that must not change when a run is resumed: everything that trains or scores it (not
# where it runs: --threads, --devices, --eval-batch change float summation order only)
RESUME_KEYS = ("env", "model", "reward", "alpha", "outcome_weight", "probes", "seed", "steps",
               "batch", "group", "max_turns", "max_new_tokens", "max_len", "temperature", "top_p",
               "lr", "warmup", "beta", "eps", "oversample", "ppo_epochs", "micro_batch",
               "micro_batch_tokens", "lora_r", "lora_alpha", "lora_dropout", "lora_targets",
               "save_every", "tips_refresh",
               "tips_gamma", "probe_corpus", "probe_reads", "corpus_episodes", "corpus_samples",
               "corpus_heldout", "probe_episodes", "eval_episodes", "val_episodes", "tree_m",
               "tree_n", "tree_l", "at2po_penalty", "at2po_clip", "advantage",
               "probe_retrain_every", "grad_clip", "weight_decay", "dtype", "judge_model",
               "turn_weight")


# what a run from before these flags existed ran with
RESUME_DEFAULTS = {"advantage": "process", "probe_retrain_every": 0, "turn_weight": 1.0}


def changed_flag(args, old: dict) -> tuple[str, object, object] | None:
    """The first flag of RESUME_KEYS whose value in args differs from a run's args.json (old):
    (--flag, its value now, the run's), or None. A model directory is the same written another
    way (relative, as the records in results/ are)."""
    for k in RESUME_KEYS:
        if k not in old and k not in RESUME_DEFAULTS:
            continue                        # not recorded, and no default to compare with
        # a run from before the flag existed ran with its default
        now, then = getattr(args, k), old.get(k, RESUME_DEFAULTS.get(k))
        if then == now:
            continue
        if k == "model" and isinstance(then, str) and Path(then).is_dir() and \
                Path(then).resolve() == Path(now).resolve():
            continue
        return f"--{k.replace('_', '-')}", now, then
    return None


def check_out(args) -> None:
    """What --out holds against --resume / --resume-if-present. Read-only: checked before
    anything is loaded or written, and again once OUT is claimed. A run exists in OUT from the
    moment its args.json is written (after every input was checked)."""
    out = Path(args.out)
    saved = out / "args.json"
    if args.resume_if_present:
        args.resume = saved.exists()
    if args.resume and saved.exists():
        try:
            old = json.loads(saved.read_text())
            if not isinstance(old, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError, RecursionError) as e:
            raise SystemExit(f"--resume: {saved} is not readable ({type(e).__name__}: {e}); the "
                             "flags of the run cannot be checked") from None
        changed = changed_flag(args, old)
        if changed:
            flag, now, then = changed
            raise SystemExit(f"--resume: {flag} is {now!r} but the run in {out} used {then!r}")
        # A finished run, or logs past the step of the first checkpoint (a step is logged, then
        # its checkpoint saved), and no checkpoint: they were deleted (as in results/, which
        # keeps none). Starting over would replace the logs.
        logged = max((r["step"] for r in common.read_jsonl(out / "metrics.jsonl")), default=0)
        first = min(args.save_every, args.steps)
        gone = not any(out.glob("checkpoint-*"))     # a damaged one: resume() says so
        if gone and (logged > first or (out / "summary.json").exists()):
            raise SystemExit(f"--resume: {out} logged {logged} steps but holds no checkpoint (the "
                             f"first is saved after step {first}): there is nothing to resume "
                             "from, and starting over would replace its logs; restore its "
                             "checkpoints, or choose another --out")
    elif args.resume and latest_checkpoint(out):
        # without it any flag could change under the checkpoint's optimizer and RNG states
        raise SystemExit(f"--resume: {out} holds checkpoints but no args.json, so the flags "
                         "of that run cannot be checked; restore it, or start a new --out")
    elif args.resume:
        # a typo in --out must not start a new run from scratch under the user's nose
        raise SystemExit(f"--resume: nothing to resume in {out} (no run was started there); "
                         "leave out --resume to start one, or pass --resume-if-present to "
                         "start one only when there is none")
    elif any((out / f).exists() for f in ("metrics.jsonl", "eval.jsonl")) or \
            latest_checkpoint(out):         # eval.jsonl: killed after the base evaluation
        raise SystemExit(f"--out {out} already holds a run: pass --resume to continue it, or "
                         "choose another --out")


def prepare_out(args, world) -> Path:
    out = Path(args.out)
    if world.main:
        # One run per --out, held until this process exits: two would interleave their metrics
        # and checkpoints.
        common.claim(out)
        check_out(args)
        common.write_json(out / "args.json", vars(args))
    if world.size > 1:
        dist.barrier()
    return out


def forget_failed(out) -> None:
    """A run that failed before its first step leaves no run behind: the args.json, lock and
    directory this process made are removed (only while it holds OUT, and only when OUT holds
    no metrics, evaluation or checkpoint)."""
    out = Path(out)
    if not common.holds(out) or any((out / n).exists() for n in ("metrics.jsonl", "eval.jsonl")) \
            or any(out.glob("checkpoint-*")):
        return
    (out / "args.json").unlink(missing_ok=True)
    shutil.rmtree(out / "refit", ignore_errors=True)
    (out / common.LOCK_FILE).unlink(missing_ok=True)
    common.release(out)
    with contextlib.suppress(OSError):
        out.rmdir()                     # only if nothing else is in it


# ---------------------------------------------------------------------------------------------
# Checkpoints: adapter (PEFT layout), optimizer, RNG states, step; written atomically
# ---------------------------------------------------------------------------------------------

def save_checkpoint(out: Path, step: int, policy, optimizer, world, lagged=None) -> Path:
    """OUT/checkpoint-<step>/; `lagged`: the tips reward's lagged LoRA snapshot, if any. A write
    that fails (a full disk) leaves the earlier checkpoints as they were and stops the run with
    one line."""
    final = out / f"checkpoint-{step:06d}"
    tmp = out / f".checkpoint-{step:06d}.tmp"
    try:
        return _write_checkpoint(out, step, final, tmp, policy, optimizer, world, lagged)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(out)
        raise SystemExit(f"{final}: could not be written ({type(e).__name__}: {e}); "
                         + (f"{last.name} is intact: " if last else "")
                         + "free the space and continue with --resume") from None


def _write_checkpoint(out, step, final, tmp, policy, optimizer, world, lagged) -> Path:
    if world.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world)
    # every process has its own RNG streams (LoRA dropout); each saves its own
    rng_tensors, rng_meta = rng_state()
    save_file(rng_tensors, tmp / f"rng-{world.rank}.safetensors")
    common.write_json(tmp / f"rng-{world.rank}.json", rng_meta)
    barrier(world)
    if world.main:
        adapters.save_adapter(policy, tmp / "adapter")
        tensors, meta = weights.optimizer_to_tensors(optimizer)
        save_file(tensors, tmp / "optimizer.safetensors")
        if lagged is not None:
            save_file(lagged, tmp / "lagged.safetensors")
        common.write_json(tmp / "trainer.json", {"step": step, "processes": world.size,
                                          "optimizer": meta})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)        # the directory appears complete or not at all
    barrier(world)
    return final


def latest_checkpoint(out: Path) -> Path | None:
    done = sorted(p for p in out.glob("checkpoint-*") if (p / "trainer.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, policy, optimizer, world) -> tuple[int, dict | None]:
    """Restore a checkpoint into policy, optimizer and RNGs: (its step, the lagged snapshot)."""
    try:
        info = json.loads((path / "trainer.json").read_text())
        if not (isinstance(info, dict) and type(info.get("step")) is int and info["step"] >= 1):
            raise ValueError(f"trainer.json holds no step >= 1: {str(info)[:80]}")
        if info["processes"] != world.size:
            raise ValueError(f"it was written by {info['processes']} processes, this run has "
                             f"{world.size}; the RNG streams would differ")
        adapters.load_adapter(policy, path / "adapter")
        weights.optimizer_from_tensors(optimizer, load_file(path / "optimizer.safetensors"),
                                       info["optimizer"])
        set_rng_state(load_file(path / f"rng-{world.rank}.safetensors"),
                      json.loads((path / f"rng-{world.rank}.json").read_text()))
        lagged = load_file(path / "lagged.safetensors") \
            if (path / "lagged.safetensors").exists() else None
        return int(info["step"]), lagged
    except (OSError, KeyError, IndexError, TypeError, ValueError, RecursionError,
            SafetensorError) as e:      # a damaged file: any of these, never a traceback
        raise SystemExit(f"{path}: cannot resume from this checkpoint ({type(e).__name__}: "
                         f"{e})") from None


def rng_state() -> tuple[dict, dict]:
    py = random.getstate()
    np_state = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(),
               "numpy": torch.from_numpy(np_state[1].astype(np.int64))}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    meta = {"python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return tensors, meta


def set_rng_state(tensors: dict, meta: dict):
    v, state, gauss = meta["python"]
    random.setstate((v, tuple(state), gauss))
    name, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[f"cuda{i}"]
                                      for i in range(torch.cuda.device_count())
                                      if f"cuda{i}" in tensors])


# ---------------------------------------------------------------------------------------------
# Evaluation: greedy decoding on the held-out splits
# ---------------------------------------------------------------------------------------------

# GTA answers are matched as the paper matches them: strictly (an alias must stand alone) for the
# training reward, loosely (a substring) wherever a policy is evaluated. Shop and ToolBench have
# one scorer.
def make_env(args, split: str, evaluation: bool = False):
    """The `--env` environment of one split, scored for training or for evaluation."""
    if args.env in shop.WORLDS:
        return shop.ShopEnv(split, world=args.env)
    kw = {"match": "loose" if evaluation else "strict"} if args.env == "gta" else {}
    return envs.make(args.env, split=split, data_dir=args.data_dir, **kw)


def evaluate(policy, tok, env, pool, n: int, args, world, name: str = "held-out") -> dict:
    """Greedy rollouts on the first n episodes of `pool` (0: all): mean task score, mean turns,
    and every episode's score in pool order (for paired comparisons between runs). A progress
    line with an ETA when the Pacer says so (an evaluation of the built-in world takes a minute
    or more)."""
    n = len(pool) if not n else min(n, len(pool))
    mine = list(range(world.rank, n, world.size))
    policy.eval()
    scores, turns = [], 0
    t0, pacer = time.perf_counter(), common.Pacer(len(mine), sys.stdout)
    for i in range(0, len(mine), args.eval_batch):
        episodes = [env.episode(pool[j]) for j in mine[i:i + args.eval_batch]]
        for traj in rollout(policy, tok, episodes, args, greedy=True, stats=False):
            scores.append(traj.score)
            turns += len(traj.steps)
        if world.main and pacer.due(len(scores)):
            rate = (time.perf_counter() - t0) / len(scores)
            print(f"  evaluating: {len(scores)}/{len(mine)} {name} episodes, ETA "
                  f"{common.duration(rate * (len(mine) - len(scores)))}", flush=True)
    turns = all_sum(world, [turns])[0]
    order = gather_floats(world, [float(j) for j in mine], n)
    scores = [s for _, s in sorted(zip(order, gather_floats(world, scores, n)))]
    return {"success": sum(scores) / max(n, 1), "episodes": n, "turns": turns / max(n, 1),
            "scores": scores}


def eval_splits(args, train_env, train_pool) -> tuple[dict, list[int]]:
    """The two held-out splits {"val": (env, pool), "test": (env, pool)} and the training pool
    left. Checkpoints are selected on val and reported on test. Shop has its own validation
    split; the replay environments set aside the last --val-episodes scorable training episodes.
    """
    test = make_env(args, "test", evaluation=True)
    if args.env in shop.WORLDS:
        val = make_env(args, "val", evaluation=True)
        return {"val": (val, scorable(val)), "test": (test, scorable(test))}, train_pool
    k = min(args.val_episodes or max(1, len(train_pool) // 10), len(train_pool) // 2)
    val = make_env(args, "train", evaluation=True)
    return ({"val": (val, train_pool[len(train_pool) - k:]), "test": (test, scorable(test))},
            train_pool[:len(train_pool) - k])


def evaluate_all(step: int, policy, tok, held: dict, args, world) -> dict:
    sizes = {"val": args.val_episodes, "test": args.eval_episodes}
    return {"step": step, **{name: evaluate(policy, tok, env, pool, sizes[name], args, world,
                                            {"val": "validation"}.get(name, name))
                             for name, (env, pool) in held.items()}}


def base_eval_cache(policy, args, world) -> Path | None:
    """Where the base model's evaluation is kept for later runs: greedy decoding of a fixed pool
    is the same in every run of one policy and one set of evaluation settings (every reward and
    every seed of a comparison), so it is done once. Shop only: its held-out pools are procedural
    and fixed (a replay pool depends on the data directory). The key holds everything the greedy
    rollouts depend on, threads and batch included (they change float summation order), and the
    version of the world's scoring rules."""
    if args.env not in shop.WORLDS or world.size > 1:
        return None
    settings = {"val": args.val_episodes, "test": args.eval_episodes, "batch": args.eval_batch,
                "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens,
                "max_len": args.max_len, "dtype": args.dtype, "devices": args.devices,
                "threads": torch.get_num_threads(), "scoring": shop.SHOP_SCORING}
    return (common.cache_root() / "grpo-base-eval" /
            f"{args.env}-{onpolicy.policy_hash(policy.checkpoint_dir)}-"
            f"{onpolicy.settings_hash(settings)}.json")


def scorable(env) -> list[int]:
    """Indices of the episodes that can be scored (GTA skips some, METHOD.md §10; shop none)."""
    if isinstance(env, shop.ShopEnv):          # the built-in world: every episode is scorable
        return list(range(len(env)))
    return [i for i in range(len(env)) if env.episode(i).skip_reason is None]


# ---------------------------------------------------------------------------------------------
# Progress and the summary
# ---------------------------------------------------------------------------------------------

def progress_line(rec: dict, steps: int, elapsed: list[float], evals_left: float = 0.0) -> str:
    """The step's own time, and an ETA from the median of the last 10 steps (a rollout that
    rambles to --max-new-tokens makes single steps slow; the median does not jump with it)
    plus `evals_left`, the seconds the evaluations still to come will take. No ETA before 3
    steps: a median of one or two steps is one outlier away from hours."""
    left = float(np.median(elapsed[-10:])) * (steps - rec["step"]) + evals_left
    eta = common.duration(left) if len(elapsed) >= 3 or rec["step"] == steps else \
        "after 3 steps"
    auroc = rec.get("probe_auroc")
    return (f"step {rec['step']:>4}/{steps}  reward {rec['reward_mean']:.3f}"
            f"±{rec['reward_std']:.3f}"
            f"  success {rec['success']:.2f}  zero-std {rec['frac_zero_std']:.2f}"
            f"  kl {rec['kl']:.2e}" + (f"  probe-auroc {auroc:.2f}" if auroc is not None else "")
            + f"  {elapsed[-1]:.1f}s (rollout {rec['t_rollout']:.1f} reward "
            f"{rec['t_reward']:.2f} update {rec['t_update']:.1f})  ETA {eta}")


def nice_ticks(lo: float, hi: float, most: int = 6, integer: bool = False) -> list[float]:
    """Evenly spaced round values (1, 2 or 5 times a power of ten) covering [lo, hi], at most
    `most` of them, never a value twice (integer: whole numbers only, for steps)."""
    span = max(hi - lo, 1e-12)
    for base in (10 ** k for k in range(math.floor(math.log10(span / most)) - 1, 12)):
        for m in (1, 2, 5):
            step = m * base
            if integer and step < 1:
                continue
            first = math.ceil(lo / step - 1e-9) * step
            ticks = [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]
            if 2 <= len(ticks) <= most or (len(ticks) <= most and integer):
                return ticks
    return [lo, hi]


CURVES = (("curve_success", "held-out success (test, greedy)", "step"),
          ("curve_seconds", "held-out success against training time", "seconds of training"),
          ("curve_reward", "mean turn reward (training rollouts)", "step"))


def curves_svg(result: dict) -> str:
    """One panel per curve the rows hold (CURVES: held-out test success against the step and
    against the seconds of training, mean reward against the step), one line per reward; the
    legend below them, as many entries a row as its longest label leaves room for."""
    W, H, pad = 460, 300, 52
    # tab10, then ten darker ones drawn dashed: twenty rows, each a color of its own
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
              "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#843c39", "#637939", "#7b4173",
              "#8c6d31", "#000000", "#3182bd", "#31a354", "#e6550d", "#756bb1"]

    def stroke(c):      # past the ten first colors, dashed (longer each round of ten)
        dash = f' stroke-dasharray="{6 * (c // 10)},3"' if c >= 10 else ""
        return f'stroke="{colors[c % len(colors)]}"{dash}'
    rows = result["rows"]
    panels = [c for c in CURVES if all(c[0] in r for r in rows)]
    width = len(panels) * W
    # 12px sans-serif: about 7px a character at most; a label is never cut
    entry = 26 + 7 * max((len(r["reward"]) for r in rows), default=0) + 20
    per_row = max(1, min(4, (width - 16) // entry))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{H + 22 * (-(-len(rows) // per_row)) + 16}" font-family="sans-serif"'
             ' font-size="12"><rect width="100%" height="100%" fill="white"/>']
    for p, (key, title, xlabel) in enumerate(panels):
        series = [r[key] for r in rows]
        xs = [x for s in series for x, _ in s] or [0, 1]
        ys = [y for s in series for _, y in s if y is not None] or [0, 1]
        x0, x1 = min(xs), max(max(xs), min(xs) + 1)
        yt = nice_ticks(min(ys), max(max(ys), min(ys) + 1e-3))
        step = yt[1] - yt[0]            # one more tick below the lowest point, and above
        yt = [yt[0] - step] * (yt[0] > min(ys) + 1e-12) + yt + \
            [yt[-1] + step] * (yt[-1] < max(ys) - 1e-12)
        y0, y1 = yt[0], yt[-1]
        ox = p * W

        def X(x):
            return ox + pad + (x - x0) / (x1 - x0) * (W - 1.5 * pad)

        def Y(y):
            return H - pad + (y - y0) / (y1 - y0) * -(H - 1.6 * pad)
        parts.append(f'<text x="{ox + W / 2}" y="18" text-anchor="middle">{title}</text>')
        parts.append(f'<line x1="{X(x0)}" y1="{Y(y0)}" x2="{X(x1)}" y2="{Y(y0)}" '
                     'stroke="black"/>'
                     f'<line x1="{X(x0)}" y1="{Y(y0)}" x2="{X(x0)}" y2="{Y(y1)}" stroke="black"/>')
        for yv in yt:
            parts.append(f'<text x="{X(x0) - 4}" y="{Y(yv) + 4}" text-anchor="end">'
                         f'{round(yv, 12):g}</text>')
        for xv in nice_ticks(x0, x1, integer=True):
            parts.append(f'<text x="{X(xv)}" y="{Y(y0) + 16}" text-anchor="middle">{xv:g}</text>')
        parts.append(f'<text x="{ox + W / 2}" y="{H - 8}" text-anchor="middle">{xlabel}</text>')
        for c, s in enumerate(series):
            pts = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in s if y is not None)
            parts.append(f'<polyline points="{pts}" fill="none" {stroke(c)} '
                         'stroke-width="1.6"/>')
    for c, r in enumerate(rows):
        x, y = 16 + (c % per_row) * max(entry, (width - 16) // per_row), H + 22 * (c // per_row) + 8
        parts.append(f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" {stroke(c)}'
                     f' stroke-width="3"/><text x="{x + 26}" y="{y + 4}">{r["reward"]}</text>')
    return "\n".join(parts) + "\n</svg>\n"


def run_curves(out: Path, reward: str) -> str:
    """curves.svg of one run: its held-out test success at every evaluation and its mean
    reward at every step (compare.py draws every run of a comparison the same way)."""
    evals = common.read_jsonl(out / "eval.jsonl")
    steps = common.read_jsonl(out / "metrics.jsonl")
    clock = training_seconds(steps)
    return curves_svg({"rows": [{
        "reward": reward,
        "curve_success": [(e["step"], e["test"]["success"]) for e in evals],
        "curve_seconds": [(clock[e["step"]], e["test"]["success"]) for e in evals
                          if e["step"] in clock],
        "curve_reward": [(m["step"], m["reward_mean"]) for m in steps]}]})


STEP_SECONDS = ("t_rollout", "t_reward", "t_update", "t_refit")


def training_seconds(metrics: list[dict]) -> dict[int, float]:
    """step -> seconds of training up to the end of that step (rollouts, reward, update and any
    probe refit; evaluations and checkpoints not counted), from metrics.jsonl; 0 -> 0."""
    out, total = {0: 0.0}, 0.0
    for m in metrics:
        total += sum(m.get(k, 0.0) for k in STEP_SECONDS)
        out[m["step"]] = total
    return out


def summarize(out: Path, seconds: float, args, probe_report: dict | None = None) -> dict:
    """base / selected / final held-out success on test. `selected` is the checkpoint with the
    best validation success (ties: the earliest); `best_on_test` picks on the test split itself,
    the paper's protocol, which flatters every method alike."""
    evals = common.read_jsonl(out / "eval.jsonl")
    base = next((e for e in evals if e["step"] == 0), None)
    ckpts = [e for e in evals if e["step"] > 0]

    def on_test(e):
        return None if e is None else {"step": e["step"], "val": e["val"]["success"],
                                       **{k: v for k, v in e["test"].items() if k != "scores"}}
    selected = max(ckpts, key=lambda e: (e["val"]["success"], -e["step"])) if ckpts else None
    best = max(ckpts, key=lambda e: (e["test"]["success"], -e["step"])) if ckpts else None
    final = ckpts[-1] if ckpts else None
    # seconds: this process's (a resumed run: since it resumed)
    summary = {"out": str(out), "seconds": round(seconds, 1), "reward": args.reward,
               "alpha": args.alpha, "seed": args.seed, "steps": args.steps,
               "selection": "checkpoint with the best validation success, reported on test",
               "base": on_test(base), "selected": on_test(selected), "final": on_test(final),
               "best_on_test": on_test(best),
               "selected_adapter": str(out / f"checkpoint-{selected['step']:06d}" / "adapter")
               if selected else None}
    if probe_report is not None:
        h = probe_report["heldout"]
        summary["probe_auroc_heldout"] = {
            "corpus": probe_report["settings"]["corpus"], "turns": h["n"]["all"],
            "pair": h["pair"]["all"], "pair_clean_prefix": h["pair"]["clean_prefix"],
            "pair_contaminated_prefix": h["pair"]["contaminated_prefix"],
            "contaminated_corpus_pair": probe_report["contaminated_corpus_pair"]["all"],
            **({args.reward: h[args.reward]["all"]} if args.reward in h else {})}
    return summary


def summary_text(s: dict) -> str:
    lines = [f"done in {common.duration(s['seconds'])} (reward {s['reward']})."]
    if s["base"] and s["selected"]:
        lines.append(
            f"held-out success (greedy, {s['base']['episodes']} test episodes): before "
            f"{s['base']['success']:.3f} -> selected {s['selected']['success']:.3f} (step "
            f"{s['selected']['step']}, chosen on validation) -> final {s['final']['success']:.3f}"
            f" (step {s['final']['step']}); best on test {s['best_on_test']['success']:.3f} "
            f"(step {s['best_on_test']['step']}, the paper's protocol)")
    if s.get("probe_auroc_heldout"):
        p = s["probe_auroc_heldout"]
        lines.append(f"PAIR AUROC on {p['turns']} held-out own turns: {common.num(p['pair'])} "
                     f"({p['corpus']} corpus); contaminated-corpus PAIR: "
                     f"{common.num(p['contaminated_corpus_pair'])}")
    lines.append(f"run: {s['out']}  (metrics.jsonl per step, eval.jsonl per checkpoint, "
                 "summary.json, curves.svg)")
    if s["selected_adapter"]:
        lines.append(f"selected adapter (PEFT layout): {s['selected_adapter']}")
    return "\n".join(lines)


