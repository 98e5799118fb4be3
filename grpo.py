"""Multi-turn GRPO with LoRA and step-level rewards (METHOD.md §9): the training run.

    python grpo.py --reward pair                   # shop, built-in policy, its shipped probes
    python grpo.py --reward outcome --out runs/o   # the sparse baseline, same budget
    python grpo.py --env gta --model Qwen/Qwen2.5-7B-Instruct --probes DIR/pair_mixed
    python -m lab.train --reward igpo ...          # the lab's rewards, searches, torchrun

One step: --batch prompts x --group G rollouts (probes.rollout), a reward per assistant turn and
the advantages (pair.REWARDS, pair.ADVANTAGES), then `update`: pair.grpo_loss over micro-batches,
log pi at the sampling temperature, one AdamW step on LoRA. Around it: the flags and presets, the
run directory, checkpoints and exact resume, evaluation, the summary. The lab plugs in through
PLAYERS, LOSSES and HOOKS.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import envs
import model
import pair
import probes


# --- 1. What the rewards (pair.REWARDS) read; the lab's plug-in tables ------------------------

# The lab plugs in here (lab/train.py); hook(name, ...) calls HOOKS[name] at one point of a run.
PLAYERS = {}        # --reward name -> play(g, run, t) -> (Group, KV bytes), for play_group
LOSSES = {}         # --reward name -> its own loss (update)
HOOKS = {name: [] for name in (
    "flags", "check", "preset", "processes", "split", "context", "setup", "claim", "failed",
    "share", "played", "step", "trained", "resume", "checkpoint", "evaluate", "evaluated")}
PROG = "python grpo.py"     # how messages spell the command line that runs this file


def hook(name: str, *args) -> list:
    return [fn(*args) for fn in HOOKS[name]]


def reward_context(args, policy, tok, env, procs, log) -> pair.RewardContext:
    """What --reward reads: the lab's probes ("context" hook), --probes (a PAIR directory, a probe
    file or a directory of them), or the probes shipped beside a built-in world's policy."""
    ctx = pair.RewardContext(policy, tok, args, env=env)
    if args.reward not in pair.READS_PROBE:
        return ctx
    if (found := [w for w in hook("context", args, policy, tok, procs, log) if w]):
        where, ctx.probe_report = found[0]
    elif args.probes:
        where = Path(args.probes)
    elif is_builtin(args) and (where := Path(args.model) / "probes").is_dir():
        ctx.probe_report = pair.read_report(where, args.reward, log)   # lab.onpolicy rebuilds
    else:
        raise SystemExit(f"--reward {args.reward} on {args.env} with --model {args.model} needs "
                         "--probes DIR (`python -m lab.study` fits them; `python -m lab.train` "
                         "on the fly for another policy of a built-in world)")
    head = pair.load_head(where, args.reward, policy.config,
                          policy.checkpoint_dir if args.probes else None)
    setattr(ctx, "pair" if isinstance(head, pair.Pair) else "probe", head)
    return ctx


# --- 2. Update: pair.grpo_loss (or release_loss) over micro-batches, AdamW on LoRA -------------

def lr_at(step: int, args) -> float:
    """Constant lr after a linear warmup over the first `--warmup` fraction of the steps."""
    warm = max(1, round(args.warmup * args.steps))
    return args.lr * min(1.0, (step + 1) / warm)


def micro_batches(lengths: list[int], rows: int, tokens: int) -> list[list[int]]:
    """Consecutive rows in groups of at most `rows` rows and `tokens` padded tokens (rows x the
    longest), bounding the update's memory; a row longer than `tokens` goes alone."""
    chunks, longest = [], 0
    for r, n in enumerate(lengths):
        longest = max(longest, n)
        if chunks and len(chunks[-1]) < rows and (len(chunks[-1]) + 1) * longest <= tokens:
            chunks[-1].append(r)
        else:
            chunks.append([r])
            longest = n
    return chunks


