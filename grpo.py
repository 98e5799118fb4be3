"""Multi-turn GRPO with LoRA and step-level rewards (METHOD.md §9): the training run.

    python grpo.py --reward pair                   # shop, built-in policy, its shipped probes
    python grpo.py --reward outcome --out runs/o   # the sparse baseline, same budget
    python grpo.py --env gta --model Qwen/Qwen2.5-7B-Instruct --devices cuda \
        --probes DIR/pair_mixed                    # the paper's setting, one GPU
    python grpo.py --devices cuda:0,cuda:1 ...     # the layers split over two GPUs
    python -m lab.train --reward igpo ...          # the lab's rewards, searches, torchrun

One step (`train_step`): --batch prompts, each a group of --group G rollouts (`play_group`),
a reward for every assistant turn (pair.turn_rewards: the --reward row of pair.REWARDS),
the group's advantages (the --advantage row of pair.ADVANTAGES), then `learn`: the row's
loss over micro-batches, log pi at the sampling temperature, one AdamW step on the LoRA
adapter (`update_policy`, pair.update). `train` is the loop around it: the base model's
evaluation, the steps (each recorded by `record_step`), a checkpoint and an evaluation
every --save-every steps, the summary. The rest is the run's plumbing: flags and presets,
the run directory, checkpoints that verify themselves, exact resume.

Where it departs from the paper's protocol (METHOD.md §9): the paper reports the best
checkpoint on its held-out set itself; here a validation split selects the checkpoint and
the test split reports it, the best-on-test number kept beside it, labelled as the paper's.

A run holds OUT/.lock while it runs; bad input, Ctrl-C and SIGTERM end it with one line that
names the file or says how to go on, its lock let go.

The lab's methods that need more (tree searches, refits, oversampling, several processes)
run their own loop, lab/train.py, built from this file's functions: setup's pieces
(check_before_loading, load_policy, environments, adapter_optimizer, log_start), a step's
(start_step, play_rollouts, score_group, update_policy, step_metrics) and the loop's
(set_lr, record_step, checkpoint_due, save_and_log, evaluate_and_log, finish).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import envs
import model
import pair
import probes


# --- 1. What a run reads: the policy, the environments, the reward's probes ------------

@dataclass
class Training:
    """What the training loop reads, built once by setup (lab/train.py's by its own
    setup): the policy with its adapter, the environments, the --reward and --advantage
    rows, the optimizer, the flags, the processes and the run directory."""
    policy: model.Transformer
    tok: model.Tokenizer
    env: envs.Env                   # the training environment ...
    pool: list[int]                 # ... and the indices of its episodes the prompts come from
    held: dict                      # the held-out splits, {"val": (env, pool), "test": ...}
    reward: pair.Reward             # --reward's row of the rewards table
    objective: pair.Objective       # --advantage's row: the advantages, their loss
    ctx: pair.RewardContext         # what the reward reads besides the rollout
    optimizer: torch.optim.Optimizer
    args: argparse.Namespace
    procs: pair.Processes
    out: Path                       # the run directory
    log: object                     # print on the main process, silent elsewhere
    probe_report: dict | None = None    # the shipped probes' AUROC on held-out own turns


def setup(args) -> Training:
    """Everything a run reads, each input checked before the run directory is written:
    the presets resolved, the policy loaded with a fresh adapter, the environments, the
    reward's probes, then the run directory claimed and the optimizer built."""
    procs = pair.Processes()        # this process alone
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("several processes run through the lab: torchrun --nproc_per_node N "
                         "-m lab.train ...")
    resolve_preset(args, procs)
    check_before_loading(args, procs)
    policy, tok = load_policy(args, procs)
    env, pool, held = environments(args, tok)
    reward = pair.REWARDS[args.reward]
    ctx = pair.RewardContext(policy, tok, env, alpha=args.alpha)
    # the reward's probes, read and checked against the policy before OUT is claimed
    report = None
    if reward.reads_probe:
        where, report = probes_to_read(args, procs.log)
        read_probes(ctx, args, policy, where)
    # OUT is claimed once every input has been read and checked: a refusal writes nothing
    out = prepare_out(args, procs)
    run = Training(policy, tok, env, pool, held, reward, pair.ADVANTAGES[args.advantage], ctx,
                   adapter_optimizer(policy, args), args, procs, out, procs.log, report)
    log_start(run)
    return run


def check_before_loading(args, procs: pair.Processes, keys=None, defaults=None) -> None:
    """What a run checks before it loads anything, so that a mistake costs no model load:
    --batch shared evenly by the processes, and what --out holds against --resume
    (check_out, read-only; `keys` and `defaults`: the lab's flags a resumed run keeps).
    Sets torch's CPU threads, and waits until every process has read OUT as it was,
    before any writes it."""
    if args.batch % procs.size:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {procs.size} processes")
    if args.threads:
        torch.set_num_threads(args.threads)
    # read-only first: a --resume mistake costs no model load
    check_out(args, keys or RESUME_KEYS, defaults or RESUME_DEFAULTS)
    # every process reads OUT as it was before any of them writes
    procs.barrier()


def adapter_optimizer(policy, args) -> torch.optim.AdamW:
    """AdamW over the parameters that train (the LoRA adapter's), at --lr with
    --weight-decay; the schedule sets the lr of each step (lr_at)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)


def log_start(run: Training) -> None:
    """The run's line before its first evaluation: the policy's and the adapter's sizes,
    the environment's splits, the reward, the steps and where the run is written."""
    args, policy = run.args, run.policy
    n_lora = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    n_base = sum(p.numel() for p in policy.parameters()) - n_lora
    run.log(f"policy {args.model}: {n_base:,} parameters, + {n_lora:,} in the LoRA adapter "
            f"(trained); env {args.env}: {len(run.pool)} training / {len(run.held['val'][1])} "
            f"validation / {len(run.held['test'][1])} test episodes; reward {args.reward}; "
            f"{args.steps} steps of {args.batch} x {args.group} rollouts on "
            f"{run.procs.size} process(es); run in {run.out}", flush=True)


def load_policy(args, procs: pair.Processes,
                worlds=envs.WORLDS) -> tuple[model.Transformer, model.Tokenizer]:
    """The seeded start of a run: RNGs seeded, the policy (its layers split when
    --devices names several), a fresh LoRA adapter (the first random draws;
    lab/onpolicy.py's rebuild of the probes starts here too)."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    devices = model.parse_devices(args.devices or procs.device)
    # a built-in world's policy is data/'s: where it was deleted, say how to build it again
    builtin = worlds[args.env].policy if args.env in worlds else envs.BUILTIN_POLICY
    if Path(args.model).resolve() == builtin.resolve() and not builtin.is_dir():
        sys.exit(f"--model: the built-in policy {builtin} is missing; build it with "
                 f"`python -m lab.shop sft --out {builtin}` (lab/README.md)")
    # the policy on the first device, its layers split over the others; then a fresh adapter
    # (B = 0: the run starts from the base model)
    policy, tok = model.load_model(args.model, dtype=model.DTYPES[args.dtype], device=devices[0])
    if len(devices) > 1:
        model.split_model(policy, devices)
    model.apply_lora(policy, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                     targets=tuple(args.lora_targets.split(",")))
    return policy, tok


def environments(args, tok, worlds=envs.WORLDS, replays=envs.REPLAYS):
    """The training environment, the pool of its episodes the prompts come from, and the
    held-out splits; refused when a split has no scorable episode or a task's prompt
    leaves no room for a turn (a turn that might not fit ends a rollout: a run would
    learn nothing)."""
    env = envs.make_env(args, "train", False, worlds, replays)
    held, pool = envs.eval_splits(args, env, envs.scorable(env), worlds, replays)
    if not pool or not all(p for _, p in held.values()):
        raise SystemExit(f"--env {args.env}: no scorable episode in a split")
    # the first task's prompt, rendered as the policy reads it: its length in tokens
    prompt = len(tok.render(env.episode(pool[0]).messages, add_generation_prompt=True)[0])
    if prompt + args.max_new_tokens > args.max_len:
        raise SystemExit(f"--max-len {args.max_len}: a task's prompt alone is {prompt} tokens "
                         f"and a turn needs --max-new-tokens {args.max_new_tokens} more")
    return env, pool, held


def probes_to_read(args, log, worlds=envs.WORLDS) -> tuple[Path, dict | None]:
    """Where the --reward's probes are, and their report when they are the shipped ones:
    --probes (a PAIR directory, a probe file or a directory of them), or the probes
    shipped beside a built-in world's policy."""
    if args.probes:
        return Path(args.probes), None
    # the probes shipped with a built-in world's policy, and the report of their fit
    shipped = Path(args.model) / "probes"
    if is_builtin(args, worlds) and shipped.is_dir():
        return shipped, pair.read_report(shipped, args.reward, log)
    raise SystemExit(f"--reward {args.reward} on {args.env} with --model {args.model} needs "
                     "--probes DIR (`python -m lab.study` fits them; `python -m lab.train` "
                     "on the fly for another policy of a built-in world)")