def update(policy, optimizer, batch: pair.Batch, args, procs) -> dict:
    """`--ppo-epochs` passes over the batch in micro-batches, one AdamW step each."""
    params = [p for p in policy.parameters() if p.requires_grad]
    n_tokens, n_seqs, n_turns = procs.all_sum([batch.mask[:, 1:].sum().item(),
                                               batch.n_seqs, batch.n_turns])
    if n_tokens == 0:   # 0/0 loss; and AdamW on zero gradients still moves by its momentum
        return {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio": 0.0, "grad_norm": 0.0,
                "tokens": 0, "empty_batch": 1, "skipped_updates": 0}
    chunks = micro_batches(batch.lengths, args.micro_batch, args.micro_batch_tokens)
    dev = model.input_device(policy)
    # log pi at the sampling temperature, the distribution the tokens were drawn from; the
    # release takes T = 1 whatever it sampled at
    temperature = 1.0 if args.advantage == "release" else args.temperature
    ref, old, skipped = {}, {}, 0
    for epoch in range(args.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        sums = [0.0] * 4                # loss, KL, clip indicator, rho
        for c, rows_c in enumerate(chunks):
            T = max(batch.lengths[r] for r in rows_c)
            ids = batch.ids[rows_c, :T].to(dev)
            mask = batch.mask[rows_c, :T]
            adv = batch.adv[rows_c, :T][:, 1:][mask[:, 1:]].to(dev)
            if c not in ref:
                with torch.no_grad(), model.lora_disabled(policy):
                    ref[c] = model.token_logprobs(policy, ids, mask, temperature)
            logp = model.token_logprobs(policy, ids, mask, temperature)
            if epoch == 0:
                old[c] = logp.detach()
            if args.reward in LOSSES:
                loss, s = LOSSES[args.reward](logp, old[c], ref[c], adv, batch, rows_c, T, args,
                                              (n_tokens, n_seqs))
            elif args.advantage == "release":
                loss, s = pair.release_loss(logp, old[c], ref[c], adv,
                                            batch.per_turn[rows_c, 1:T][mask[:, 1:]].to(dev),
                                            args.eps, args.beta, n_turns)
            else:
                loss, s = pair.grpo_loss(logp, old[c], ref[c], adv, args.eps, args.beta, n_tokens)
            loss.backward()
            sums = [a + b for a, b in zip(sums, (loss.item(), s["kl"], s["clip"], s["ratio"]))]
        for p in params:               # processes with fewer tokens still join the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        procs.all_reduce_grads(params)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip).item()
        if math.isfinite(grad_norm):
            optimizer.step()
        else:       # a NaN or inf reached the gradient: a step on it would ruin the adapter
            skipped += 1
        if epoch == 0:
            first = procs.all_sum(sums)
    loss, kl, clip, ratio = first
    return {"loss": loss, "kl": kl / max(n_tokens, 1), "clip_frac": clip / max(n_tokens, 1),
            "ratio": ratio / max(n_tokens, 1), "grad_norm": grad_norm, "tokens": int(n_tokens),
            "empty_batch": 0, "skipped_updates": skipped}


# --- 3. The training loop: rollout -> rewards -> advantages -> update, checkpoints between ------

def prompt_index(seed: int, g: int, n: int) -> int:
    """The training episode of the g-th prompt of the run: a fresh permutation every pass."""
    epoch, k = divmod(g, n)
    return int(np.random.default_rng([seed, epoch]).permutation(n)[k])


def sampler(policy, seed: int, g: int) -> torch.Generator:
    """One generator per prompt, seeded by its number in the run: the rollouts depend neither on
    the sharding over processes nor on where a run was resumed."""
    return torch.Generator(device=policy.lm_head.weight.device).manual_seed(seed * 1_000_003 + g)


TIMING = ("t_rollout", "t_reward", "t_update")      # seconds per step; the lab adds its own
# a step's work, summed over processes: tokens and turns sampled, tree search's sibling rollouts,
# sequences and tokens teacher-forced by a reward, calls to an external judge
COSTS = ("gen_tokens", "gen_turns", "branch_rollouts", "branch_tokens", "tf_rows", "tf_tokens",
         "external_calls")


@dataclass
class Training:                     # what the training loop reads; setup() builds it once
    policy: model.Transformer
    tok: model.Tokenizer
    env: envs.Env                   # the training environment ...
    pool: list[int]                 # ... and the indices of its episodes the prompts come from
    held: dict                      # the held-out splits, {"val": (env, pool), "test": ...}
    ctx: pair.RewardContext
    optimizer: torch.optim.Optimizer
    args: argparse.Namespace
    procs: Processes
    out: Path                       # the run directory
    log: object                     # print on the main process, silent elsewhere


@dataclass
class Group:                        # one prompt's rollouts, rewarded, with their advantages
    trajs: list[probes.Trajectory]
    rewards: list[list[float | None]]
    p_correct: list                 # per rollout, the frozen probe's P(correct) per turn, or None
    advantages: list[list[float]]
    all_equal: bool                 # no turn got an advantage: nothing to learn from


def play_group(g: int, run: Training, t: dict) -> tuple[Group, int]:
    """The g-th prompt of the run: its G rollouts, rewards and advantages, and the bytes of KV
    cache they held. Adds the seconds spent to t (TIMING) and the work to run.ctx.cost (COSTS)."""
    if run.args.reward in PLAYERS:      # a tree search of the lab plays its trees instead
        return PLAYERS[run.args.reward](g, run, t)
    policy, ctx, args, caches = run.policy, run.ctx, run.args, []
    t0 = time.perf_counter()
    index = run.pool[prompt_index(args.seed, g, len(run.pool))]
    episodes = [run.env.episode(index) for _ in range(args.group)]     # the group GRPO compares
    trajs = probes.rollout(policy, run.tok, episodes, args, generator=sampler(policy, args.seed, g),
                           caches=caches, stats=args.reward in pair.NEEDS_STATS and ctx.stats)
    t1 = time.perf_counter()
    hook("played", run, trajs, t)
    r, p = zip(*[pair.turn_rewards(traj, ctx) for traj in trajs])
    t["t_rollout"] += t1 - t0
    t["t_reward"] += time.perf_counter() - t1
    a, all_equal = pair.ADVANTAGES[args.advantage](list(r), [traj.score for traj in trajs], args)
    played = [st for traj in trajs for st in traj.steps]
    ctx.cost.update(gen_turns=len(played), gen_tokens=sum(len(st.tokens) for st in played))
    kv_bytes = sum(c.k.nbytes + c.v.nbytes for cache in caches for c in cache)
    return Group(list(trajs), list(r), list(p), a, all_equal), kv_bytes


def train_step(step: int, run: Training) -> dict:
    """One GRPO step: this process's share of the prompts, then the all-reduced update. The lab
    may play the share another way ("share" hook: the groups kept, and (Group, KV bytes) of
    every group played)."""
    policy, args, procs = run.policy, run.args, run.procs
    t = {k: 0.0 for k in TIMING}
    run.ctx.cost = Counter(dict.fromkeys(COSTS, 0))
    if on_cuda := model.input_device(policy).type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.input_device(policy))
    policy.eval()
    if (share := next((s for s in hook("share", step, run, t) if s is not None), None)) is None:
        played = [play_group(step * args.batch + j, run, t)
                  for j in range(procs.rank, args.batch, procs.size)]
        share = [group for group, _ in played], played
    kept, played = share
    t0 = time.perf_counter()
    trajs = [traj for group in kept for traj in group.trajs]
    advs = [a for group in kept for a in group.advantages]
    policy.train()
    stats = update(policy, run.optimizer, pair.make_batch(trajs, advs, run.tok.pad_id), args, procs)
    policy.eval()
    t["t_update"] = time.perf_counter() - t0
    extra = hook("trained", run, step, trajs)       # the lab's metrics of this step
    memory = {"mem_kv_mb": max((kv for _, kv in played), default=0) / 2**20}
    if on_cuda:
        memory["mem_cuda_peak_mb"] = torch.cuda.max_memory_allocated(
            model.input_device(policy)) / 2**20
    return step_metrics(step, trajs, [g.rewards for g in kept],
                        [p for g in kept for p in g.p_correct],
                        (sum(g.all_equal for g, _ in played), len(played)), stats,
                        [t[k] for k in TIMING], args, procs,
                        [run.ctx.cost[k] for k in COSTS], memory, extra)