def read_probes(ctx: pair.RewardContext, args, policy, where: Path) -> None:
    """The probe the reward reads, loaded into ctx and checked against the policy: its
    widths, and (given --probes) the model it was fitted for."""
    # probes given on the command line are checked against the model they were fitted for
    model_dir = policy.checkpoint_dir if args.probes else None
    head = pair.load_head(where, args.reward, policy.config, model_dir)
    if isinstance(head, pair.Pair):
        ctx.pair = head
    else:
        ctx.probe = head
        ctx.feature = args.reward


# --- 2. One step: play each prompt's group, reward and advantage it, update ------------

def prompt_index(seed: int, g: int, n: int) -> int:
    """The training episode of the g-th prompt of the run (n: the pool's size): each pass
    over the pool is a fresh permutation of it."""
    epoch, k = divmod(g, n)
    return int(np.random.default_rng([seed, epoch]).permutation(n)[k])


def sampler(policy, seed: int, g: int) -> torch.Generator:
    """One generator per prompt, seeded by its number in the run: the rollouts depend
    neither on the sharding over processes nor on where a run was resumed."""
    # the seeds of two runs stay apart for their first million prompts
    return torch.Generator(device=policy.lm_head.weight.device).manual_seed(seed * 1_000_003 + g)


TIMING = ("t_rollout", "t_reward", "t_update")      # seconds a step spends in each phase
# A step's work, summed over processes: tokens and turns sampled, and what a reward or a
# search adds (sibling rollouts of a tree, sequences and tokens teacher-forced, calls to
# an external judge), which it counts in RewardContext.cost; the metrics report each.
COSTS = ("gen_tokens", "gen_turns", "branch_rollouts", "branch_tokens", "tf_rows", "tf_tokens",
         "external_calls")


@dataclass
class Group:
    """One prompt's G rollouts, their rewards and advantages (rollout i's turn t at [i][t])."""
    trajs: list[probes.Trajectory]
    rewards: list[list[float | None]]
    p_correct: list                 # per rollout, the frozen probe's P(correct) per turn, or None
    advantages: list[list[float]]
    all_equal: bool                 # no turn got an advantage: nothing to learn from
    kv_bytes: int = 0               # the KV cache its rollouts held


def play_group(g: int, run: Training, t: dict) -> Group:
    """The g-th prompt of the run: its G rollouts, then their rewards and advantages.
    Adds the seconds spent to t (TIMING)."""
    t0 = time.perf_counter()
    trajs, kv_bytes = play_rollouts(g, run, stats=run.reward.needs_stats)
    t["t_rollout"] += time.perf_counter() - t0
    return score_group(trajs, run, t, kv_bytes)


def play_rollouts(g: int, run: Training, stats: bool) -> tuple[list[probes.Trajectory], int]:
    """The G rollouts of the g-th prompt (the group GRPO compares), and the bytes of KV
    cache they held; `stats`: the generation keeps each turn's statistics for the reward."""
    args, policy = run.args, run.policy
    index = run.pool[prompt_index(args.seed, g, len(run.pool))]
    # G copies of one episode, played together on one cache
    episodes = [run.env.episode(index) for _ in range(args.group)]
    caches = []
    trajs = probes.rollout(policy, run.tok, episodes, args,
                           generator=sampler(policy, args.seed, g), caches=caches, stats=stats)
    kv_bytes = sum(c.k.nbytes + c.v.nbytes for cache in caches for c in cache)
    return trajs, kv_bytes


def score_group(trajs: list[probes.Trajectory], run: Training, t: dict,
                kv_bytes: int = 0) -> Group:
    """A group's rewards (one per turn) and advantages, and the tokens and turns it
    generated counted in run.ctx.cost (COSTS). Adds the seconds spent to t["t_reward"]."""
    t0 = time.perf_counter()
    # each rollout's rewards (one a turn), and the frozen probe's P(correct) where it has one
    rewards, p_correct = [], []
    for traj in trajs:
        given = pair.turn_rewards(traj, run.reward, run.ctx, run.args.outcome_weight)
        rewards.append(given.rewards)
        p_correct.append(given.p_correct)
    t["t_reward"] += time.perf_counter() - t0
    advantages, all_equal = run.objective.advantages(rewards, [traj.score for traj in trajs])
    # the group's cost: every turn it generated, and their tokens
    played = [st for traj in trajs for st in traj.steps]
    run.ctx.cost.update(gen_turns=len(played), gen_tokens=sum(len(st.tokens) for st in played))
    return Group(list(trajs), rewards, p_correct, advantages, all_equal, kv_bytes)


def train_step(step: int, run: Training) -> dict:
    """One GRPO step: this process's share of the step's prompts played, then the update
    (all-reduced over the processes), and the step's metrics."""
    args, procs = run.args, run.procs
    t = start_step(run, TIMING)
    # this process's share of the step's prompts: every procs.size-th, from its rank on
    groups = [play_group(step * args.batch + j, run, t)
              for j in range(procs.rank, args.batch, procs.size)]
    stats = learn(groups, run, t)
    return step_metrics(step, groups, groups, stats, t, run)


def start_step(run: Training, timing: tuple[str, ...]) -> dict[str, float]:
    """A step's counters set to zero: the seconds of each phase of `timing` (returned), the
    costs (run.ctx.cost) and the GPU's peak memory; the policy set to sample (eval mode)."""
    run.ctx.cost = Counter(dict.fromkeys(COSTS, 0))
    # the step's peak memory from here
    if model.input_device(run.policy).type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.input_device(run.policy))
    run.policy.eval()
    return dict.fromkeys(timing, 0.0)


def learn(groups: list[Group], run: Training, t: dict) -> dict:
    """The update on the groups' rollouts, each turn's tokens carrying its advantage;
    adds its seconds to t["t_update"]. Returns the update's statistics (pair.update)."""
    t0 = time.perf_counter()
    # the groups' rollouts in one batch: each turn's tokens carry its advantage
    trajs = [traj for group in groups for traj in group.trajs]
    advantages = [a for group in groups for a in group.advantages]
    batch = pair.make_batch(trajs, advantages, run.tok.pad_id)
    stats = update_policy(run, batch)
    t["t_update"] = time.perf_counter() - t0
    return stats


# --- 3. The update with the run's flags, and its learning rate -------------------------

def lr_at(step: int, args) -> float:
    """Constant lr after a linear warmup over the first `--warmup` fraction of the steps:
    lr_s = lr x min(1, (s + 1) / max(1, round(warmup x steps)))."""
    warm = max(1, round(args.warmup * args.steps))
    return args.lr * min(1.0, (step + 1) / warm)


def set_lr(run: Training, step: int) -> None:
    """Every parameter group of the optimizer at step's learning rate (lr_at)."""
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(step, run.args)


def update_policy(run: Training, batch: pair.Batch) -> dict:
    """The policy's adapter updated on a batch, in train mode: pair.update with the run's
    --advantage row (its loss), --ppo-epochs passes in micro-batches of at most
    --micro-batch rows and --micro-batch-tokens padded tokens, log pi at the sampling
    --temperature (or the row's own), PPO-clip --eps, KL --beta, the gradient clipped to
    --grad-clip. Returns pair.update's statistics."""
    # train mode for the update (LoRA dropout), eval mode again for the next rollouts
    args = run.args
    run.policy.train()
    stats = pair.update(run.policy, run.optimizer, batch, run.objective, run.procs,
                        temperature=args.temperature, eps=args.eps, beta=args.beta,
                        grad_clip=args.grad_clip, epochs=args.ppo_epochs,
                        rows=args.micro_batch, token_budget=args.micro_batch_tokens)
    run.policy.eval()
    return stats


# --- 4. A step's metrics: one metrics.jsonl record, summed over the processes ----------

def step_metrics(step: int, kept: list[Group], played: list[Group], stats: dict, t: dict,
                 run: Training) -> dict:
    """The record of one step: the update's statistics, the rewards and successes of the
    groups kept (the update's), the groups played (every group the step played, kept or
    not), the seconds of each phase t, the step's costs and memory, and the drift monitor.
    Sums go over the processes in one all-reduce; memory is the largest over them."""
    args, procs = run.args, run.procs
    trajs = [traj for group in kept for traj in group.trajs]
    rewards = [row for group in kept for row in group.rewards]
    costs = [run.ctx.cost[k] for k in COSTS]
    # this process's sums, each a list: the rewards', the rollouts', the phases' and costs'
    parts = reward_sums(rewards, args.max_turns)
    parts.update({
        "rollouts": [len(trajs)], "score": [sum(traj.score for traj in trajs)],
        "turns": [sum(len(traj.steps) for traj in trajs)],
        "truncated": [sum(traj.truncated for traj in trajs)],
        "all_equal": [sum(group.all_equal for group in played)], "groups": [len(played)],
        "times": list(t.values()), "costs": costs})
    # one all-reduce of every part, concatenated, then cut back into the parts
    summed = iter(procs.all_sum([v for values in parts.values() for v in values]))
    s = {name: [next(summed) for _ in values] for name, values in parts.items()}
    # the step's means over every process's turns and rollouts
    n = s["n"][0]
    n_traj = s["rollouts"][0]
    mean = s["sum"][0] / max(n, 1)
    variance = max(s["sum_sq"][0] / max(n, 1) - mean * mean, 0.0)
    rec = {"step": step + 1, "lr": lr_at(step, args), "reward_mean": mean,
           "reward_std": math.sqrt(variance), "success": s["score"][0] / max(n_traj, 1),
           "frac_zero_std": s["all_equal"][0] / max(s["groups"][0], 1),
           "groups_played": int(s["groups"][0]), **stats,
           "turns": s["turns"][0] / max(n_traj, 1), "truncated": int(s["truncated"][0]),
           "turn_rewards": turn_means(s)}
    # the drift monitor, where a frozen probe scores each turn and the world labels it
    if run.reward.reads_probe and isinstance(run.env, envs.ShopEnv):
        rec["probe_auroc"] = probe_monitor(trajs, [p for g in kept for p in g.p_correct], run)
    # each phase's seconds as the mean over the processes; the costs as their sums
    rec.update({name: seconds / procs.size for name, seconds in zip(t, s["times"])})
    rec.update({name: int(c) for name, c in zip(COSTS, s["costs"])})
    # memory: the largest KV cache a group held, and the GPU's peak since the step began
    memory = {"mem_kv_mb": max((group.kv_bytes for group in played), default=0) / 2**20}
    device = model.input_device(run.policy)
    if device.type == "cuda":
        memory["mem_cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    rec.update({name: round(procs.all_max(v), 3) for name, v in memory.items()})
    return rec


def reward_sums(rewards: list[list[float | None]], max_turns: int) -> dict[str, list[float]]:
    """The sums a step's reward statistics are made of, over every turn that got a
    reward: their count, sum and sum of squares, and per turn index t < max_turns, the
    sum and count of turn t's rewards and the rollouts that reached turn t."""
    flat = [r for row in rewards for r in row if r is not None]
    # per turn index: the rewards' sum and count, and the rollouts that reached it
    turn_sum = [0.0] * max_turns
    turn_n = [0] * max_turns
    reached = [0] * max_turns
    for row in rewards:
        for k, r in enumerate(row):
            reached[k] += 1
            if r is not None:
                turn_sum[k] += r
                turn_n[k] += 1
    return {"n": [len(flat)], "sum": [sum(flat)], "sum_sq": [sum(r * r for r in flat)],
            "turn_sum": turn_sum, "turn_n": turn_n, "reached": reached}


def turn_means(s: dict[str, list[float]]) -> list[float | None]:
    """The mean reward of turn t over the rollouts that reached it, for every turn index
    some rollout reached (None: no reward at that turn)."""
    return [s["turn_sum"][k] / s["turn_n"][k] if s["turn_n"][k] else None
            for k in range(len(s["reached"])) if s["reached"][k]]


def probe_monitor(trajs: list[probes.Trajectory], p_correct: list, run: Training) -> float | None:
    """The drift monitor: AUROC of the frozen probe's P(correct) of the step's turns
    against their exact labels, over every process's turns (None where one class is
    missing)."""
    pairs = [(p, float(label)) for traj, ps in zip(trajs, p_correct) if ps is not None
             for p, label in zip(ps, traj.episode.labels() or [])]
    # every process's pairs, each at most the step's turns
    args, procs = run.args, run.procs
    size = args.batch * args.group * args.max_turns
    p = procs.gather([x for x, _ in pairs], size)
    y = procs.gather([y for _, y in pairs], size)
    if 0 < sum(y) < len(y):
        return probes.auroc(y, p)
    return None


# --- 5. The loop: evaluation, the steps, checkpoints; resume ---------------------------

def train(args) -> dict:
    """Setup, the base model's evaluation, --steps GRPO steps with a checkpoint and an
    evaluation every --save-every steps and at the end, the summary. Returns the summary."""
    started = time.perf_counter()
    run = setup(args)
    start = resume(run)
    # the steps eval.jsonl holds are not evaluated again; then the base model (step 0), or
    # the checkpoint resumed from where a kill came before its evaluation
    done = {e["step"] for e in read_jsonl(run.out / "eval.jsonl")}
    evaluate_and_log(run, start, done)
    progress = Progress()
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        set_lr(run, step)
        rec = train_step(step, run)
        record_step(run, rec, progress, t0)
        # every --save-every steps and at the last: a checkpoint, then its evaluation
        if checkpoint_due(step + 1, args):
            save_and_log(run, step + 1)
            evaluate_and_log(run, step + 1, done)
    return finish(run, time.perf_counter() - started)


@dataclass
class Progress:
    """What the loop's lines read of the steps so far."""
    seconds: list[float] = field(default_factory=list)    # each step's wall-clock time
    aurocs: list = field(default_factory=list)   # each step's probe AUROC (or None)
    warned: bool = False                         # the drift alarm has been raised


def record_step(run: Training, rec: dict, progress: Progress, t0: float) -> None:
    """A step's record appended to metrics.jsonl, its line (log_step) with the seconds
    since t0, and the drift monitor's alarm the first time the probe falls below chance."""
    if run.procs.main:
        append_jsonl(run.out / "metrics.jsonl", rec)
    progress.seconds.append(time.perf_counter() - t0)
    progress.aurocs.append(rec.get("probe_auroc"))
    log_step(run, rec, progress.seconds)
    mean = below_chance(progress.aurocs)
    if not progress.warned and mean is not None:
        progress.warned = True
        run.log(f"warning: the probe ranks this run's own turns below chance (mean AUROC "
                f"{mean:.2f} over the last {CHANCE_WINDOW} steps): its reward now favours "
                "wrong turns", flush=True)


def log_step(run: Training, rec: dict, seconds: list[float]) -> None:
    """The step's line, and a warning when the update was skipped; `seconds`: each step's
    wall-clock time so far, this one's last."""
    args, log = run.args, run.log
    # the time left from the median of the last steps: one rambling rollout is slow
    left = float(np.median(seconds[-10:])) * (args.steps - rec["step"])
    auroc = rec.get("probe_auroc")
    line = (f"step {rec['step']:>4}/{args.steps}  reward {rec['reward_mean']:.3f}"
            f"±{rec['reward_std']:.3f}  success {rec['success']:.2f}  zero-std "
            f"{rec['frac_zero_std']:.2f}  kl {rec['kl']:.2e}")
    if auroc is not None:
        line += f"  probe-auroc {auroc:.2f}"
    line += (f"  {seconds[-1]:.1f}s (rollout {rec['t_rollout']:.1f} reward "
             f"{rec['t_reward']:.2f} update {rec['t_update']:.1f})  steps left "
             f"{probes.duration(left)}")
    log(line, flush=True)
    if rec.get("skipped_updates"):
        log(f"warning: step {rec['step']}: the gradient was not finite; the adapter was not "
            "updated (skipped_updates in metrics.jsonl)", flush=True)


CHANCE_WINDOW = 5       # steps the drift monitor's alarm averages over


def below_chance(aurocs: list) -> float | None:
    """The drift monitor's alarm: the mean probe AUROC of the last CHANCE_WINDOW steps
    when below chance (the frozen probe's reward now favours wrong turns), else None."""
    # each of the last CHANCE_WINDOW steps must have an AUROC (a step may miss a class)
    recent = [a for a in aurocs[-CHANCE_WINDOW:] if a is not None]
    mean = sum(recent) / CHANCE_WINDOW
    if len(recent) == CHANCE_WINDOW and mean < 0.5:
        return mean
    return None


def checkpoint_due(step: int, args) -> bool:
    """Whether `step` steps done end with a checkpoint: every --save-every, and the last."""
    return step % args.save_every == 0 or step == args.steps


def save_and_log(run: Training, step: int, extra: dict[str, dict] | None = None) -> Path:
    """save_checkpoint of the run after `step` steps (`extra`: a lab method's own tensors
    files), and its line. Returns the checkpoint's directory."""
    path = save_checkpoint(run.out, step, run.policy, run.optimizer, run.procs, extra)
    run.log(f"checkpoint {path}", flush=True)
    return path


def resume(run: Training) -> int:
    """The step to start from: 0, or (--resume) the newest checkpoint's, restored; what
    was logged after it is dropped, to be redone exactly."""
    args, out = run.args, run.out
    start = 0
    ckpt = intact_checkpoint(out, run.log) if args.resume else None
    if ckpt is not None:
        start = load_checkpoint(ckpt, run.policy, run.optimizer, run.procs)
        run.log(f"resumed from {ckpt} at step {start}", flush=True)
    elif args.resume:
        # killed before its first checkpoint: nothing it did can be restored
        run.log(f"--resume: {out} holds no checkpoint (the first is saved after step "
                f"{min(args.save_every, args.steps)}): the run starts over from step 1",
                flush=True)
    # the logs cut back to the step resumed from (on the main process, which writes them)
    if run.procs.main and args.resume:
        for path in (out / "metrics.jsonl", out / "eval.jsonl"):
            if path.exists():
                kept = [r for r in read_jsonl(path) if r["step"] <= start]
                model.write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    run.procs.barrier()
    return start


def evaluate_and_log(run: Training, step: int, done: set, ev: dict | None = None) -> dict | None:
    """Evaluate the policy at `step` on the held-out splits into eval.jsonl, unless done
    or --no-eval; `ev`: an evaluation already made (the lab's cache of the base model's).
    Returns the evaluation made, or None."""
    if run.args.no_eval or step in done:
        return None
    # greedy rollouts of the held-out episodes, shared over the processes
    if ev is None:
        ev = probes.evaluate_all(step, run.policy, run.tok, run.held, run.args, run.procs)
    if run.procs.main:
        append_jsonl(run.out / "eval.jsonl", ev)
    done.add(step)
    # the line: held-out success on test, then on validation, which selects the checkpoint
    what = "base model" if step == 0 else f"step {step}"
    run.log(f"{what}: held-out success {ev['test']['success']:.3f} on {ev['test']['episodes']} "
            f"test episodes, {ev['val']['success']:.3f} on {ev['val']['episodes']} validation "
            f"({ev['test'].get('decoding', 'greedy')})", flush=True)
    return ev


def finish(run: Training, seconds: float, extra: dict | None = None) -> dict:
    """summary.json (extra: what the lab adds to it) and its lines; the run directory let
    go. Returns the summary."""
    summary = summarize(run.out, seconds, run.args, run.probe_report)
    summary.update(extra or {})
    # the main process writes the summary and lets OUT go; every process leaves the group
    if run.procs.main:
        write_json(run.out / "summary.json", summary)
        run.log(summary_text(summary), flush=True)
        unlock(run.out)
    run.procs.close()
    return summary


# --- 6. The flags and presets ----------------------------------------------------------

PROG = "python grpo.py"     # how messages spell the command line that runs this file


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every default in --help but "(default: None)": that flag's help says what decides."""
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, saying what is wrong in one line (no usage block above it: --help has it),
    taking no flag by a prefix of its name (`--step 1` is not --steps), and pointing to the
    lab where the error names a value or a flag that only `python -m lab.train` takes."""
    def error(self, message):
        """Exit 2 with the one line (and the lab's name where it fits), as argparse's does."""
        lab = lab_only(message) if self.prog == PROG else None
        if lab is not None:
            message += (f"; {lab} is the lab's (its rewards, worlds, advantage forms and "
                        "flags run through `python -m lab.train`, lab/README.md)")
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


# What `python -m lab.train` takes beyond grpo.py, so that an error naming one of them
# says where it runs: their names only, as the core runs without the lab (tests/test_grpo.py
# checks them against the lab's parser)
LAB_ONLY = {
    "--env": {"shop-long", "shop-copy", "shop-stale", "toolbench"},
    "--reward": {"coe", "llm_judge", "igpo", "tips", "tree_grpo", "at2po", "labels", "confidence"},
    "--advantage": {"position", "outcome-turn"},
    "flags": {"--judge-model", "--tips-gamma", "--tips-refresh", "--tree-m", "--tree-n",
              "--tree-l", "--at2po-clip", "--at2po-penalty", "--turn-weight", "--oversample",
              "--eval-samples", "--probe-episodes", "--probe-corpus", "--corpus-episodes",
              "--corpus-samples", "--corpus-heldout", "--probe-reads", "--probe-retrain-every"}}


def lab_only(message: str) -> str | None:
    """What of LAB_ONLY an argparse error names ("--reward igpo", "--probe-reads"), or None:
    the value of an invalid choice, or a flag among the unrecognized arguments."""
    # an invalid choice names its flag and the value
    choice = re.match(r"argument (--[\w-]+): invalid choice: '(.*?)'", message)
    if choice and choice[2] in LAB_ONLY.get(choice[1], ()):
        return f"{choice[1]} {choice[2]}"
    # unrecognized arguments: the words argparse did not take, values among them
    if message.startswith("unrecognized arguments: "):
        flags = [word.split("=")[0] for word in message.split(": ", 1)[1].split()]
        return next((flag for flag in flags if flag in LAB_ONLY["flags"]), None)
    return None


def at_least(low):
    """A range of FLAG_RANGES, (test, what it asks for): a number >= low."""
    return (lambda v: v >= low), f"at least {low}"


def finite(low=-math.inf):
    """A range of FLAG_RANGES: a finite number, >= low when low is given."""
    return (lambda v: low <= v < math.inf), \
        "a finite number" + (f" >= {low}" if low > -math.inf else "")


# more threads than cores only slow a run down (and a huge count crashes)
CORES = os.cpu_count() or 1
THREADS = (lambda v: 1 <= v <= CORES), f"between 1 and this machine's {CORES} cores"
# every numeric flag's range, (test, what it asks for), checked before anything is loaded
FLAG_RANGES = {
    **dict.fromkeys(("steps", "batch", "group", "max_turns", "max_new_tokens", "max_len",
                     "ppo_epochs", "micro_batch", "lora_r", "micro_batch_tokens", "save_every",
                     "eval_batch"), at_least(1)),
    **dict.fromkeys(("eval_episodes", "val_episodes"), at_least(0)),
    **dict.fromkeys(("lr", "eps", "grad_clip", "lora_alpha"),
                    ((lambda v: 0 < v < math.inf), "a positive number")),
    **dict.fromkeys(("beta", "weight_decay", "alpha"), finite(0.0)),
    "threads": THREADS, "seed": ((lambda v: 0 <= v < 2 ** 32), "in [0, 2**32) (numpy's seeds)"),
    "temperature": finite(probes.MIN_TEMPERATURE), "outcome_weight": finite(),
    "top_p": ((lambda v: 0 < v <= 1), "in (0, 1]"),
    "warmup": ((lambda v: 0 <= v <= 1), "in [0, 1]"),
    "lora_dropout": ((lambda v: 0 <= v < 1), "in [0, 1)")}


def check_ranges(ap: argparse.ArgumentParser, args, ranges: dict) -> None:
    """ap.error for the first flag of `ranges` (name -> (test, what)) whose value, or one
    of its values, fails its test; None is not checked, nan fails every test."""
    for name, (ok, what) in ranges.items():
        value = getattr(args, name)
        # a flag of several values (the lab's --at2po-clip) has each one checked
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not ok(v):
                ap.error(f"--{name.replace('_', '-')} must be {what}, got {v}")


# The paper's Table grpo_config, with the release's temperature, top-p, LoRA alpha and
# dropout (the paper states no T or top-p)
PAPER_HPARAMS = dict(batch=1, group=4, max_turns=10, max_new_tokens=1024, temperature=1.0,
                     top_p=1.0, lr=3e-7, warmup=0.05, beta=0.01, eps=0.2, steps=500,
                     save_every=50, lora_r=16, lora_alpha=32.0, lora_dropout=0.05, eval_batch=16)
# The built-in policy (~0.3M parameters): T = 0.7, near its greedy evaluation; four prompts
# a step, rarely all uninformative; lr 3e-4 (1e-3 erodes held-out success in 10 steps); no
# LoRA dropout (noise at this size); one thread (two ran 1.8x-40x slower beside a busy
# process).
TINY = dict(batch=4, group=8, max_new_tokens=96, temperature=0.7, lr=3e-4, lora_dropout=0.0,
            steps=20, save_every=10, eval_batch=128, threads=1)
DEFAULTS = dict(weight_decay=0.0, advantage="process")     # flags a --preset sets, not the paper
# --preset release: the authors' release as it ran (but for its update's cap at the last
# 2,560 tokens of each turn's context, METHOD.md §9)
PRESETS = {"release": dict(weight_decay=0.01, warmup=0.0, top_p=0.95, advantage="release")}


def is_builtin(args, worlds=envs.WORLDS) -> bool:
    """Whether --model is a built-in world's own policy (which takes the TINY preset)."""
    return args.env in worlds and Path(args.model).resolve() == worlds[args.env].policy.resolve()


def resolve_preset(args, procs, worlds=envs.WORLDS) -> set[str]:
    """Fill the flags left unset: the tiny preset for the built-in policy, else the
    paper's; a built-in world's own turn limit; then --preset's. Returns the preset's
    flags that were set on the command line."""
    builtin = is_builtin(args, worlds)
    # the values a flag left unset takes, the later rules over the earlier
    preset = dict(PAPER_HPARAMS)
    if builtin:
        preset.update(TINY)
    if args.env in worlds:              # a world's episodes may be longer than the paper's 10
        preset["max_turns"] = worlds[args.env].max_turns
    preset.update(DEFAULTS, **PRESETS.get(args.preset, {}))
    # the flags given on the command line (or recorded by the run resumed) keep their values
    given = {k for k in preset if getattr(args, k) is not None}
    for k, v in preset.items():
        if k not in given:
            setattr(args, k, v)
    # the update's micro-batch: one prompt's rollouts, unless given
    if args.micro_batch is None:
        args.micro_batch = args.group
    # the preset's line: each of its flags, and where one was given (or recorded by the run
    # resumed) with another value, a note saying so
    shown = [*(TINY if builtin else ()), *PRESETS.get(args.preset, ())]
    if procs.main and shown:
        words = []
        for k in shown:
            word = f"--{k.replace('_', '-')} {getattr(args, k)}"
            if getattr(args, k) != preset[k]:
                word += " (not the preset's)"
            words.append(word)
        print("preset: " + ", ".join(words), flush=True)
    return given


def preset_flags(group, flags: dict) -> None:
    """The flags the presets set (`flags`: name -> help), added to `group` with no default
    (resolve_preset fills them); their help gives TINY's default and the paper's."""
    for key, what in flags.items():
        tiny, paper = TINY.get(key, PAPER_HPARAMS[key]), PAPER_HPARAMS[key]
        default = f"{tiny} with the built-in policy, {paper} otherwise" if tiny != paper else paper
        group.add_argument(f"--{key.replace('_', '-')}", type=type(paper), default=None,
                           help=f"{what} (default: {default})")


def train_parser(rewards=pair.REWARDS, forms=pair.ADVANTAGES, worlds=envs.WORLDS,
                 replays=envs.REPLAYS, prog=PROG) -> argparse.ArgumentParser:
    """grpo.py's flags; the names --reward, --advantage and --env take come from the
    tables (the lab passes its own, which add rows)."""
    ap = Parser(prog=prog, formatter_class=HelpFormatter, allow_abbrev=False,
                description="Multi-turn GRPO with LoRA and step-level rewards (METHOD.md §9); "
                            "with no flag: shop, the built-in policy and its probes.",
                epilog="Defaults: the paper's Table grpo_config, but --temperature, --top-p, "
                       "--lora-alpha and --lora-dropout, the release's (the paper states no T or "
                       "top-p). Several processes: `torchrun --nproc_per_node N -m lab.train "
                       "...`.")
    # what is trained, on which world, with which reward and advantage
    a = ap.add_argument
    a("--env", default="shop", choices=(*worlds, *replays),
      help="a built-in world or a released dataset replayed (envs.py)")
    a("--data-dir", help="gta / toolbench: the released files' root (default: $PAIR_DATA, "
      "else ~/.cache/pair/data)")
    a("--model", help="policy: a checkpoint directory or a Hugging Face model name (default: "
      "the built-in world's own, data/shop-policy)")
    a("--reward", default="pair", choices=tuple(rewards), help="per-turn reward source")
    a("--alpha", type=float, default=5.0, help="PAIR momentum scaling; 0 = vanilla PAIR")
    a("--outcome-weight", type=float, default=0.0, help="plus this x the task score on the "
      "last turn's reward")
    a("--advantage", choices=tuple(forms), help="advantage form and loss (default: "
      "process, DeepSeekMath's; release with --preset release)")
    a("--preset", choices=tuple(PRESETS), help="release = the authors' release as it ran: "
      "--weight-decay 0.01, --warmup 0, --top-p 0.95, --advantage release")
    a("--probes", help="a PAIR directory, a probe file or a directory of them (default on "
      "shop: shipped beside the built-in policy)")
    g = ap.add_argument_group("rollout")
    preset_flags(g, dict(steps="training steps", batch="prompts per step",
                         group="rollouts per prompt, G", max_turns="assistant turns per rollout "
                         "(a built-in world's own: envs.World.max_turns)",
                         max_new_tokens="generated tokens per turn",
                         temperature="sampling temperature", top_p="nucleus sampling mass"))
    g.add_argument("--max-len", type=int, default=8192,
                   help="KV cache capacity per rollout; a rollout that would outgrow it ends")
    g = ap.add_argument_group("optimization")
    preset_flags(g, dict(lr="AdamW learning rate", beta="KL coefficient", eps="PPO clip epsilon",
                         warmup="fraction of steps of linear warmup, then constant",
                         lora_r="LoRA rank", lora_alpha="LoRA alpha", lora_dropout="LoRA dropout"))
    a = g.add_argument
    a("--ppo-epochs", type=int, default=1, help="passes over each batch")
    a("--micro-batch", type=int, help="rollouts per forward in the update (default: --group)")
    a("--micro-batch-tokens", type=int, default=16384,
      help="most padded tokens per forward in the update (~0.2 GiB per 1,000 at 7B)")
    a("--grad-clip", type=float, default=1.0, help="gradient norm clip")
    a("--weight-decay", type=float, help="AdamW weight decay (default: 0; 0.01 with --preset "
      "release)")
    a("--lora-targets", default=",".join(model.LORA_TARGETS), help="projections with an adapter")
    g = ap.add_argument_group("run")
    preset_flags(g, dict(save_every="checkpoint (and evaluate) every N steps",
                         eval_batch="episodes decoded together in an evaluation"))
    a = g.add_argument
    a("--out", help="run directory (default: runs/<env>-<reward>-<date>-<time>)")
    a("--resume", action="store_true", help="continue the run in --out")
    a("--resume-if-present", action="store_true", help="--resume if --out holds a run")
    a("--eval-episodes", type=int, default=0, help="test episodes per evaluation (0: all)")
    a("--val-episodes", type=int, help="validation episodes per evaluation (shop: its split; "
      "replays: the training split's last 10%%)")
    a("--no-eval", action="store_true", help="skip the held-out evaluations")
    a("--seed", type=int, default=42, help="seed of everything")
    a("--dtype", default="float32", choices=("float32", "bfloat16"),
      help="model weights dtype (the adapter stays float32)")
    a("--devices", help="the process's device, e.g. cuda:0; several split the layers, e.g. "
      "cuda:0,cuda:1 (default: the process's GPU under torchrun, else the CPU)")
    a("--threads", type=int, help="torch CPU threads (default: 1 with the built-in policy, "
      "else torch's choice)")
    return ap


def parse_args(argv, ap: argparse.ArgumentParser | None = None, ranges=FLAG_RANGES,
               worlds=envs.WORLDS, keys=None, recorded: bool = True) -> argparse.Namespace:
    """grpo.py's command line (`ap`: the lab's parser, with its flags), checked, with
    --out defaulting to a new runs/ directory. Resuming a run, the flags left out take
    the values the run recorded in its args.json (`keys`: those a run must keep,
    RESUME_KEYS), unless not `recorded` (the command line alone, to be checked against
    the run's)."""
    if ap is None:
        ap = train_parser()
    args = ap.parse_args(argv)
    # the flags checked one by one, and against each other, before anything is read
    # --model: the world's own policy (a replayed world's: the built-in shop policy)
    if args.model is None:
        world = worlds.get(args.env)
        args.model = str(world.policy if world is not None else envs.BUILTIN_POLICY)
    check_ranges(ap, args, ranges)
    if args.resume and args.resume_if_present:
        ap.error("--resume and --resume-if-present: pass one")
    # --devices and --lora-targets are read here: a bad one fails before any model loads
    try:
        if args.devices is not None:
            model.parse_devices(args.devices)
    except ValueError as e:
        ap.error(str(e))
    bad = [t for t in args.lora_targets.split(",") if t not in model.LORA_TARGETS]
    if bad:
        ap.error(f"--lora-targets {args.lora_targets!r}: {bad} not among the blocks' linear "
                 f"layers {','.join(model.LORA_TARGETS)}")
    # a new run directory under runs/, named for the run and its start
    if args.out is None:
        if args.resume:
            ap.error("--resume: nothing to resume without --out (the run directory to continue)")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--out is required with several processes")
        name = f"{args.env}-{args.reward}-{time.strftime('%Y%m%d-%H%M%S')}"
        args.out = str(Path("runs") / name)
    # a resumed run: the flags left out take the values its args.json recorded
    saved = Path(args.out) / "args.json"
    if recorded and (args.resume or (args.resume_if_present and saved.exists())):
        given = given_flags(ap, argv)
        old = read_args_json(saved)
        for k in keys or RESUME_KEYS:
            if k not in given and k in old:
                setattr(args, k, old[k])
    return args


def given_flags(ap: argparse.ArgumentParser, argv) -> set[str]:
    """The flags (their dest names) given on the command line, told apart from defaults
    by parsing argv again with every default suppressed."""
    defaults = {action: action.default for action in ap._actions}
    for action in defaults:
        action.default = argparse.SUPPRESS
    try:
        given = ap.parse_known_args(argv)[0]
    finally:
        for action, default in defaults.items():
            action.default = default
    return set(vars(given))


def read_args_json(path: Path) -> dict:
    """A run's args.json, or one line saying why it cannot be read."""
    # a typo in --out must not start a new run
    if not path.exists():
        raise SystemExit(f"--resume: nothing to resume in {path.parent} (no args.json: no run "
                         "was started there); leave out --resume to start one")
    try:
        old = json.loads(path.read_text())
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as e:
        raise SystemExit(f"--resume: {path} is not readable ({type(e).__name__}: {e})") from None
    return old


# --- 7. Processes, the run directory, checkpoints and exact resume, the summary --------

# flags a resumed run must keep: all that trains or scores it (not --threads, --devices,
# --eval-batch: they change float summation order only); the lab's loop adds its own
RESUME_KEYS = ("env", "model", "reward", "alpha", "outcome_weight", "probes", "seed", "steps",
               "batch", "group", "max_turns", "max_new_tokens", "max_len", "temperature", "top_p",
               "lr", "warmup", "beta", "eps", "ppo_epochs", "micro_batch", "micro_batch_tokens",
               "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "save_every",
               "eval_episodes", "val_episodes", "advantage", "grad_clip", "weight_decay", "dtype")
RESUME_DEFAULTS = {"advantage": "process"}      # an args.json without the flag ran with this


def changed_flag(args, old: dict, keys=RESUME_KEYS,
                 defaults=RESUME_DEFAULTS) -> tuple[str, object, object] | None:
    """The first flag of `keys` that differs from a run's args.json (old): (--flag, its
    value now, the run's), or None. `defaults`: the value of a flag an older args.json lacks."""
    for k in keys:
        now = getattr(args, k)
        then = old.get(k, defaults.get(k, now))
        # --model may name the same directory another way
        if then != now and not (k == "model" and isinstance(then, str) and same_model(then, now)):
            return f"--{k.replace('_', '-')}", now, then
    return None


def same_model(then: str, now: str) -> bool:
    """Whether a run's recorded --model names the directory `now`: spelled another way
    (relative), or, for a policy shipped in this repository's data/, as another checkout
    wrote it (a world's default --model is absolute: the runs in results/ name the
    checkout that made them; the policy is rebuilt byte for byte by its README's
    commands)."""
    here = Path(now).resolve()
    if Path(then).is_dir() and Path(then).resolve() == here:
        return True
    # a shipped policy: the same data/<name> under another checkout
    return here.parent == envs.BUILTIN_POLICY.parent and Path(then).parts[-2:] == here.parts[-2:]


def check_out(args, keys=RESUME_KEYS, defaults=RESUME_DEFAULTS) -> None:
    """What --out holds against --resume(-if-present), read-only: checked before anything
    is loaded and again once OUT is claimed. A run exists once its args.json does; a
    resumed run keeps every flag of `keys` its args.json records."""
    out = Path(args.out)
    saved = out / "args.json"
    # --resume-if-present: resume exactly where a run exists
    if args.resume_if_present:
        args.resume = saved.exists()
    if not args.resume:
        # eval.jsonl alone: killed after the base evaluation
        if any((out / f).exists() for f in ("metrics.jsonl", "eval.jsonl")) or \
                latest_checkpoint(out):
            raise SystemExit(f"--out {out} already holds a run: pass --resume to continue it, "
                             "or choose another --out")
        # a folder of other files (its hidden ones aside, such as a lock) is not a run's
        if out.is_dir() and not saved.exists() and \
                any(not f.name.startswith(".") for f in out.iterdir()):
            raise SystemExit(f"--out {out} holds other files, not a run (no args.json): a "
                             "run is written to a new or empty folder; choose another --out")
        return
    # resuming: the run's flags kept, and a checkpoint to go on from where it logged steps
    changed = changed_flag(args, read_args_json(saved), keys, defaults)
    if changed is not None:
        flag, now, then = changed
        raise SystemExit(f"--resume: {flag} is {now!r} but the run in {out} used {then!r}")
    # logs past the first checkpoint's step, a summary or a damaged checkpoint, and no
    # whole checkpoint: starting over would replace the logs
    logged = max((r["step"] for r in read_jsonl(out / "metrics.jsonl")), default=0)
    first = min(args.save_every, args.steps)
    past = logged > first or any(out.glob("checkpoint-*")) or (out / "summary.json").exists()
    if latest_checkpoint(out) is None and past:
        raise SystemExit(f"--resume: {out} logged {logged} steps but holds no checkpoint "
                         f"whole (with trainer.json; the first is saved after step {first}): "
                         "restore them, or choose another --out")


def prepare_out(args, procs) -> Path:
    """The run directory: made, locked for this run, checked again under the lock, and
    its args.json written (every flag, resolved)."""
    out = Path(args.out)
    # the main process makes and locks OUT; the others wait for it
    if procs.main:
        out.mkdir(parents=True, exist_ok=True)
        lock(out)
        check_out(args)
        write_json(out / "args.json", vars(args))
    procs.barrier()
    return out


LOCKS = {}          # run directory -> the open lock file this process holds on it


def lock(out: Path) -> None:
    """One run per OUT: flock() on OUT/.lock, dropped by the kernel when the process dies
    (kill -9 included); the file names the holder."""
    import fcntl                    # POSIX only
    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise SystemExit(f"--out {out} is in use by pid {f.read().strip() or '?'}; wait for "
                         "it to finish, or write somewhere else") from None
    # the lock is ours: the file names this process
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    LOCKS[out.resolve()] = f        # held open until the run ends or the process exits


def unlock(out: Path) -> None:
    """A finished run lets its directory go: the lock file is removed, then released."""
    f = LOCKS.pop(out.resolve(), None)
    if f is not None:
        (out / ".lock").unlink(missing_ok=True)
        f.close()


def append_jsonl(path: Path, record: dict):
    """`record` as one more line of a JSON-lines log (metrics.jsonl, eval.jsonl)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """metrics.jsonl or eval.jsonl: a JSON object with an integer "step" a line. A last
    line cut short by a kill is dropped (redone on resume); any other broken line is an
    error."""
    lines = path.read_text().splitlines() if path.exists() else []
    records = []
    for k, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            # only the last line may be cut short (by a kill while it was written)
            if k < len(lines) - 1 and line.strip():
                raise SystemExit(f"{path}: line {k + 1} is not JSON ({e}); the log is damaged")
            continue
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise SystemExit(f"{path}: line {k + 1} is not a step's record; the log is damaged")
        records.append(record)
    return records


def save_checkpoint(out: Path, step: int, policy, optimizer, procs,
                    extra: dict[str, dict] | None = None) -> Path:
    """OUT/checkpoint-<step>/, whole or not at all: written to a temporary directory, then
    renamed; a failed write stops the run with one line. It holds the adapter (PEFT layout),
    the optimizer's state, every process's RNG states and trainer.json; `extra`: more
    tensors files to keep with it (file name -> tensors), such as a lab method's own state.
    Returns its directory."""
    final, tmp = out / f"checkpoint-{step:06d}", out / f".checkpoint-{step:06d}.tmp"
    # a hidden temporary directory, made fresh by the main process
    try:
        if procs.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        procs.barrier()
        # each process has its own RNG streams: Python's, numpy's, torch's and CUDA's
        py, (name, keys, pos, has_gauss, cached) = random.getstate(), np.random.get_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        rng = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64)),
               **{f"cuda{i}": s for i, s in enumerate(cuda)}}
        save_file(rng, tmp / f"rng-{procs.rank}.safetensors")
        write_json(tmp / f"rng-{procs.rank}.json", {
            "python": [py[0], list(py[1]), py[2]],
            "numpy": [name, int(pos), int(has_gauss), float(cached)]})
        procs.barrier()
        # the main process writes the rest, the manifest last, then renames the whole
        if procs.main:
            model.save_adapter(policy, tmp / "adapter")
            tensors, meta = optimizer_to_tensors(optimizer)
            save_file(tensors, tmp / "optimizer.safetensors")
            for name, tensors in (extra or {}).items():
                save_file(tensors, tmp / name)
            # trainer.json: the step and the processes, which resuming checks, and the
            # optimizer's settings
            write_json(tmp / "trainer.json", {"step": step, "processes": procs.size,
                                              "optimizer": meta})
            write_manifest(tmp)         # last: a checkpoint with its manifest is whole
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        procs.barrier()
        return final
    # a failed write leaves the checkpoints that were whole, and the line names the newest
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(out)
        raise SystemExit(f"{final}: could not be written ({type(e).__name__}: {e}); "
                         + (f"{last.name} is intact: " if last else "")
                         + "free the space and continue with --resume") from None


def latest_checkpoint(out: Path) -> Path | None:
    """OUT's newest checkpoint holding its trainer.json, or None (its files not checked)."""
    return max((p for p in out.glob("checkpoint-*") if (p / "trainer.json").is_file()),
               default=None)


# --- A checkpoint verifies itself: its manifest, written last, lists every other file's
# size and sha256; resuming checks it, then what the files say, before anything is loaded.

MANIFEST = "manifest.json"


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, in hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checkpoint_files(directory: Path) -> list[str]:
    """Every file of a checkpoint but its manifest, relative to it (the adapter's too)."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path) -> None:
    """The checkpoint's manifest.json: the size and sha256 of each of its other files."""
    files = {}
    for name in checkpoint_files(directory):
        path = directory / name
        files[name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    write_json(directory / MANIFEST, {"format": "checkpoint/1", "files": files})


def damage(directory: Path) -> str | None:
    """What is wrong with a checkpoint against its manifest, naming the file: no manifest
    (it was never finished), a file missing, changed or not listed; None when intact."""
    # the manifest itself, and the names it lists: none may lead out of the checkpoint
    try:
        listed = json.loads((directory / MANIFEST).read_text())["files"]
        names = [name for name in listed if not (isinstance(listed[name], dict)
                 and Path(name).as_posix() == name and ".." not in Path(name).parts)]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        return f"{directory / MANIFEST}: missing or unreadable ({type(e).__name__})"
    if names:
        return f"{directory / MANIFEST}: a file name it may not hold, {names[0]!r}"
    # then the files: none more, none less, each as it was written
    for name in checkpoint_files(directory):
        if name not in listed:
            return f"{directory / name}: a file the checkpoint did not write"
    for name, entry in listed.items():
        path = directory / name
        if not path.is_file():
            return f"{path}: missing"
        size, sha = path.stat().st_size, file_sha256(path)
        if size != entry.get("size") or sha != entry.get("sha256"):
            return f"{path}: changed since the checkpoint was written (its sha256 differs)"
    return None


def intact_checkpoint(out: Path, log) -> Path | None:
    """The newest checkpoint whose files are those its manifest lists (None: there is no
    checkpoint); each damaged one newer than it is named and passed over. Refused when there
    are checkpoints but none is intact."""
    # newest first: a damaged one is named, and the next older one tried
    found = sorted(out.glob("checkpoint-*"), reverse=True)
    for ckpt in found:
        why = damage(ckpt)
        if why is None:
            return ckpt
        log(f"warning: {ckpt.name} is damaged ({why}); resuming from the checkpoint before "
            "it, if one is intact", flush=True)
    if found:
        raise SystemExit(f"--resume: no checkpoint in {out} is intact ({damage(found[0])}); "
                         "restore it, or start the run again in another --out")
    return None


def load_checkpoint(path: Path, policy, optimizer, procs) -> int:
    """Restore a checkpoint into policy, optimizer and RNGs; returns its step. What its
    files say is checked before anything is loaded: its step is its directory's, the
    optimizer's settings are the run's, and the optimizer's state is finite, its second
    moments and step count >= 0."""
    current = path / "trainer.json"         # the file being read, named in any refusal
    try:
        # trainer.json: the step, the processes and the optimizer's settings of the run
        info = json.loads(current.read_text())
        if type(info["step"]) is not int or info["step"] != int(path.name.split("-")[-1]):
            raise ValueError(f"step {info['step']!r}, in the directory of step "
                             f"{int(path.name.split('-')[-1])}")
        if info["processes"] != procs.size:
            raise ValueError(f"it was written by {info['processes']} processes, this run has "
                             f"{procs.size}; the RNG streams would differ")
        check_optimizer_settings(optimizer, info["optimizer"]["param_groups"])
        # the optimizer's state: finite, its step counts whole, its second moments >= 0
        # (their square root is taken)
        current = path / "optimizer.safetensors"
        tensors = load_file(current)
        for key, t in tensors.items():
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise ValueError(f"{key} holds NaN or infinite values")
            if key.endswith(".step") and (t.numel() != 1 or not 0 <= t.item() < 2**53):
                raise ValueError(f"{key} is {t.tolist()}, not a count of steps")
            if key.endswith(".exp_avg_sq") and (t < 0).any():
                raise ValueError(f"{key} holds negative values")
        # then the adapter's weights and the optimizer's state are loaded
        current = path / "adapter"
        model.load_adapter_weights(policy, current)
        optimizer_from_tensors(optimizer, tensors, info["optimizer"])
        # this process's RNG streams, as they were when the checkpoint was written
        current = path / f"rng-{procs.rank}.safetensors"
        rng = load_file(current)
        current = path / f"rng-{procs.rank}.json"
        meta = json.loads(current.read_text())
        v, state, gauss = meta["python"]
        random.setstate((v, tuple(state), gauss))
        name, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((name, rng["numpy"].numpy().astype(np.uint32), pos, has_gauss,
                             cached))
        torch.set_rng_state(rng["torch"])
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all([rng[f"cuda{i}"]
                                          for i in range(torch.cuda.device_count())
                                          if f"cuda{i}" in rng])
        return info["step"]
    except (OSError, KeyError, IndexError, TypeError, ValueError, RecursionError,
            SafetensorError) as e:      # a damaged file: any of these, never a traceback
        raise SystemExit(f"{current}: cannot resume from this checkpoint ({type(e).__name__}: "
                         f"{e}); resume from an earlier checkpoint (delete this one)") from None


def check_optimizer_settings(optimizer, saved: list[dict]) -> None:
    """Refuse (ValueError) a checkpoint's optimizer settings (`saved`: its param_groups)
    other than those the run's flags give (betas, eps, weight decay ...): the learning rate
    aside, which every step sets."""
    # through JSON, as trainer.json holds them (a tuple of betas becomes a list)
    fresh = json.loads(json.dumps(optimizer.state_dict()["param_groups"]))
    if len(saved) != len(fresh):
        raise ValueError(f"{len(saved)} parameter groups, the run has {len(fresh)}")
    for mine, theirs in zip(fresh, saved):
        for key in mine:
            if key not in ("lr", "params") and theirs.get(key) != mine[key]:
                raise ValueError(f"the optimizer's {key} is {theirs.get(key)!r}, the run's "
                                 f"flags give {mine[key]!r}")


def optimizer_to_tensors(optimizer) -> tuple[dict, dict]:
    """An optimizer's state as (tensors for a safetensors file, the rest for JSON)."""
    # a tensor goes to the safetensors file, anything else to JSON; keys "<param>.<name>"
    sd, tensors, scalars = optimizer.state_dict(), {}, {}
    for idx, state in sd["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_tensors(optimizer, tensors: dict, meta: dict):
    """The optimizer's state restored from what optimizer_to_tensors gave."""
    state: dict[int, dict] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def summarize(out: Path, seconds: float, args, probe_report: dict | None = None) -> dict:
    """The run's summary: base / selected / final held-out success on test, where
    `selected` has the best validation success (ties: the earliest) and `best_on_test` picks
    on test itself, the paper's protocol; with the shipped probes' report when there is one."""
    evals = read_jsonl(out / "eval.jsonl")
    base = next((e for e in evals if e["step"] == 0), None)
    ckpts = [e for e in evals if e["step"] > 0]

    # an evaluation as the summary shows it: its step, validation success, test numbers
    def on_test(e):
        return None if e is None else {"step": e["step"], "val": e["val"]["success"],
                                       **{k: v for k, v in e["test"].items() if k != "scores"}}

    # the checkpoint of the highest success on `split`, the earliest among equals
    def best(split):
        return max(ckpts, key=lambda e: (e[split]["success"], -e["step"])) if ckpts else None
    selected = best("val")
    summary = {"out": str(out), "seconds": round(seconds, 1), "reward": args.reward,
               "alpha": args.alpha, "seed": args.seed, "steps": args.steps,
               "selection": "checkpoint with the best validation success, reported on test",
               "base": on_test(base), "selected": on_test(selected),
               "final": on_test(ckpts[-1] if ckpts else None),
               "best_on_test": on_test(best("test")),
               "selected_adapter": str(out / f"checkpoint-{selected['step']:06d}" / "adapter")
               if selected else None}
    # the shipped probes' report: their AUROC on held-out own turns of this policy
    if probe_report is not None:
        summary["probe_auroc_heldout"] = pair.report_summary(probe_report, args.reward)
    return summary


def summary_text(s: dict) -> str:
    """The summary's lines at the end of a run (s: summarize's)."""
    b, sel, last, best = (s[k] for k in ("base", "selected", "final", "best_on_test"))
    lines = [f"done in {s['seconds']:.0f}s (reward {s['reward']})."]
    # held-out success: before -> selected -> final, and best on test (the paper's protocol)
    if b and sel:
        lines.append(f"held-out success ({b.get('decoding', 'greedy')}, {b['episodes']} test "
                     f"episodes): before {b['success']:.3f} -> selected {sel['success']:.3f} "
                     f"(step {sel['step']}, chosen on validation) -> final "
                     f"{last['success']:.3f} (step {last['step']}); best on test "
                     f"{best['success']:.3f} (step {best['step']}, the paper's protocol)")
    p = s.get("probe_auroc_heldout")
    if p:
        lines.append(f"PAIR AUROC on {p['turns']} held-out own turns: {num(p['pair'])} "
                     f"({p['corpus']} corpus); contaminated-corpus PAIR: "
                     f"{num(p['contaminated_corpus_pair'])}")
    lines.append(f"run: {s['out']} (metrics.jsonl, eval.jsonl, summary.json; `python -m "
                 "lab.curves` draws them)")
    if s["selected_adapter"]:
        lines.append(f"selected adapter (PEFT layout): {s['selected_adapter']}")
    return "\n".join(lines)


def write_json(path: Path, obj, indent: int = 1) -> None:
    """`obj` as a JSON file, written atomically."""
    model.write_atomic(path, json.dumps(obj, indent=indent) + "\n")


def num(x) -> str:
    """A number as a line shows it (3 decimals), or n/a."""
    return "n/a" if x is None else f"{x:.3f}"


# bad input that a run reports in one line naming the file, never a traceback
INPUT_ERRORS = (model.CheckpointError, envs.DataError, probes.FormatError, OSError)


def main(argv=None):
    """`python grpo.py`: the run of argv's flags. Bad input, Ctrl-C and SIGTERM end it in one
    line, its lock let go. Returns the summary."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    # SIGTERM ends the run as Ctrl-C does; the handler this process had is restored after
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return train(args)
    except INPUT_ERRORS as e:
        unlock(Path(args.out))          # a failed command leaves no lock behind
        sys.exit(f"error: {e}")
    except SystemExit:
        unlock(Path(args.out))
        raise
    except KeyboardInterrupt as e:      # Ctrl-C, or SIGTERM (Stopped)
        unlock(Path(args.out))
        sys.exit(interrupted(args, argv, PROG, e))
    finally:
        signal.signal(signal.SIGTERM, previous)


class Stopped(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler's stop), raised where the run is so that it ends as
    Ctrl-C does: its lock let go, one line saying how to go on."""


def stop(signum, frame):
    """The SIGTERM handler a run installs: raises Stopped in the main thread."""
    raise Stopped


def interrupted(args, argv: list[str], prog: str, why: BaseException | None = None) -> str:
    """What Ctrl-C (or SIGTERM: `why` a Stopped) leaves, and the command that goes on
    from there, in one line (after Ctrl-C's ^C: a line of its own)."""
    how = "stopped by SIGTERM" if isinstance(why, Stopped) else "\ninterrupted"
    # the command again, with the run's --out, and --resume where the run has begun
    again = list(argv)
    if "--out" not in argv:
        again += ["--out", args.out]
    # a run that had not started: the same command starts it
    if not (Path(args.out) / "args.json").is_file():
        return f"{how} before the run started; start it with: {prog} {shlex.join(again)}"
    if "--resume" not in argv and "--resume-if-present" not in argv:
        again.append("--resume")
    ckpt = latest_checkpoint(Path(args.out))
    if ckpt is not None:
        what = f"; the run resumes from its last checkpoint ({ckpt.name}), exactly,"
    else:
        what = (f" before the first checkpoint (after step {min(args.save_every, args.steps)}): "
                "no step is kept, and this starts the run over from step 1:")
    return f"{how}{what} with: {prog} {shlex.join(again)}"


if __name__ == "__main__":
    main()