def step_metrics(step, trajs, rewards, p_correct, played, stats, times, args, procs, costs=(),
                 memory=None, extra=()) -> dict:
    """One metrics.jsonl record, summed over processes (memory: the largest). played = (groups
    all_equal, groups played); the rest is about the groups kept (p_correct: as Group's)."""
    rows = [row for group in rewards for row in group]
    flat = [r for row in rows for r in row if r is not None]
    M = args.max_turns
    turn_sum, turn_n, reached = [0.0] * M, [0] * M, [0] * M
    for row in rows:
        for t, r in enumerate(row):
            reached[t] += 1
            if r is not None:
                turn_sum[t] += r
                turn_n[t] += 1
    parts = {
        "n": [len(flat)], "sum": [sum(flat)], "sum_sq": [sum(r * r for r in flat)],
        "rollouts": [len(trajs)], "score": [sum(t.score for t in trajs)],
        "turns": [sum(len(t.steps) for t in trajs)], "truncated": [sum(t.truncated for t in trajs)],
        "all_equal": [played[0]], "groups": [played[1]], "times": list(times),
        "turn_sum": turn_sum, "turn_n": turn_n, "reached": reached, "costs": list(costs)}
    summed = iter(procs.all_sum([v for values in parts.values() for v in values]))
    s = {name: [next(summed) for _ in values] for name, values in parts.items()}  # one all-reduce
    (n,), (n_traj,), (n_groups,) = s["n"], s["rollouts"], s["groups"]
    mean = s["sum"][0] / max(n, 1)
    rec = {"step": step + 1, "lr": lr_at(step, args), "reward_mean": mean,
           "reward_std": math.sqrt(max(s["sum_sq"][0] / max(n, 1) - mean * mean, 0.0)),
           "success": s["score"][0] / max(n_traj, 1),
           "frac_zero_std": s["all_equal"][0] / max(n_groups, 1), "groups_played": int(n_groups),
           **stats, "turns": s["turns"][0] / max(n_traj, 1), "truncated": int(s["truncated"][0]),
           # mean reward of turn t over the rollouts that reached it (None: no reward there)
           "turn_rewards": [s["turn_sum"][t] / s["turn_n"][t] if s["turn_n"][t] else None
                            for t in range(M) if s["reached"][t]]}
    if ctx_has_probe(args):     # drift monitor: the frozen probe against the exact step labels
        pairs = [(p, float(lab)) for t, ps in zip(trajs, p_correct) if ps is not None
                 for p, lab in zip(ps, t.episode.labels() or [])]
        size = args.batch * args.group * M
        p = procs.gather([x for x, _ in pairs], size)
        y = procs.gather([y for _, y in pairs], size)
        rec["probe_auroc"] = probes.auroc(y, p) if 0 < sum(y) < len(y) else None
    rec.update({name: t / procs.size for name, t in zip(TIMING, s["times"])})
    rec.update({name: int(c) for name, c in zip(COSTS, s["costs"])})
    rec.update({name: round(procs.all_max(v), 3) for name, v in (memory or {}).items()})
    for metrics in extra:           # the lab's (a refit's report)
        rec.update(metrics or {})
    return rec


def ctx_has_probe(args) -> bool:
    """PAIR and the probe rewards score every turn; only shop has exact labels to check them on."""
    return args.env in envs.WORLDS and (args.reward == "pair" or args.reward in pair.PROBE_REWARDS)


def setup(args) -> Training:
    """Everything a run reads, each input checked before the run directory is written."""
    procs = next((p for p in hook("processes", args) if p is not None), None) \
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 else Processes()    # torchrun: the lab's
    if procs is None:
        raise SystemExit("several processes run through the lab: torchrun --nproc_per_node N -m "
                         "lab.train ...")
    resolve_preset(args, procs)
    if args.batch % procs.size:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {procs.size} processes")
    if args.threads:
        torch.set_num_threads(args.threads)
    check_out(args)     # read-only first: a --resume mistake costs no model load
    procs.barrier()     # every process reads OUT as it was before any of them writes
    log = print if procs.main else (lambda *a, **k: None)
    policy, tok = load_policy(args, procs)
    env = envs.make_env(args, "train")
    held, pool = envs.eval_splits(args, env, envs.scorable(env))
    if not pool or not all(p for _, p in held.values()):
        raise SystemExit(f"--env {args.env}: no scorable episode in a split")
    # a turn that might not fit ends a rollout: with no room for the first, a run learns nothing
    prompt = len(tok.render(env.episode(pool[0]).messages, add_generation_prompt=True)[0])
    if prompt + args.max_new_tokens > args.max_len:
        raise SystemExit(f"--max-len {args.max_len}: a task's prompt alone is {prompt} tokens "
                         f"and a turn needs --max-new-tokens {args.max_new_tokens} more")
    # given probes are checked before OUT is claimed; probes fitted on the fly (minutes) after
    ctx = None if ctx_has_probe(args) and not args.probes else \
        reward_context(args, policy, tok, env, procs, log)
    out = prepare_out(args, procs)
    ctx = ctx or reward_context(args, policy, tok, env, procs, log)
    hook("setup", args, policy, tok, procs, log, ctx)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    n_lora = sum(p.numel() for p in params)
    log(f"policy {args.model}: {sum(p.numel() for p in policy.parameters()) - n_lora:,} "
        f"parameters, + {n_lora:,} in the LoRA adapter (trained); env {args.env}: {len(pool)} "
        f"training / {len(held['val'][1])} validation / {len(held['test'][1])} test episodes; "
        f"reward {args.reward}; {args.steps} steps of {args.batch} x {args.group} rollouts on "
        f"{procs.size} process(es); run in {out}", flush=True)
    return Training(policy, tok, env, pool, held, ctx, optimizer, args, procs, out, log)


def load_policy(args, procs: Processes) -> tuple[model.Transformer, model.Tokenizer]:
    """The seeded start of a run: RNGs seeded, the policy, a fresh LoRA adapter (the first random
    draws; lab/onpolicy.py's rebuild of the probes starts here too)."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    devices = model.parse_devices(args.devices or procs.device)
    builtin = envs.BUILTIN_POLICIES.get(args.env, envs.BUILTIN_POLICY)
    if Path(args.model).resolve() == builtin.resolve() and not builtin.is_dir():
        sys.exit(f"--model: the built-in policy {builtin} is missing; build it with "
                 f"`python -m lab.shop sft --out {builtin}` (lab/README.md)")
    policy, tok = model.load_model(args.model, dtype=model.DTYPES[args.dtype], device=devices[0])
    if len(devices) > 1:
        hook("split", policy, devices)      # lab/split.py
    model.apply_lora(policy, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                     targets=tuple(args.lora_targets.split(",")))
    return policy, tok


def resume(run: Training) -> int:
    """The step to start from: 0, or (--resume) the newest checkpoint's, restored; what was
    logged after it is dropped, to be redone exactly."""
    start, args, out = 0, run.args, run.out
    if args.resume and (ckpt := latest_checkpoint(out)) is not None:
        start, lagged = load_checkpoint(ckpt, run.policy, run.optimizer, run.procs)
        run.ctx.lagged = run.ctx.lagged if lagged is None else lagged
        run.log(f"resumed from {ckpt} at step {start}", flush=True)
    for path in (out / "metrics.jsonl", out / "eval.jsonl"):
        if run.procs.main and args.resume and path.exists():
            model.write_atomic(path, "".join(json.dumps(r) + "\n" for r in read_jsonl(path)
                                             if r["step"] <= start))
    run.procs.barrier()
    hook("resume", run, start)
    return start


def evaluate_and_log(run: Training, step: int, done: set):
    """Evaluate the policy at `step` on the held-out splits into eval.jsonl, unless done or
    --no-eval. The lab may hand in an evaluation it kept ("evaluate" hook)."""
    if run.args.no_eval or step in done:
        return
    if (ev := next((e for e in hook("evaluate", run, step) if e is not None), None)) is None:
        ev = probes.evaluate_all(step, run.policy, run.tok, run.held, run.args, run.procs)
        hook("evaluated", run, step, ev)
    if run.procs.main:
        append_jsonl(run.out / "eval.jsonl", ev)
    done.add(step)
    run.log(f"{'base model' if step == 0 else f'step {step}'}: held-out success "
            f"{ev['test']['success']:.3f} on {ev['test']['episodes']} test episodes, "
            f"{ev['val']['success']:.3f} on {ev['val']['episodes']} validation (greedy)",
            flush=True)


CHANCE_WINDOW = 5       # steps the drift monitor's alarm averages over


def below_chance(aurocs: list) -> float | None:
    """The drift monitor's alarm: the mean probe AUROC of the last CHANCE_WINDOW steps when
    below chance (the frozen probe's reward now favours wrong turns), else None."""
    recent = [a for a in aurocs[-CHANCE_WINDOW:] if a is not None]
    mean = sum(recent) / CHANCE_WINDOW
    return mean if len(recent) == CHANCE_WINDOW and mean < 0.5 else None


def train(args) -> dict:
    """Setup, the base model's evaluation, --steps GRPO steps with a checkpoint and an
    evaluation every --save-every steps and at the end, the summary."""
    started = time.perf_counter()
    run = setup(args)
    ctx, procs, log = run.ctx, run.procs, run.log
    start = resume(run)
    done = {e["step"] for e in read_jsonl(run.out / "eval.jsonl")}
    evaluate_and_log(run, start, done)      # the base model, or a checkpoint killed early
    seconds, aurocs, warned = [], [], False
    for step in range(start, args.steps):
        t = time.perf_counter()
        for group in run.optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        hook("step", run, step)
        rec = train_step(step, run)
        if procs.main:
            append_jsonl(run.out / "metrics.jsonl", rec)
        aurocs.append(auroc := rec.get("probe_auroc"))
        seconds.append(time.perf_counter() - t)     # the median: one rambling rollout is slow
        left = float(np.median(seconds[-10:])) * (args.steps - step - 1)
        log(f"step {rec['step']:>4}/{args.steps}  reward {rec['reward_mean']:.3f}"
            f"±{rec['reward_std']:.3f}  success {rec['success']:.2f}  zero-std "
            f"{rec['frac_zero_std']:.2f}  kl {rec['kl']:.2e}"
            + (f"  probe-auroc {auroc:.2f}" if auroc is not None else "")
            + f"  {seconds[-1]:.1f}s (rollout {rec['t_rollout']:.1f} reward "
            f"{rec['t_reward']:.2f} update {rec['t_update']:.1f})  steps left "
            f"{probes.duration(left)}",
            flush=True)
        if rec.get("skipped_updates"):
            log(f"warning: step {step + 1}: the gradient was not finite; the adapter was not "
                "updated (skipped_updates in metrics.jsonl)", flush=True)
        if not warned and (mean := below_chance(aurocs)) is not None:
            warned = True
            log(f"warning: the probe ranks this run's own turns below chance (mean AUROC "
                f"{mean:.2f} over the last {CHANCE_WINDOW} steps): its reward now favours wrong "
                "turns", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            path = save_checkpoint(run.out, step + 1, run.policy, run.optimizer, procs, ctx.lagged)
            log(f"checkpoint {path}", flush=True)
            hook("checkpoint", run, step + 1)
            evaluate_and_log(run, step + 1, done)
    summary = summarize(run.out, time.perf_counter() - started, args, ctx.probe_report)
    summary.update(ctx.summary)
    if procs.main:
        write_json(run.out / "summary.json", summary)
        log(summary_text(summary), flush=True)
    procs.close()
    return summary


# --- The run: flags and presets, processes, run directory, checkpoints, evaluation, summary ----

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every default in --help but "(default: None)": such a flag's help says what decides it."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, pointing to the lab for a choice or a flag the core lacks."""

    def error(self, message):
        if PROG == "python grpo.py" and ("invalid choice" in message
                                         or "unrecognized arguments" in message):
            message += ("; the paper's other rewards, the tree searches, shop-long, the other "
                        "advantage forms and the lab's flags (--oversample...) run through "
                        "`python -m lab.train` (lab/README.md)")
        super().error(message)


def at_least(low):                  # a range of FLAG_RANGES: (test, what it asks for)
    return (lambda v: v >= low), f"at least {low}"


def finite(low=-math.inf):
    return (lambda v: low <= v < math.inf), \
        "a finite number" + (f" >= {low}" if low > -math.inf else "")


CORES = os.cpu_count() or 1         # more threads only slow a run down (a huge count crashes)
THREADS = (lambda v: 1 <= v <= CORES), f"between 1 and this machine's {CORES} cores"
FLAG_RANGES = {     # every numeric flag's range, checked before anything is loaded
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
    """ap.error for the first flag of `ranges` (name -> (test, what)) whose value, or one of its
    values, fails its test; None is not checked, nan fails every test."""
    for name, (ok, what) in ranges.items():
        value = getattr(args, name)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not ok(v):
                ap.error(f"--{name.replace('_', '-')} must be {what}, got {v}")


PAPER_HPARAMS = dict(batch=1, group=4, max_turns=10, max_new_tokens=1024, temperature=1.0,
                     top_p=1.0, lr=3e-7, warmup=0.05, beta=0.01, eps=0.2, steps=500,
                     save_every=50, lora_r=16, lora_alpha=32.0, lora_dropout=0.05, eval_batch=16)
# The built-in policy (~0.3M parameters): T = 0.7, near its greedy evaluation; four prompts a
# step, rarely all uninformative; lr 3e-4 (1e-3 erodes held-out success in 10 steps); no LoRA
# dropout (noise at this size); one thread (two ran 1.8x-40x slower beside a busy process).
TINY = dict(batch=4, group=8, max_new_tokens=96, temperature=0.7, lr=3e-4, lora_dropout=0.0,
            steps=20, save_every=10, eval_batch=128, threads=1)
DEFAULTS = dict(weight_decay=0.0, advantage="process")     # flags a --preset sets, not the paper
# --preset release: the authors' release as it ran (but for its update's cap at the last 2,560
# tokens of each turn's context, METHOD.md §9)
PRESETS = {"release": dict(weight_decay=0.01, warmup=0.0, top_p=0.95, advantage="release")}


def is_builtin(args) -> bool:      # the built-in world's own policy (TINY preset)
    return args.env in envs.WORLDS and \
        Path(args.model).resolve() == envs.BUILTIN_POLICIES[args.env].resolve()


def resolve_preset(args, procs) -> None:
    """Fill the flags left unset: the tiny preset for the built-in policy, else the paper's;
    then --preset's."""
    preset = dict(PAPER_HPARAMS, **TINY) if is_builtin(args) else dict(PAPER_HPARAMS)
    if args.env in envs.WORLDS:         # shop-long's episodes are longer than the paper's 10
        preset["max_turns"] = envs.WORLD_TURNS[args.env]
    preset.update(DEFAULTS, **PRESETS.get(args.preset, {}))
    given = {k for k in preset if getattr(args, k) is not None}
    for k, v in preset.items():
        if k not in given:
            setattr(args, k, v)
    if args.micro_batch is None:
        args.micro_batch = args.group
    hook("preset", args, given)
    shown = [*(TINY if is_builtin(args) else ()), *PRESETS.get(args.preset, ())]
    if procs.main and shown:
        print("preset: " + ", ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" + (
            " (from the command line)" if k in given else "") for k in shown), flush=True)


def preset_flags(group, flags: dict) -> None:
    """Flags the presets set (name -> help); their help gives TINY's default and the paper's."""
    for key, what in flags.items():
        tiny, paper = TINY.get(key, PAPER_HPARAMS[key]), PAPER_HPARAMS[key]
        default = f"{tiny} with the built-in policy, {paper} otherwise" if tiny != paper else paper
        group.add_argument(f"--{key.replace('_', '-')}", type=type(paper), default=None,
                           help=f"{what} (default: {default})")


def train_parser(rewards) -> argparse.ArgumentParser:
    """grpo.py's flags; `rewards`: the names --reward takes (pair.REWARDS)."""
    ap = Parser(prog=PROG, formatter_class=HelpFormatter,
                description="Multi-turn GRPO with LoRA and step-level rewards (METHOD.md §9); "
                            "with no flag: shop, the built-in policy and its probes.",
                epilog="Defaults: the paper's Table grpo_config, but --temperature, --top-p, "
                       "--lora-alpha and --lora-dropout, the release's (the paper states no T or "
                       "top-p). Several processes: `torchrun --nproc_per_node N -m lab.train ...`.")
    a = ap.add_argument
    a("--env", default="shop", choices=(*envs.WORLDS, "gta", "toolbench"),
      help="a built-in world or a released dataset replayed (envs.py)")
    a("--data-dir", help="gta / toolbench: the released files' root (default: $PAIR_DATA, else "
      "~/.cache/pair/data)")
    a("--model", help="policy: a checkpoint directory or a Hugging Face model name (default: the "
      "built-in world's own, data/shop-policy)")
    a("--reward", default="pair", choices=tuple(rewards), help="per-turn reward source")
    a("--alpha", type=float, default=5.0, help="PAIR momentum scaling; 0 = vanilla PAIR")
    a("--outcome-weight", type=float, default=0.0, help="plus this x the task score on the last "
      "turn's reward")
    a("--advantage", choices=tuple(pair.ADVANTAGES), help="advantage form and loss (default: "
      "process, DeepSeekMath's; release with --preset release)")
    a("--preset", choices=tuple(PRESETS), help="release = the authors' release as it ran: "
      "--weight-decay 0.01, --warmup 0, --top-p 0.95, --advantage release")
    a("--probes", help="a PAIR directory, a probe file or a directory of them (default on shop: "
      "shipped beside the built-in policy)")
    g = ap.add_argument_group("rollout")
    preset_flags(g, dict(steps="training steps", batch="prompts per step",
                         group="rollouts per prompt, G", max_turns="assistant turns per rollout "
                         "(a built-in world's own: envs.WORLD_TURNS)",
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
    a("--devices", help="the process's device, e.g. cuda:0; several split the layers (lab) "
      "(default: the process's GPU under torchrun, else the CPU)")
    a("--threads", type=int, help="torch CPU threads (default: 1 with the built-in policy, else "
      "torch's choice)")
    hook("flags", ap)
    return ap


def parse_args(argv, rewards) -> argparse.Namespace:
    """grpo.py's command line, checked, with --out defaulting to a new runs/ directory."""
    ap = train_parser(rewards)
    args = ap.parse_args(argv)
    if args.model is None:
        args.model = str(envs.BUILTIN_POLICIES.get(args.env, envs.BUILTIN_POLICY))
    check_ranges(ap, args, FLAG_RANGES)
    if args.resume and args.resume_if_present:
        ap.error("--resume and --resume-if-present: pass one")
    try:
        if args.devices is not None and len(model.parse_devices(args.devices)) > 1 \
                and not HOOKS["split"]:
            ap.error(f"--devices {args.devices}: the layers split over several devices through "
                     "`python -m lab.train` (lab/split.py)")
    except ValueError as e:
        ap.error(str(e))
    if bad := [t for t in args.lora_targets.split(",") if t not in model.LORA_TARGETS]:
        ap.error(f"--lora-targets {args.lora_targets!r}: {bad} not among the blocks' linear "
                 f"layers {','.join(model.LORA_TARGETS)}")
    if args.out is None:
        if args.resume:
            ap.error("--resume: nothing to resume without --out (the run directory to continue)")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--out is required with several processes")
        args.out = str(Path("runs") / f"{args.env}-{args.reward}-{time.strftime('%Y%m%d-%H%M%S')}")
    return args


@dataclass
class Processes:
    """This process alone; lab/torchrun.py's subclass reduces across the processes of torchrun,
    each playing its share of the prompts."""
    rank: int = 0
    size: int = 1
    device: str = "cpu"             # where reduced tensors live (cuda for nccl)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, values: list[float]) -> list[float]:
        return [float(v) for v in values]

    def all_max(self, value: float) -> float:
        return float(value)

    def gather(self, values: list[float], size: int) -> list[float]:
        return list(values)         # every process's list (each at most `size`), concatenated

    def barrier(self, *_) -> None:
        pass

    all_reduce_grads = close = barrier


# flags a resumed run must keep: all that trains or scores it (not --threads, --devices,
# --eval-batch: they change float summation order only); the lab adds its own
RESUME_KEYS = ("env", "model", "reward", "alpha", "outcome_weight", "probes", "seed", "steps",
               "batch", "group", "max_turns", "max_new_tokens", "max_len", "temperature", "top_p",
               "lr", "warmup", "beta", "eps", "ppo_epochs", "micro_batch", "micro_batch_tokens",
               "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "save_every",
               "eval_episodes", "val_episodes", "advantage", "grad_clip", "weight_decay", "dtype")
RESUME_DEFAULTS = {"advantage": "process"}      # an args.json without the flag ran with this


def changed_flag(args, old: dict) -> tuple[str, object, object] | None:
    """The first flag of RESUME_KEYS that differs from a run's args.json (old): (--flag, its
    value now, the run's), or None. A model directory may be spelled another way (relative)."""
    for k in RESUME_KEYS:
        now, then = getattr(args, k), old.get(k, RESUME_DEFAULTS.get(k, getattr(args, k)))
        if then != now and not (k == "model" and isinstance(then, str) and Path(then).is_dir()
                                and Path(then).resolve() == Path(now).resolve()):
            return f"--{k.replace('_', '-')}", now, then
    return None


def check_out(args) -> None:
    """What --out holds against --resume(-if-present), read-only: checked before anything is
    loaded and again once OUT is claimed. A run exists once its args.json does."""
    out, saved = Path(args.out), Path(args.out) / "args.json"
    if args.resume_if_present:
        args.resume = saved.exists()
    if not args.resume:
        if any((out / f).exists() for f in ("metrics.jsonl", "eval.jsonl")) or \
                latest_checkpoint(out):     # eval.jsonl: killed after the base evaluation
            raise SystemExit(f"--out {out} already holds a run: pass --resume to continue it, "
                             "or choose another --out")
        return
    if not saved.exists():      # a typo in --out must not start a new run
        raise SystemExit(f"--resume: nothing to resume in {out} (no args.json: no run was "
                         "started there); leave out --resume to start one")
    try:
        old = json.loads(saved.read_text())
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError) as e:
        raise SystemExit(f"--resume: {saved} is not readable ({type(e).__name__}: {e})") from None
    if changed := changed_flag(args, old):
        flag, now, then = changed
        raise SystemExit(f"--resume: {flag} is {now!r} but the run in {out} used {then!r}")
    # logs past the first checkpoint's step, a summary or a damaged checkpoint, and no whole
    # checkpoint: starting over would replace the logs
    logged = max((r["step"] for r in read_jsonl(out / "metrics.jsonl")), default=0)
    first = min(args.save_every, args.steps)
    if latest_checkpoint(out) is None and (logged > first or any(out.glob("checkpoint-*"))
                                           or (out / "summary.json").exists()):
        raise SystemExit(f"--resume: {out} logged {logged} steps but holds no checkpoint whole "
                         f"(with trainer.json; the first is saved after step {first}): restore "
                         "them, or choose another --out")


def prepare_out(args, procs) -> Path:
    out = Path(args.out)
    if procs.main:
        out.mkdir(parents=True, exist_ok=True)
        if not hook("claim", out):      # the lab's lock nests and waits; the core's refuses
            lock(out)
        check_out(args)
        write_json(out / "args.json", vars(args))
    procs.barrier()
    return out


LOCKS = []          # the open lock files of the run directories this process holds


def lock(out: Path) -> None:
    """One run per OUT: flock() on OUT/.lock, dropped by the kernel when the process dies (kill -9
    included); the file names the holder."""
    import fcntl                    # POSIX only
    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise SystemExit(f"--out {out} is in use by pid {f.read().strip() or '?'}; wait for it "
                         "to finish, or write somewhere else") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    LOCKS.append(f)                 # held open until the process exits


def append_jsonl(path: Path, record: dict):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """metrics.jsonl or eval.jsonl: a JSON object with an integer "step" a line. A last line
    cut short by a kill is dropped (redone on resume); any other broken line is an error."""
    lines = path.read_text().splitlines() if path.exists() else []
    records = []
    for k, line in enumerate(lines):
        try:
            records.append(record := json.loads(line))
        except json.JSONDecodeError as e:
            if k < len(lines) - 1 and line.strip():
                raise SystemExit(f"{path}: line {k + 1} is not JSON ({e}); the log is damaged")
            continue
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise SystemExit(f"{path}: line {k + 1} is not a step's record; the log is damaged")
    return records


def save_checkpoint(out: Path, step: int, policy, optimizer, procs, lagged=None) -> Path:
    """OUT/checkpoint-<step>/ (`lagged`: the lab's tips snapshot), whole or not at all: written
    to a temporary directory, then renamed; a failed write stops the run with one line."""
    final, tmp = out / f"checkpoint-{step:06d}", out / f".checkpoint-{step:06d}.tmp"
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
        if procs.main:
            model.save_adapter(policy, tmp / "adapter")
            tensors, meta = optimizer_to_tensors(optimizer)
            save_file(tensors, tmp / "optimizer.safetensors")
            if lagged is not None:
                save_file(lagged, tmp / "lagged.safetensors")
            write_json(tmp / "trainer.json", {"step": step, "processes": procs.size,
                                              "optimizer": meta})
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        procs.barrier()
        return final
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(out)
        raise SystemExit(f"{final}: could not be written ({type(e).__name__}: {e}); "
                         + (f"{last.name} is intact: " if last else "")
                         + "free the space and continue with --resume") from None


def latest_checkpoint(out: Path) -> Path | None:
    return max((p for p in out.glob("checkpoint-*") if (p / "trainer.json").is_file()),
               default=None)


def load_checkpoint(path: Path, policy, optimizer, procs) -> tuple[int, dict | None]:
    """Restore a checkpoint into policy, optimizer and RNGs: (its step, the lagged snapshot)."""
    try:
        info = json.loads((path / "trainer.json").read_text())
        if type(info["step"]) is not int or info["step"] < 1:
            raise ValueError(f"trainer.json holds no step >= 1: {info['step']!r}")
        if info["processes"] != procs.size:
            raise ValueError(f"it was written by {info['processes']} processes, this run has "
                             f"{procs.size}; the RNG streams would differ")
        model.load_adapter_weights(policy, path / "adapter")
        optimizer_from_tensors(optimizer, load_file(path / "optimizer.safetensors"),
                               info["optimizer"])
        rng = load_file(path / f"rng-{procs.rank}.safetensors")
        meta = json.loads((path / f"rng-{procs.rank}.json").read_text())
        v, state, gauss = meta["python"]
        random.setstate((v, tuple(state), gauss))
        name, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((name, rng["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(rng["torch"])
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all([rng[f"cuda{i}"] for i in range(torch.cuda.device_count())
                                          if f"cuda{i}" in rng])
        lagged = path / "lagged.safetensors"
        return info["step"], load_file(lagged) if lagged.exists() else None
    except (OSError, KeyError, IndexError, TypeError, ValueError, RecursionError,
            SafetensorError) as e:      # a damaged file: any of these, never a traceback
        raise SystemExit(f"{path}: cannot resume from this checkpoint ({type(e).__name__}: "
                         f"{e})") from None


def optimizer_to_tensors(optimizer) -> tuple[dict, dict]:
    """An optimizer's state as (tensors for a safetensors file, the rest for JSON)."""
    sd, tensors, scalars = optimizer.state_dict(), {}, {}
    for idx, state in sd["state"].items():
        for k, v in state.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_tensors(optimizer, tensors: dict, meta: dict):
    state: dict[int, dict] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def summarize(out: Path, seconds: float, args, probe_report: dict | None = None) -> dict:
    """base / selected / final held-out success on test: `selected` has the best validation
    success (ties: the earliest); `best_on_test` picks on test itself, the paper's protocol."""
    evals = read_jsonl(out / "eval.jsonl")
    base = next((e for e in evals if e["step"] == 0), None)
    ckpts = [e for e in evals if e["step"] > 0]

    def on_test(e):
        return None if e is None else {"step": e["step"], "val": e["val"]["success"],
                                       **{k: v for k, v in e["test"].items() if k != "scores"}}

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
    if probe_report is not None:
        summary["probe_auroc_heldout"] = pair.report_summary(probe_report, args.reward)
    return summary


def summary_text(s: dict) -> str:
    b, sel, last, best = (s[k] for k in ("base", "selected", "final", "best_on_test"))
    lines = [f"done in {s['seconds']:.0f}s (reward {s['reward']})."]
    if b and sel:
        lines.append(f"held-out success (greedy, {b['episodes']} test episodes): before "
                     f"{b['success']:.3f} -> selected {sel['success']:.3f} (step {sel['step']}, "
                     f"chosen on validation) -> final {last['success']:.3f} (step {last['step']});"
                     f" best on test {best['success']:.3f} (step {best['step']}, the paper's "
                     "protocol)")
    if p := s.get("probe_auroc_heldout"):
        lines.append(f"PAIR AUROC on {p['turns']} held-out own turns: {num(p['pair'])} "
                     f"({p['corpus']} corpus); contaminated-corpus PAIR: "
                     f"{num(p['contaminated_corpus_pair'])}")
    lines.append(f"run: {s['out']} (metrics.jsonl, eval.jsonl, summary.json; `python -m "
                 "lab.curves` draws them)")
    if s["selected_adapter"]:
        lines.append(f"selected adapter (PEFT layout): {s['selected_adapter']}")
    return "\n".join(lines)


def write_json(path: Path, obj, indent: int = 1) -> None:
    model.write_atomic(path, json.dumps(obj, indent=indent) + "\n")


def num(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv, pair.REWARDS)
    hook("check", args)             # the lab's rules between flags, which need the rewards
    try:
        return train(args)
    except (model.CheckpointError, envs.DataError, probes.FormatError, envs.LLMError,
            OSError) as e:
        hook("failed", args)
        sys.exit(f"error: {e}")         # bad input: one clear line naming the file
    except SystemExit:                  # refused with one line: no run left behind either
        hook("failed", args)
        raise
    except KeyboardInterrupt:           # what Ctrl-C leaves, and the command that goes on
        again = [*argv] + ([] if "--out" in argv else ["--out", args.out])
        if not (Path(args.out) / "args.json").is_file():
            sys.exit(f"\ninterrupted before the run started; start it with: {PROG} "
                     f"{shlex.join(again)}")
        again += [] if "--resume" in argv or "--resume-if-present" in argv else ["--resume"]
        ckpt = latest_checkpoint(Path(args.out))
        what = f"; the run resumes from its last checkpoint ({ckpt.name}), exactly," if ckpt else \
            (f" before the first checkpoint (after step {min(args.save_every, args.steps)}): no "
             "step is kept, and this starts the run over from step 1:")
        sys.exit(f"\ninterrupted{what} with: {PROG} {shlex.join(again)}")


if __name__ == "__main__":
    main()
