"""Multi-turn GRPO with LoRA and step-level rewards (METHOD.md §9): the algorithm, top to bottom.

    python grpo.py --reward pair                   # shop, built-in policy, PAIR fitted on the fly
    python grpo.py --reward outcome --out runs/o   # the sparse baseline, same budget
    python grpo.py --env gta --model Qwen/Qwen2.5-7B-Instruct --probes runs/pair-gta --reward pair
    torchrun --nproc_per_node 2 grpo.py ...        # prompts sharded, LoRA gradients all-reduced
    python grpo.py compare ...                     # rewards x seeds -> the table (compare.py)

What runs, once per training step:
 1. rollout (rollout.py). `--batch` prompts x `--group` G rollouts (paper: 1 x 4). A rollout plays
    up to --max-turns assistant turns (paper: 10) in an environment; the G rollouts of one
    prompt are one batch whose KV cache lives for the whole episode, and the per-turn statistics
    every internal reward reads (hidden states and the attention statistics of METHOD.md §4) come
    out of that same generation pass (model.generate -> model.accumulate): no second forward for
    PAIR.
 2. rewards (section 2). One reward r_{i,t} per assistant turn t of rollout i, from `--reward`
    (the REWARDS dict). PAIR: each turn's s_final from its two stages (pair.Pair.scores), then the
    rollout's rewards from them (pair.trajectory_rewards). `labels` (built-in worlds): each
    turn's exact step label. `--outcome-weight w` adds w x task score to the last turn's reward.
 3. advantages (section 3: `group_advantages`, DeepSeekMath process supervision). The group's
    step rewards are pooled and normalized, r^ = (r - mean) / (std + 1e-6) with the population
    std, and every token of turn t gets A_{i,t} = sum_{k>=t} r^_{i,k}. With `outcome` the only
    reward of a rollout is its task score, on its last turn, so this is the usual
    group-normalized outcome on every token. A group whose rewards are all equal has nothing to
    say: A = 0, counted in `frac_zero_std`. `--advantage release` takes the authors' release
    instead (`release_advantages`, `release_loss`): A_{i,t} = r_{i,t} - mean_t r_{i,.} + z_i,
    z_i the group-normalized total reward of rollout i, and a loss in which every turn, not
    every token, weighs the same. `--advantage position` subtracts the group's mean at each turn
    index first (`position_advantages`); `--advantage outcome-turn` gives every token the
    outcome's group advantage plus lambda x its turn's own centred reward
    (`outcome_turn_advantages`). On the built-in worlds the chosen form is scored before
    training (`premise_gate`): does its advantage rank the right decision above the slip?
 4. update (section 4: `grpo_loss`, `update`). Per policy token:
    -min(rho A, clip(rho, 1-eps, 1+eps) A) + beta KL_k3(pi || pi_ref), rho = exp(logp -
    logp_old), KL_k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1, pi_ref = the same model with
    its LoRA adapter disabled. Only the policy's own tokens count (prompt and observations are
    masked; the <|im_end|> it generated counts); their sum is divided by the number of such
    tokens in the whole batch, over all processes. AdamW on the LoRA parameters (r 16, alpha 32,
    dropout 0.05 - 0 on the built-in worlds - on q,k,v,o,gate,up,down), lr constant after a 5%
    linear warmup, grad-norm clip 1.0. Probes stay frozen (unless --probe-retrain-every fits the
    head again). A batch without a single policy token (every prompt longer than --max-len)
    makes no update, logs loss 0 and is counted in `empty_batch`.
Section 5 is the training loop: the steps, the checkpoints and the evaluations around them.

Where this departs from textbook GRPO (DeepSeekMath; TRL's GRPOTrainer):
 - One PPO epoch per batch, as the paper ran it: pi_old is the policy that sampled, rho = 1 in
   value (its gradient is the plain policy gradient) and the clip never fires. `--ppo-epochs K`
   re-uses the batch K times, and then the clip does its job.
 - logp_old is the first epoch's own forward, detached, rather than a separate forward: exact,
   since the parameters have not moved yet (TRL does the same).
 - Token-level normalization over the whole batch (METHOD.md §9; DAPO / Dr. GRPO) instead of a mean
   per sequence, which would weight the tokens of short rollouts more.
 - Rewards live on turns, not sequences, and A is a per-turn return of normalized step rewards.
 - The KL reference is the adapter-disabled base: no second copy of the model in memory.
 - log pi is taken at the sampling temperature (logits / T), so that rho and the KL are about the
   distribution the tokens were drawn from (T = 1 in the paper, where this changes nothing);
   `--advantage release` takes it at T = 1 whatever the sampling temperature, as the release.

What this file leaves to others: the paper's other rewards and the two tree searches, which
change steps 1, 3 and 4 (Tree-GRPO, AT²PO), are in baselines.py; the probes of the built-in
policy, fitted on its own turns, in onpolicy.py; the flags and their presets (the paper's Table
grpo_config, and a tiny preset for the built-in policy), torchrun, checkpoints and exact resume,
the held-out evaluation and the summary in runs.py; the comparison across rewards and seeds in
compare.py.

Every checkpoint (`--save-every`, and the last step) stores the adapter in PEFT's layout, the
optimizer, the RNG states and the step, atomically; `--resume` continues from the newest one and
gives the same metrics as a run that was never interrupted. The base model and every checkpoint
are evaluated with greedy decoding on two held-out splits: validation, which selects the
checkpoint, and test, on which it is reported (the paper picks the best checkpoint on test
itself; `best_on_test` keeps that number, labelled). Metrics go to OUT/metrics.jsonl (one line
per step), OUT/eval.jsonl (per evaluation, with every episode's score) and OUT/summary.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import baselines
import chat_api
import common
import envs
import model
import onpolicy
import pair
import probes
import runs
import shop
import weights
from rollout import Trajectory, rollout

ROOT = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------
# 2. Rewards: one per assistant turn; `--reward` name -> function(trajectory, ctx)
# ---------------------------------------------------------------------------------------------
# Each function returns a list with one entry per turn: a float reward, or None for a turn that
# gets no reward (outcome: every turn but the last). The ones that read a frozen probe (READS_PROBE)
# return (rewards, P(correct) of each turn): train_step checks the probe against the labels.

@dataclass
class RewardContext:                # what the reward functions need besides the rollout
    policy: model.Transformer
    tok: model.Tokenizer
    args: argparse.Namespace
    env: envs.Env | None = None     # the training environment (gold answers for igpo / tips)
    pair: pair.Pair | None = None           # reward "pair"
    probe: probes.Probe | None = None           # the probe of the feature set named by --reward
    judge: chat_api.ChatClient | None = None        # reward "llm_judge"
    lagged: dict[str, torch.Tensor] | None = None   # tips: the lagged teacher's LoRA parameters
    probe_report: dict | None = None    # shop: the fitted probes' AUROC on held-out own turns
    gate: dict | None = None            # shop: the advantage's AUROC there (premise_gate)
    cost: Counter = field(default_factory=Counter)  # this step's extra work (COSTS)

    def use_head(self, head) -> None:
        """Read `head` from now on (--probe-retrain-every): a pair.Pair or a probes.Probe."""
        if isinstance(head, pair.Pair):
            self.pair = head
        else:
            self.probe = head


def outcome_reward(traj: Trajectory, ctx) -> list[float | None]:
    return [None] * (len(traj.steps) - 1) + [traj.score]


def labels_reward(traj: Trajectory, ctx) -> list[float]:
    # the built-in worlds' exact step labels (1 right, 0 wrong): the perfect process reward, the
    # ceiling every dense reward is measured against
    return [float(ok) for ok in traj.episode.labels()]


def pair_reward(traj: Trajectory, ctx) -> tuple[list[float], list[float]]:
    return pair_from_features(turn_features(traj), ctx)


def pair_from_features(features: dict[str, torch.Tensor], ctx) -> tuple[list[float], list[float]]:
    # METHOD.md §6-7: each turn's s_final from the two stages (paper Eq. stage1, stage2), then the
    # rollout's rewards from them (Appendix reward: temperature clip, momentum)
    _, s_final = ctx.pair.scores(features)
    s_final = s_final.tolist()
    return pair.trajectory_rewards(s_final, ctx.args.alpha), s_final


def probe_reward(traj: Trajectory, ctx) -> tuple[list[float], list[float]]:
    return probe_from_features(turn_features(traj), ctx)


def probe_from_features(features: dict[str, torch.Tensor], ctx) -> tuple[list[float], list[float]]:
    # METHOD.md §7: a probe baseline used as a reward gives r_t = its P(correct)
    p = ctx.probe.predict_proba(probes.feature(ctx.args.reward, features)).tolist()
    return p, p


def turn_features(traj: Trajectory, coe: bool = False) -> dict[str, torch.Tensor]:
    """probes.raw_features of every turn, stacked: (turns, ...) each."""
    return probes.stack_raw([probes.raw_features(step.trace, coe) for step in traj.steps])


REWARDS = {
    "outcome": outcome_reward,
    "labels": labels_reward,
    "pair": pair_reward,
    **{name: probe_reward for name in probes.FEATURES},
    "coe": baselines.coe_reward,
    "llm_judge": baselines.judge_reward,
    "igpo": baselines.igpo_reward,
    "tips": baselines.tips_reward,
    # tree search: the leaves' outcome; the advantages come from the trees (baselines.py)
    "tree_grpo": outcome_reward,
    "at2po": outcome_reward,
}
PROBE_REWARDS = set(probes.FEATURES)
READS_PROBE = {"pair"} | PROBE_REWARDS
NEEDS_STATS = {"coe"} | READS_PROBE
# the worlds whose every turn has an exact label (the tool calls re-executed): --reward labels
LABELLED_WORLDS = tuple(shop.WORLDS)


def turn_rewards(traj: Trajectory, ctx) -> tuple[list[float | None], list[float] | None]:
    """The `--reward` function, plus `--outcome-weight` x task score on the last turn; and the
    frozen probe's P(correct) of every turn when the reward reads one (else None)."""
    if not traj.steps:              # a prompt longer than --max-len: nothing was generated
        return [], None
    rewards, p_correct = REWARDS[ctx.args.reward](traj, ctx), None
    if ctx.args.reward in READS_PROBE:
        rewards, p_correct = rewards
    assert len(rewards) == len(traj.steps), (len(rewards), len(traj.steps))
    return with_outcome(rewards, traj.score, ctx.args), p_correct


def with_outcome(rewards: list[float | None], score: float, args) -> list[float | None]:
    """`--outcome-weight w`: w x the task score added to the last turn's reward."""
    w = args.outcome_weight
    if w and args.reward != "outcome":
        # a new list: a probe reward's list is also its P(correct), which the monitor scores
        rewards = rewards[:-1] + [(rewards[-1] or 0.0) + w * score]
    return rewards


def reward_context(args, policy, tok, env, world, log) -> RewardContext:
    """Load (or, on shop, fit once and cache) whatever the `--reward` function reads."""
    ctx = RewardContext(policy, tok, args, env=env)
    if args.reward == "pair" or args.reward in PROBE_REWARDS:
        if args.probes:
            where = seed_dir(Path(args.probes), log)
        elif args.env not in shop.WORLDS:
            raise SystemExit(f"--reward {args.reward} on {args.env} needs --probes DIR (train "
                             "them with `python pair.py extract` and `python pair.py train`)")
        else:                           # the built-in world: fitted once for this policy
            where, ctx.probe_report = onpolicy.shop_probes(args, policy, tok, world, log)
        if args.reward == "pair":
            found = find_pair_dir(where)
            ctx.pair = pair.Pair.load(found)
            if args.probes:             # fitted for this policy? (before any evaluation)
                pair.check_probe_model(found, policy.checkpoint_dir)
        else:
            path = where / f"{args.reward}.safetensors" if where.is_dir() else where
            if not path.is_file():
                raise SystemExit(f"--probes {where}: no probe {path.name} for --reward "
                                 f"{args.reward}")
            ctx.probe = probes.Probe.load(path)
            if args.probes:
                pair.check_probe_model(path, policy.checkpoint_dir)
            name = ctx.probe.info.get("feature")
            if name != args.reward:
                raise SystemExit(f"--probes {path}: a {name} probe, not {args.reward}")
        check_widths(ctx, policy.config, found if args.reward == "pair" else path)
    if args.reward == "llm_judge":
        try:
            ctx.judge = chat_api.ChatClient(args.judge_model)
        except chat_api.LLMError as e:
            raise SystemExit(f"--reward llm_judge: {e}") from e
    return ctx


def check_widths(ctx: RewardContext, config, where: Path):
    """The probes read features of this policy's width: a damaged or foreign probe file fails
    here, before any rollout, not at the first reward."""
    d, L, H = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    if ctx.pair is not None:
        want = {"stage1": d, "stage2": len(ctx.pair.stats) * H * L + 1}
        have = {"stage1": ctx.pair.stage1.w.numel(), "stage2": ctx.pair.stage2.w.numel()}
    else:
        want = {ctx.args.reward: probes.feature_width(ctx.args.reward, d, L, H)}
        have = {ctx.args.reward: ctx.probe.w.numel()}
    for part, n in want.items():
        if have[part] != n:
            raise SystemExit(f"{where}: the {part} probe reads {have[part]} features, this "
                             f"policy gives {n} (d={d}, L={L}, H={H}): fitted on another model, "
                             "or damaged")


def seed_dir(where: Path, log) -> Path:
    """`pair.py train --out DIR` fits every probe once per seed, into DIR/seed<S>/: take the
    smallest seed (42 with its defaults, the seed the built-in policy's probes are fitted with)
    and say so. Any other path is used as it is; --probes DIR/seed<S> takes another seed."""
    seeds = sorted((int(p.name[4:]), p) for p in (where.glob("seed*") if where.is_dir() else ())
                   if p.name[4:].isdigit() and p.is_dir())
    if not seeds:
        return where
    seed, chosen = seeds[0]
    log(f"--probes {where}: the probes of seed {seed} ({chosen}), the smallest of "
        f"{', '.join(str(s) for s, _ in seeds)}; --probes {where / 'seed<S>'} takes another",
        flush=True)
    return chosen


# Where PAIR lies inside a probes directory, first found first: the paper's training mode, the
# probes fitted on the fly, the clean_only mode
PAIR_DIRS = ("pair_mixed", "pair", "pair_clean_only")


def find_pair_dir(where: Path) -> Path:
    """The directory holding pair.json: `where` itself or one of PAIR_DIRS in it."""
    for d in (where, *(where / name for name in PAIR_DIRS)):
        if (d / "pair.json").is_file():
            return d
    raise SystemExit(f"--probes {where}: no pair.json there nor in "
                     f"{', '.join(n + '/' for n in PAIR_DIRS)} of it: train PAIR with "
                     "`python pair.py train`")


# ---------------------------------------------------------------------------------------------
# 3. Advantages (METHOD.md §9: DeepSeekMath process supervision)
# ---------------------------------------------------------------------------------------------

@dataclass
class Batch:                        # what the update consumes: rollouts right-padded into rows
    ids: torch.Tensor               # (B, T) long
    mask: torch.Tensor              # (B, T) bool: True on tokens the policy generated
    adv: torch.Tensor               # (B, T) float32: A of the turn each policy token belongs to
    lengths: list[int]              # real length of each row
    # AT²PO's turn-level objective: which turn each policy token belongs to (-1 elsewhere), and
    # 1 / (policy tokens of its trajectory), so that a trajectory's tokens weigh 1 together
    turn: torch.Tensor | None = None        # (B, T) long
    weight: torch.Tensor | None = None      # (B, T) float32
    n_seqs: int = 0                         # trajectories with at least one policy token
    # --advantage release: 1 / (policy tokens of the token's turn), and the number of turns
    per_turn: torch.Tensor | None = None    # (B, T) float32
    n_turns: int = 0


def group_advantages(rewards: list[list[float | None]]) -> tuple[list[list[float]], bool]:
    """Per-turn advantages of one group of G rollouts, and whether the group was all-equal.

    rewards[i][t] = r_{i,t} or None (turn without reward). Pool every reward of the group,
    r^ = (r - mean) / (std + 1e-6) with the population std, A_{i,t} = sum_{k>=t} r^_{i,k}.
    "All equal" allows rounding noise (std <= 1e-8): the same score summed in another order."""
    pooled = torch.tensor([r for row in rewards for r in row if r is not None], dtype=torch.float64)
    std = pooled.std(correction=0) if len(pooled) else torch.tensor(0.0)
    if std <= 1e-8:
        return [[0.0] * len(row) for row in rewards], True
    mean = pooled.mean()
    advantages = []
    for row in rewards:
        rhat = torch.tensor([0.0 if r is None else (r - mean) / (std + 1e-6) for r in row],
                            dtype=torch.float64)
        # suffix sums: the return from turn t on
        advantages.append(rhat.flip(0).cumsum(0).flip(0).tolist())
    return advantages, False


def release_advantages(rewards: list[list[float | None]]) -> tuple[list[list[float]], bool]:
    """`--advantage release`: the authors' release (its GRPO loop). Per group, z_i = the
    group-normalized total R_i = sum_t r_{i,t} (population std; only centered when the std is
    <= 1e-8), and per turn A_{i,t} = r_{i,t} - mean_t r_{i,.} + z_i: a turn is credited its
    reward against its own rollout's mean, plus the rollout's standing in the group. A turn
    without a reward counts 0. A group of one rollout is not normalized at all (A = r), as the
    release leaves it. "All equal" here means that no turn of the group gets an advantage (a
    group whose totals are equal still moves turns within each rollout)."""
    rows = [torch.tensor([0.0 if r is None else r for r in row], dtype=torch.float64)
            for row in rewards]
    if len(rows) == 1:
        advantages = [rows[0].tolist()]
    else:
        totals = torch.stack([row.sum() for row in rows])
        std = totals.std(correction=0)
        z = (totals - totals.mean()) / std if std > 1e-8 else totals - totals.mean()
        advantages = [(row - row.mean() + z_i).tolist() if len(row) else []
                      for row, z_i in zip(rows, z.tolist())]
    return advantages, all(abs(a) <= 1e-8 for row in advantages for a in row)


def position_centred(rewards: list[list[float | None]]) -> list[list[float | None]]:
    """c_{i,t} = r_{i,t} - mean_{j: r_{j,t} given} r_{j,t}: each turn's reward against the
    group's mean reward at the same turn index. A turn without a reward stays None; a turn index
    that one rollout alone reaches (or rewards) is its own mean, so it is centred to 0."""
    n = max((len(row) for row in rewards), default=0)
    at = [[row[t] for row in rewards if t < len(row) and row[t] is not None] for t in range(n)]
    mean = [sum(rs) / len(rs) if rs else 0.0 for rs in at]
    return [[None if r is None else r - mean[t] for t, r in enumerate(row)] for row in rewards]


def position_advantages(rewards: list[list[float | None]]) -> tuple[list[list[float]], bool]:
    """`--advantage position`: the per-position baseline. c_{i,t} = r_{i,t} - mean_j r_{j,t}
    (position_centred), then exactly `process` on c: pooled normalization c^ = (c - mean c) /
    (std c + 1e-6) (mean c = 0: every position is centred) and A_{i,t} = sum_{k>=t} c^_{i,k}.

    Why: under `process` most of a turn's advantage is the group's mean at its position, the
    same for every rollout (how right that kind of turn usually is), not what this rollout did.
    A turn index one rollout alone reaches gives c = 0, which still counts in the pooled std. A
    group whose rewards are equal at every position has nothing to say: A = 0, all equal."""
    return group_advantages(position_centred(rewards))


def outcome_turn_advantages(rewards: list[list[float | None]], scores: list[float],
                            lam: float) -> tuple[list[list[float]], bool]:
    """`--advantage outcome-turn`: A_{i,t} = z_i + lambda c_{i,t}. z_i = the outcome's group
    advantage, (s_i - mean_j s_j) / (std_j s_j + 1e-6) over the group's task scores s (0 when
    they are all equal): the number `process` gives every token under --reward outcome. c_{i,t}
    = the turn's own reward centred by the group's mean at its turn index (position_centred; 0
    for a turn without a reward): no sum over later turns, so a turn is credited for itself and
    never for the harder turns its right decision leads to. lambda = --turn-weight. A rollout
    that played no turn has no advantage. All equal: no turn gets an advantage."""
    z, _ = group_advantages([[s] if row else [] for row, s in zip(rewards, scores)])
    advantages = [[z_i[0] + lam * (c or 0.0) for c in row] if row else []
                  for row, z_i in zip(position_centred(rewards), z)]
    return advantages, all(abs(a) <= 1e-8 for row in advantages for a in row)


# --advantage name -> function(the group's per-turn rewards) -> (advantages, all equal); the form
# that also reads the task outcome is in `advantages`, which every caller goes through. The loss
# of each form (update): release_loss for `release`, grpo_loss for the others
ADVANTAGES = {"process": group_advantages, "release": release_advantages,
              "position": position_advantages}
OUTCOME_FORMS = ("outcome-turn",)


def advantages(rewards: list[list[float | None]], scores: list[float],
               args) -> tuple[list[list[float]], bool]:
    """One group's `--advantage`: rewards[i][t] = r_{i,t} (or None), scores[i] = rollout i's
    task score, which outcome-turn adds as a term of its own."""
    if args.advantage == "outcome-turn":
        return outcome_turn_advantages(rewards, scores, args.turn_weight)
    return ADVANTAGES[args.advantage](rewards)


def make_batch(trajs: list[Trajectory], advantages: list[list[float]], pad_id: int) -> Batch:
    """One right-padded row per token sequence; the mask covers the generated tokens only."""
    rows = [(traj, k) for traj in trajs for k in range(len(traj.segments))]
    T = max(len(traj.segments[k]) for traj, k in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    adv = torch.zeros(len(rows), T, dtype=torch.float32)
    row_of = {}
    for r, (traj, k) in enumerate(rows):
        seq = traj.segments[k]
        ids[r, :len(seq)] = torch.tensor(seq)
        row_of[id(traj), k] = r
    turn = torch.full((len(rows), T), -1, dtype=torch.long)
    weight = torch.zeros(len(rows), T, dtype=torch.float32)
    per_turn = torch.zeros(len(rows), T, dtype=torch.float32)
    n_seqs = n_turns = 0
    for traj, a in zip(trajs, advantages):
        n = sum(len(step.tokens) for step in traj.steps)
        n_seqs += n > 0
        for step, a_t in zip(traj.steps, a):
            r, (s, e) = row_of[id(traj), step.segment], step.span
            mask[r, s:e] = True
            adv[r, s:e] = a_t
            turn[r, s:e] = r * T + s           # unique in the batch: one id per (row, turn)
            weight[r, s:e] = 1.0 / n
            per_turn[r, s:e] = 1.0 / max(e - s, 1)
            n_turns += e > s
    return Batch(ids, mask, adv, [len(traj.segments[k]) for traj, k in rows], turn, weight,
                 n_seqs, per_turn, n_turns)


# The premise gate, before training (built-in worlds): a per-turn reward helps only if the
# advantage built from it credits the right decision above the slip. The reward can rank a turn
# right while the advantage does not: under `process` a turn's advantage is the sum of the
# rewards still to come, and after the right decision the later turns may be harder and score
# lower. So the chosen form's advantage is scored on the held-out own turns the probes are
# scored on (groups of --corpus-samples base-policy rollouts of validation episodes), at the
# habits' first-error turns with a clean prefix (onpolicy.habit_at): the slip against the same
# decision made right.

GATE_REWARDS = {"outcome", "labels", "pair"} | PROBE_REWARDS     # what stored_rewards computes


def stored_rewards(turns: pair.Split, ctx) -> list[float | None] | None:
    """One rollout's rewards from its stored turns (features, labels, task score), as
    turn_rewards gives them from the trajectory; None for a reward that needs more (a judge, a
    forward of the policy, trees)."""
    name, score = ctx.args.reward, float(turns.raw["score"][0])
    if name == "outcome":
        rewards = [None] * (len(turns.y) - 1) + [score]
    elif name == "labels":
        rewards = [float(y) for y in turns.y.tolist()]
    elif name == "pair":
        rewards = pair_from_features(turns.raw, ctx)[0]
    elif name in PROBE_REWARDS:
        rewards = probe_from_features(turns.raw, ctx)[0]
    else:
        return None
    return with_outcome(rewards, score, ctx.args)


def premise_gate(turns: pair.Split, ctx, at: list[str | None]) -> dict | None:
    """AUROC of the `--advantage` (and of the reward alone) for right (1) against wrong (0) at
    the first-error turns with a clean prefix: the turns where `at` names a habit and no earlier
    turn of the rollout is wrong; by habit; and on every clean-prefix turn. Each episode's
    rollouts are one group. None for a reward stored_rewards cannot compute."""
    rollout_ids = turns.raw["rollout"].tolist()
    rows = {}                                           # rollout -> its turns' row indices
    for k, r in enumerate(rollout_ids):
        rows.setdefault(r, []).append(k)
    groups = {}                                         # episode -> its rollouts
    for r, idx in rows.items():
        groups.setdefault(turns.episode_id[idx[0]], []).append(idx)
    adv = torch.full((len(turns.y),), float("nan"), dtype=torch.float64)
    reward = torch.full((len(turns.y),), float("nan"), dtype=torch.float64)
    for group in groups.values():
        rewards = [stored_rewards(turns.take(idx), ctx) for idx in group]
        if any(r is None for r in rewards):
            return None
        scores = [float(turns.raw["score"][idx[0]]) for idx in group]
        a, _ = advantages(rewards, scores, ctx.args)
        for idx, a_i, r_i in zip(group, a, rewards):
            adv[idx] = torch.tensor(a_i, dtype=torch.float64)
            reward[idx] = torch.tensor([math.nan if r is None else r for r in r_i],
                                       dtype=torch.float64)
    clean = turns.raw["distance"] < 0
    first = torch.tensor([h is not None for h in at]) & clean

    def auroc(sel, score):
        y = turns.y[sel]
        if not 0 < int(y.sum()) < len(y) or score[sel].isnan().any():
            return None
        return probes.auroc(y, score[sel])
    habits = sorted({h for h, f in zip(at, first.tolist()) if f})
    return {"advantage": ctx.args.advantage, "reward": ctx.args.reward, "groups": len(groups),
            "turns": int(first.sum()), "slips": int((turns.y[first] == 0).sum()),
            "auroc": auroc(first, adv), "reward_auroc": auroc(first, reward),
            "by_habit": {h: auroc(first & torch.tensor([x == h for x in at]), adv)
                         for h in habits},
            "clean_prefix": auroc(clean, adv)}


def log_gate(gate: dict, log) -> None:
    """The gate's line at start, and the warning when the advantage credits the slip."""
    num = common.num
    log(f"premise gate: the {gate['advantage']} advantage of --reward {gate['reward']} at the "
        f"habits' first-error turns, clean prefix ({gate['turns']} held-out turns, "
        f"{gate['slips']} slips, {gate['groups']} groups of base-policy rollouts): AUROC "
        f"{num(gate['auroc'])} (the reward alone {num(gate['reward_auroc'])}"
        + "".join(f"; {h} {num(a)}" for h, a in gate["by_habit"].items())
        + f"); on every clean-prefix turn {num(gate['clean_prefix'])}", flush=True)
    if gate["auroc"] is not None and gate["auroc"] < 0.5:
        log(f"warning: the advantage credits the slip: the {gate['advantage']} advantage ranks "
            f"the slip above the same decision made right (AUROC {gate['auroc']:.3f} on "
            f"{gate['turns']} held-out first-error turns, the reward alone "
            f"{num(gate['reward_auroc'])}): the turns that follow a decision, not the decision, "
            "set its credit (premise_gate in summary.json)", flush=True)


# ---------------------------------------------------------------------------------------------
# 4. Update: PPO-clip + k3 KL, token-normalized, AdamW on LoRA
# ---------------------------------------------------------------------------------------------

def grpo_loss(logp, logp_old, logp_ref, adv, eps: float, beta: float, n_tokens: float):
    """METHOD.md §9 loss summed over N policy tokens, divided by n_tokens (all of the batch).

    All inputs (N,). Returns (loss, sums) with sums of the per-token KL and clip indicator, so that
    micro-batches and processes add up to batch-level metrics."""
    ratio = torch.exp(logp - logp_old)                          # rho
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    d = logp_ref - logp
    kl = torch.expm1(d) - d             # k3 estimator of KL(pi || pi_ref); expm1: exact near 0
    loss = (pg + beta * kl).sum() / n_tokens
    with torch.no_grad():
        clip = ((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + eps) & (adv > 0))
        sums = {"kl": kl.sum().item(), "clip": clip.sum().item(),
                "ratio": ratio.sum().item(), "pg": pg.sum().item()}
    return loss, sums


def release_loss(logp, logp_old, logp_ref, adv, turn_weight, eps: float, beta: float,
                 n_turns: float):
    """`--advantage release`: the authors' update, each turn weighing the same. Per turn, the
    mean over its tokens of the clipped surrogate plus beta (logp - logp_ref) (the release's KL
    estimate, the mean log-ratio to the adapter-disabled model); then the mean over the batch's
    turns. turn_weight (N,) = 1 / (tokens of the token's turn). At one PPO epoch rho = 1 in
    value and this is the release's REINFORCE step, gradient for gradient:
    -(1 / n_turns) sum_turns (A mean_t grad log pi_t - beta mean_t grad(log pi_t - log pi_ref,t)).
    (The logged loss is -(A - beta KL) per turn, where the release logs -(A mean log pi - ...).
    The logged KL is the k3 estimate, as grpo_loss logs it, so that the two forms compare.)"""
    ratio = torch.exp(logp - logp_old)                          # rho
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
    loss = ((pg + beta * (logp - logp_ref)) * turn_weight).sum() / n_turns
    with torch.no_grad():
        d = logp_ref - logp
        clip = ((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + eps) & (adv > 0))
        sums = {"kl": (torch.expm1(d) - d).sum().item(), "clip": clip.sum().item(),
                "ratio": ratio.sum().item(), "pg": pg.sum().item()}
    return loss, sums


def lr_at(step: int, args) -> float:
    """Constant lr after a linear warmup over the first `--warmup` fraction of the steps."""
    warm = max(1, round(args.warmup * args.steps))
    return args.lr * min(1.0, (step + 1) / warm)


def micro_batches(lengths: list[int], rows: int, tokens: int) -> list[list[int]]:
    """Consecutive rows in groups of at most `rows` rows and `tokens` padded tokens (rows x the
    longest), so that the update's memory is bounded whatever the rollouts' lengths; a row
    longer than `tokens` goes alone (a row is bounded by --max-len)."""
    chunks, longest = [], 0
    for r, n in enumerate(lengths):
        longest = max(longest, n)
        if chunks and len(chunks[-1]) < rows and (len(chunks[-1]) + 1) * longest <= tokens:
            chunks[-1].append(r)
        else:
            chunks.append([r])
            longest = n
    return chunks


def update(policy, optimizer, batch: Batch, args, world) -> dict:
    """`--ppo-epochs` passes over the batch in micro-batches; one AdamW step per pass."""
    params = [p for p in policy.parameters() if p.requires_grad]
    n_tokens, n_seqs, n_turns = runs.all_sum(world, [batch.mask[:, 1:].sum().item(),
                                                     batch.n_seqs, batch.n_turns])
    if n_tokens == 0:
        # no rollout generated a token (every prompt outgrew --max-len): the loss would be 0/0,
        # and an AdamW step on zero gradients would still move the adapter by its momentum
        return {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio": 0.0, "grad_norm": 0.0,
                "tokens": 0, "empty_batch": 1, "skipped_updates": 0}
    chunks = micro_batches(batch.lengths, args.micro_batch, args.micro_batch_tokens)
    dev = model.input_device(policy)
    # log pi at the sampling temperature: the distribution the tokens were drawn from. The
    # release takes the model's own (T = 1) whatever it sampled at; `release` does as it does.
    temperature = 1.0 if args.advantage == "release" else args.temperature
    ref, old, skipped = {}, {}, 0
    for epoch in range(args.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "kl": 0.0, "clip": 0.0, "ratio": 0.0, "pg": 0.0}
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
            if args.reward == baselines.AT2PO:
                sel = mask[:, 1:]
                loss, s = baselines.turn_loss(logp, old[c], ref[c], adv,
                                              batch.turn[rows_c, 1:T][sel].to(dev),
                                              batch.weight[rows_c, 1:T][sel].to(dev),
                                              args.at2po_clip, args.beta, n_tokens, n_seqs)
            elif args.advantage == "release":
                loss, s = release_loss(logp, old[c], ref[c], adv,
                                       batch.per_turn[rows_c, 1:T][mask[:, 1:]].to(dev),
                                       args.eps, args.beta, n_turns)
            else:
                loss, s = grpo_loss(logp, old[c], ref[c], adv, args.eps, args.beta, n_tokens)
            loss.backward()
            sums["loss"] += loss.item()
            for k in ("kl", "clip", "ratio", "pg"):
                sums[k] += s[k]
        for p in params:               # processes with fewer tokens still join the all-reduce
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if world.size > 1:
            for p in params:
                dist.all_reduce(p.grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip).item()
        if math.isfinite(grad_norm):
            optimizer.step()
        else:       # a NaN or inf reached the gradient: a step on it would ruin the adapter
            skipped += 1
        if epoch == 0:
            first = runs.all_sum(world, [sums[k] for k in ("loss", "kl", "clip", "ratio")])
    loss, kl, clip, ratio = first
    return {"loss": loss, "kl": kl / max(n_tokens, 1), "clip_frac": clip / max(n_tokens, 1),
            "ratio": ratio / max(n_tokens, 1), "grad_norm": grad_norm, "tokens": int(n_tokens),
            "empty_batch": 0, "skipped_updates": skipped}


# ---------------------------------------------------------------------------------------------
# 5. The training loop: steps of rollout -> rewards -> advantages -> update, checkpoints between
# ---------------------------------------------------------------------------------------------

def prompt_index(seed: int, g: int, n: int) -> int:
    """The training episode of the g-th prompt of the run: a fresh permutation every pass."""
    epoch, k = divmod(g, n)
    return int(np.random.default_rng([seed, epoch]).permutation(n)[k])


def sampler(policy, seed: int, g: int) -> torch.Generator:
    # One generator per prompt, seeded by its number in the run: the rollouts do not depend on how
    # prompts are sharded over processes, nor on where a run was resumed.
    device = policy.lm_head.weight.device
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + g)


def seed_all(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# seconds per step; t_reward includes t_base_read, the extra forward of --probe-reads base
TIMING = ("t_rollout", "t_reward", "t_update", "t_base_read")


# what a step cost besides time, summed over processes: tokens sampled and turns played (chains
# and branches), sibling rollouts of tree search, sequences and tokens teacher-forced by the
# reward (igpo, tips, --probe-reads base), calls to an external judge
COSTS = ("gen_tokens", "gen_turns", "branch_rollouts", "branch_tokens", "tf_rows", "tf_tokens",
         "external_calls")


@dataclass
class Training:                     # what the training loop reads; setup() builds it once
    policy: model.Transformer
    tok: model.Tokenizer
    env: envs.Env                   # the training environment ...
    pool: list[int]                 # ... and the indices of its episodes the prompts come from
    held: dict                      # the held-out splits, {"val": (env, pool), "test": ...}
    ctx: RewardContext
    optimizer: torch.optim.Optimizer
    args: argparse.Namespace
    world: runs.World
    out: Path                       # the run directory
    log: object                     # print on the main process, silent elsewhere


@dataclass
class Group:                        # one prompt's rollouts, rewarded, with their advantages
    trajs: list[Trajectory]
    rewards: list[list[float | None]]
    p_correct: list                 # per rollout, the frozen probe's P(correct) per turn, or None
    advantages: list[list[float]]
    all_equal: bool                 # no turn got an advantage: nothing to learn from (process:
                                    # every reward equal; release: equal totals still move turns)


def play_group(g: int, run: Training, t: dict) -> tuple[Group, int]:
    """The g-th prompt of the run: its G rollouts (with tree search: its trees' leaves), their
    rewards and their advantages; and the bytes of KV cache they held. Adds the seconds spent
    to t (TIMING) and the work done to run.ctx.cost (COSTS)."""
    policy, tok, ctx, args = run.policy, run.tok, run.ctx, run.args
    t0 = time.perf_counter()
    index = run.pool[prompt_index(args.seed, g, len(run.pool))]
    generator = sampler(policy, args.seed, g)
    caches, forest = [], None
    if args.reward in baselines.TREE_SEARCH:
        forest = baselines.plant(policy, tok, lambda: run.env.episode(index), args, generator)
    else:
        # G fresh copies of the same episode: the group GRPO compares
        episodes = [run.env.episode(index) for _ in range(args.group)]
        trajs = rollout(policy, tok, episodes, args, generator=generator, caches=caches,
                        stats=args.reward in NEEDS_STATS and args.probe_reads == "policy")
    t1 = time.perf_counter()
    if forest is not None:          # the sibling rollouts: the price of the trees' credit
        baselines.expand(policy, tok, lambda: run.env.episode(index), forest, args, generator)
        trajs = forest.leaves
        caches = list({id(c): c for c, _ in forest.caches.values()}.values())
        ctx.cost.update(branch_rollouts=forest.branch_rollouts,
                        branch_tokens=forest.branch_tokens)
    tb = time.perf_counter()
    if args.reward in NEEDS_STATS and args.probe_reads == "base":
        read_from_base(policy, trajs, args.micro_batch, ctx.cost)
    t2 = time.perf_counter()
    r, p = zip(*[turn_rewards(traj, ctx) for traj in trajs])
    if forest is not None:
        a, all_equal = baselines.TREE_SEARCH[args.reward](forest)
    t3 = time.perf_counter()
    t["t_rollout"] += t1 - t0
    t["t_base_read"] += t2 - tb
    t["t_reward"] += t3 - t1
    if forest is None:
        a, all_equal = advantages(list(r), [traj.score for traj in trajs], args)
    # every turn once: a tree's shared turns count where they were generated
    played = [n.step for n in forest.node_of.values()] if forest is not None else \
        [st for traj in trajs for st in traj.steps]
    ctx.cost.update(gen_turns=len(played), gen_tokens=sum(len(st.tokens) for st in played))
    kv_bytes = sum(c.k.nbytes + c.v.nbytes for cache in caches for c in cache)
    return Group(list(trajs), list(r), list(p), a, all_equal), kv_bytes


def train_step(step: int, run: Training) -> dict:
    """One GRPO step: this process's share of the prompts, then the all-reduced update.

    With --oversample K (DAPO's dynamic sampling) up to K x its share of prompts are played, in
    order, and a group with no advantage to give (Group.all_equal) is set aside while later
    prompts remain: with a sparse reward most groups are such groups."""
    policy, args, world = run.policy, run.args, run.world
    t = {k: 0.0 for k in TIMING}
    run.ctx.cost = Counter(dict.fromkeys(COSTS, 0))
    kv_bytes, on_cuda = 0, model.input_device(policy).type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(model.input_device(policy))
    policy.eval()
    need = len(range(world.rank, args.batch, world.size))
    kept, tried, zero = [], 0, 0
    candidates = list(range(world.rank, args.batch * args.oversample, world.size))
    for n, j in enumerate(candidates):
        if len(kept) == need:
            break
        group, kv = play_group(step * args.batch * args.oversample + j, run, t)
        kv_bytes, tried, zero = max(kv_bytes, kv), tried + 1, zero + group.all_equal
        if group.all_equal and len(candidates) - n - 1 >= need - len(kept) and args.oversample > 1:
            continue                    # set aside: enough prompts remain to fill the batch
        kept.append(group)
    t0 = time.perf_counter()
    trajs = [traj for group in kept for traj in group.trajs]
    advs = [a for group in kept for a in group.advantages]
    policy.train()
    stats = update(policy, run.optimizer, make_batch(trajs, advs, run.tok.pad_id), args, world)
    policy.eval()
    t["t_update"] = time.perf_counter() - t0
    if args.probe_retrain_every:        # the next refit's turns, kept until no resume needs them
        onpolicy.save_step_turns(run.out, step + 1, world.rank, trajs)
    memory = {"mem_kv_mb": kv_bytes / 2**20}
    if on_cuda:
        memory["mem_cuda_peak_mb"] = torch.cuda.max_memory_allocated(
            model.input_device(policy)) / 2**20
    return step_metrics(step, trajs, [g.rewards for g in kept],
                        [p for g in kept for p in g.p_correct], (zero, tried), stats,
                        [t[k] for k in TIMING], args, world,
                        [run.ctx.cost[k] for k in COSTS], memory)


def refit_head(run: Training, step: int) -> dict:
    """--probe-retrain-every N, after step `step`: the head the reward reads fitted again on the
    policy's own turns of the last N steps (onpolicy.refit), saved in the run directory; what
    it did, for metrics.jsonl. Every process fits the same head from the same files."""
    args, ctx, world = run.args, run.ctx, run.world
    t0, every = time.perf_counter(), args.probe_retrain_every
    runs.barrier(world)                 # every process's turns of this step are written
    window = onpolicy.load_window(run.out, range(step - every + 1, step + 1), world.size)
    head = ctx.pair if ctx.pair is not None else ctx.probe
    new, rep = onpolicy.refit(head, window, onpolicy.PROBE_SEED + step)
    what = "PAIR's stage 2" if ctx.pair is not None else f"the {args.reward} probe"
    if new is None:
        why = "no turn was played" if not rep["turns"] else \
            f"their {rep['turns']} turns are all {'right' if rep['correct'] else 'wrong'}"
        run.log(f"refit: {what} kept, steps {step - every + 1}-{step}: {why}", flush=True)
    else:
        if world.main:
            onpolicy.save_head(new, onpolicy.head_dir(run.out, step))
        ctx.use_head(new)
        run.log(f"refit: {what} fitted again on the {rep['turns']} own turns of steps "
                f"{step - every + 1}-{step} ({rep['correct']} right), AUROC on them "
                f"{rep['auroc_before']:.3f} -> {rep['auroc_after']:.3f}", flush=True)
    runs.barrier(world)
    return {**{f"refit_{k}": v for k, v in rep.items()}, "t_refit": time.perf_counter() - t0}


def read_from_base(policy, trajs: list[Trajectory], rows_per_forward: int,
                   cost: Counter | None = None) -> None:
    """--probe-reads base: every turn's statistics from its tokens teacher-forced through the
    frozen base (adapter off) instead of the generation pass. The probe then reads the
    representation it was fitted on however far the policy drifts: a policy cannot move its
    own hidden states to please it."""
    seqs, spans, steps = [], [], []
    for traj in trajs:
        for step in traj.steps:
            seqs.append(traj.segments[step.segment][:step.span[1]])
            spans.append(step.span)
            steps.append(step)
    if cost is not None:
        cost.update(tf_rows=len(seqs), tf_tokens=sum(map(len, seqs)))
    with model.lora_disabled(policy):
        traces = model.trace_batch(policy, seqs, spans, rows_per_forward=rows_per_forward)
    for step, trace in zip(steps, traces):
        step.trace = trace


def step_metrics(step, trajs, rewards, p_correct, played, stats, times, args, world, costs=(),
                 memory=None) -> dict:
    """One metrics.jsonl record, summed over processes (memory: the largest). played = (groups
    with no advantage to give (Group.all_equal), groups played); the rest is about the groups
    kept for the update. p_correct: per trajectory, the frozen probe's P(correct) of each turn
    (or None)."""
    zero, tried = played
    flat = [r for group in rewards for row in group for r in row if r is not None]
    M = args.max_turns
    turn_sum, turn_n, reached = [0.0] * M, [0] * M, [0] * M
    for group in rewards:
        for row in group:
            for t, r in enumerate(row):
                reached[t] += 1
                if r is not None:
                    turn_sum[t] += r
                    turn_n[t] += 1
    sums = runs.all_sum(world, [len(flat), sum(flat), sum(r * r for r in flat), len(trajs),
                           sum(t.score for t in trajs), sum(len(t.steps) for t in trajs),
                           sum(t.truncated for t in trajs), zero, tried, *times,
                           *turn_sum, *turn_n, *reached, *costs])
    n, s, s2, n_traj, score, turns, trunc, zero, n_groups = sums[:9]
    k = 9 + len(TIMING)
    times = sums[9:k]
    turn_sum, turn_n, reached = sums[k:k + M], sums[k + M:k + 2 * M], sums[k + 2 * M:k + 3 * M]
    costs = sums[k + 3 * M:]
    mean = s / max(n, 1)
    rec = {"step": step + 1, "lr": lr_at(step, args),
           "reward_mean": mean, "reward_std": math.sqrt(max(s2 / max(n, 1) - mean * mean, 0.0)),
           "success": score / max(n_traj, 1), "frac_zero_std": zero / max(n_groups, 1),
           "groups_played": int(n_groups),
           **stats, "turns": turns / max(n_traj, 1), "truncated": int(trunc),
           # mean reward of turn t over the rollouts that reached it (None: no reward there)
           "turn_rewards": [turn_sum[t] / turn_n[t] if turn_n[t] else None
                            for t in range(M) if reached[t]]}
    # drift / reward-hacking monitor: the frozen probe against the exact step labels (shop)
    if ctx_has_probe(args):
        pairs = [(p, float(lab)) for t, ps in zip(trajs, p_correct) if ps is not None
                 for p, lab in zip(ps, t.episode.labels() or [])]
        size = args.batch * args.group * M
        p = runs.gather_floats(world, [x for x, _ in pairs], size)
        y = runs.gather_floats(world, [y for _, y in pairs], size)
        rec["probe_auroc"] = probes.auroc(y, p) if 0 < sum(y) < len(y) else None
    for name, t in zip(TIMING, times):
        rec[name] = t / world.size
    rec.update({name: int(c) for name, c in zip(COSTS, costs)})
    for name, v in (memory or {}).items():
        rec[name] = round(runs.all_max(world, v), 3)
    return rec


def ctx_has_probe(args) -> bool:
    # probe rewards and PAIR score every turn; only shop knows the exact labels to check them on
    return args.env in shop.WORLDS and (args.reward == "pair" or args.reward in PROBE_REWARDS)


CHANCE_WINDOW = 5       # steps the drift monitor's alarm averages over


def below_chance(aurocs: list) -> float | None:
    """The drift monitor's alarm: the mean probe AUROC of the last CHANCE_WINDOW steps when it
    is below chance (the frozen probe now ranks the run's wrong turns above its right ones, so
    its reward favours them), else None."""
    recent = [a for a in aurocs[-CHANCE_WINDOW:] if a is not None]
    mean = sum(recent) / CHANCE_WINDOW
    return mean if len(recent) == CHANCE_WINDOW and mean < 0.5 else None


def setup(args) -> Training:
    """Everything a run reads, each input checked before the run directory is written: the
    processes, the presets, the policy with a fresh adapter, the environment and its held-out
    splits, the reward's probes or judge, the optimizer."""
    world = runs.init_world(args)
    runs.resolve_preset(args, world)
    if args.batch % world.size:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {world.size} processes")
    if args.threads:
        torch.set_num_threads(args.threads)
    # OUT is checked read-only first, so that a --resume mistake costs no model load.
    runs.check_out(args)
    runs.barrier(world)     # every process reads OUT as it was before any of them writes
    log = print if world.main else (lambda *a, **k: None)
    seed_all(args.seed)
    devices = args.devices.split(",") if args.devices else (
        [world.device] if world.device != "cpu" else None)
    builtin = shop.BUILTIN_POLICIES.get(args.env, shop.BUILTIN_POLICY)
    if Path(args.model).resolve() == builtin.resolve() and not builtin.is_dir():
        how = f"build it with `python shop.py sft --out {builtin}`" if args.env == "shop" else \
            "build it with the two commands of README.md, \"The long-horizon world\""
        sys.exit(f"--model: the built-in policy {builtin} is missing; {how}")
    policy, tok = model.load_model(args.model, dtype=model.DTYPES[args.dtype], devices=devices)
    # apply_lora freezes the base: only the adapter is trained (and all-reduced)
    model.apply_lora(policy, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                     targets=tuple(args.lora_targets.split(",")))
    env = runs.make_env(args, "train")
    held, pool = runs.eval_splits(args, env, runs.scorable(env))
    if not pool or not all(p for _, p in held.values()):
        raise SystemExit(f"--env {args.env}: no scorable episode in the train, validation or "
                         "test split")
    # a turn that might not fit ends a rollout: with no room for the first, a run learns nothing
    prompt = len(tok.render(env.episode(pool[0]).messages, add_generation_prompt=True)[0])
    if prompt + args.max_new_tokens > args.max_len:
        raise SystemExit(f"--max-len {args.max_len}: a task's prompt alone is {prompt} tokens "
                         f"and a turn needs --max-new-tokens {args.max_new_tokens} more, so no "
                         "rollout could play its first turn")
    # Probes fitted on the fly take minutes on a first run: OUT is claimed before them, so that
    # a busy OUT is refused at once. Given probes and the judge's key are checked before OUT.
    fit_later = ctx_has_probe(args) and not args.probes
    ctx = None if fit_later else reward_context(args, policy, tok, env, world, log)
    out = runs.prepare_out(args, world)
    ctx = ctx or reward_context(args, policy, tok, env, world, log)
    if args.env in shop.WORLDS and args.reward in GATE_REWARDS:
        turns = onpolicy.heldout_turns(args, policy, tok, world, log)
        ctx.gate = premise_gate(turns, ctx, onpolicy.habit_at(turns))
        if ctx.gate is not None:
            log_gate(ctx.gate, log)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    n_lora = sum(p.numel() for p in params)
    log(f"policy {args.model}: {sum(p.numel() for p in policy.parameters()) - n_lora:,} "
        f"parameters, + {n_lora:,} in the LoRA adapter (trained); env {args.env}: {len(pool)} "
        f"training / {len(held['val'][1])} validation / {len(held['test'][1])} test episodes; "
        f"reward {args.reward}; {args.steps} steps of {args.batch} x {args.group} rollouts on "
        f"{world.size} process(es); run in {out}", flush=True)
    if args.reward in baselines.TREE_SEARCH:
        log(f"tree search instead of the {args.group} rollouts: --tree-m {args.tree_m} "
            f"--tree-n {args.tree_n} --tree-l {args.tree_l} (see baselines.py)", flush=True)
    return Training(policy, tok, env, pool, held, ctx, optimizer, args, world, out, log)


def resume(run: Training) -> int:
    """The step to start from: 0, or (--resume) the newest checkpoint's, restored. What the
    interrupted run logged after that checkpoint is dropped, to be redone exactly."""
    start, args, out = 0, run.args, run.out
    ckpt = runs.latest_checkpoint(out) if args.resume else None
    damaged = sorted(p.name for p in out.glob("checkpoint-*") if not (p / "trainer.json").is_file())
    if args.resume and ckpt is None and damaged:
        raise SystemExit(f"--resume: {out} holds {', '.join(damaged)} without trainer.json (cut "
                         "short or damaged), and no complete checkpoint: delete them to start "
                         "the run over from step 0")
    if ckpt is not None:
        start, lagged = runs.load_checkpoint(ckpt, run.policy, run.optimizer, run.world)
        if lagged is not None:
            run.ctx.lagged = lagged
        run.log(f"resumed from {ckpt} at step {start}", flush=True)
    if run.world.main and args.resume:
        common.truncate_jsonl(out / "metrics.jsonl", start)
        common.truncate_jsonl(out / "eval.jsonl", start)
    if run.world.main:                  # turns and heads of steps to be (re)done: not this run's
        onpolicy.forget_after(out, start)
    runs.barrier(run.world)
    if args.probe_retrain_every and start:      # the head the run read at its checkpoint
        head, k = onpolicy.latest_head(out, start)
        if head is not None:
            run.ctx.use_head(head)
            run.log(f"reading the head refitted after step {k} "
                    f"({onpolicy.head_dir(out, k)})", flush=True)
    return start


def evaluate_and_log(run: Training, step: int, done: set, seconds: list):
    """Evaluate the policy at `step` on the held-out splits (unless done already, or --no-eval)
    and append it to eval.jsonl. The base model's evaluation (step 0) is read from the cache when
    an earlier run of this policy made it with the same settings. `seconds`: each evaluation's
    time, which the ETA expects of the next."""
    args, world = run.args, run.world
    if args.no_eval or step in done:
        return
    t = time.perf_counter()
    cache = runs.base_eval_cache(run.policy, args, world) if step == 0 else None
    if cache is not None and cache.is_file():
        ev = json.loads(cache.read_text())
        run.log(f"base model: evaluated by an earlier run of this policy with these evaluation "
                f"settings ({cache})", flush=True)
    else:
        ev = runs.evaluate_all(step, run.policy, run.tok, run.held, args, world)
        seconds.append(time.perf_counter() - t)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            common.write_json(cache, ev)
    if world.main:
        common.append_jsonl(run.out / "eval.jsonl", ev)
    done.add(step)
    what = "base model" if step == 0 else f"step {step}"
    run.log(f"{what}: held-out success {ev['test']['success']:.3f} on {ev['test']['episodes']} "
            f"test episodes, {ev['val']['success']:.3f} on {ev['val']['episodes']} validation "
            "episodes (greedy)", flush=True)


def train(args) -> dict:
    """The run: setup, the base model's evaluation, then --steps GRPO steps with a checkpoint and
    an evaluation every --save-every steps and at the end; the summary."""
    started = time.perf_counter()
    run = setup(args)
    policy, optimizer, ctx, world, log = run.policy, run.optimizer, run.ctx, run.world, run.log
    start = resume(run)
    done, eval_seconds = {e["step"] for e in common.read_jsonl(run.out / "eval.jsonl")}, []
    evaluate_and_log(run, start, done, eval_seconds)  # base model, or a checkpoint killed early
    elapsed, aurocs, warned = [], [], False
    for step in range(start, args.steps):
        t = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        if args.reward == "tips" and step % args.tips_refresh == 0:
            ctx.lagged = model.lora_state(policy)     # the lagged teacher moves to the policy
        rec = train_step(step, run)
        if args.probe_retrain_every and (step + 1) % args.probe_retrain_every == 0:
            rec.update(refit_head(run, step + 1))
        elapsed.append(time.perf_counter() - t)
        if world.main:
            common.append_jsonl(run.out / "metrics.jsonl", rec)
        to_come = 0 if args.no_eval or not eval_seconds else eval_seconds[-1] * sum(
            s % args.save_every == 0 or s == args.steps for s in range(step + 1, args.steps + 1))
        log(runs.progress_line(rec, args.steps, elapsed, to_come), flush=True)
        if rec.get("skipped_updates"):
            log(f"warning: step {step + 1}: the gradient was not finite (a NaN or infinite "
                "reward or log-probability reached it); the adapter was not updated "
                "(skipped_updates in metrics.jsonl)", flush=True)
        aurocs.append(rec.get("probe_auroc"))
        if not warned and (mean := below_chance(aurocs)) is not None:
            warned = True
            log(f"warning: the probe ranks this run's own turns below chance (mean AUROC "
                f"{mean:.2f} over the last {CHANCE_WINDOW} steps, probe_auroc in "
                "metrics.jsonl): its reward now favours wrong turns", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            path = runs.save_checkpoint(run.out, step + 1, policy, optimizer, world, ctx.lagged)
            log(f"checkpoint {path}", flush=True)
            if args.probe_retrain_every and world.main:
                onpolicy.forget_turns(run.out, step + 1, args.probe_retrain_every)
            evaluate_and_log(run, step + 1, done, eval_seconds)
    summary = runs.summarize(run.out, time.perf_counter() - started, args, ctx.probe_report)
    if ctx.gate is not None:
        summary["premise_gate"] = ctx.gate
    if world.main:
        common.write_json(run.out / "summary.json", summary)
        common.write_atomic(run.out / "curves.svg", runs.run_curves(run.out, args.reward))
        log(runs.summary_text(summary), flush=True)
    if world.size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def check_args(args: argparse.Namespace) -> None:
    """The rules between flags that need this file's rewards (runs.parse_args checks the rest);
    compare.py applies them to every run before starting any."""
    if args.reward == "labels" and args.env not in LABELLED_WORLDS:
        sys.exit(f"--reward labels: {args.env} has no exact step labels (its replayed tools "
                 f"label only the final answer); only the built-in worlds do "
                 f"({', '.join(LABELLED_WORLDS)})")
    if args.advantage in OUTCOME_FORMS and args.reward == "outcome":
        sys.exit(f"--advantage {args.advantage} adds a dense per-turn reward to the outcome; "
                 "--reward outcome has none (its own form is --advantage process)")
    if args.advantage in OUTCOME_FORMS and args.outcome_weight:
        sys.exit(f"--outcome-weight: --advantage {args.advantage} adds the outcome's group "
                 "advantage itself; leave it at 0")
    if args.probe_retrain_every and args.reward not in READS_PROBE:
        sys.exit(f"--probe-retrain-every: --reward {args.reward} reads no probe to refit (pair or "
                 f"a probe reward: {', '.join(sorted(PROBE_REWARDS))})")
    if args.probe_retrain_every and args.env not in shop.WORLDS:
        sys.exit(f"--probe-retrain-every refits on the exact labels of the policy's own turns, "
                 f"which only the built-in world has (its tool calls re-executed); {args.env}'s "
                 "replayed tools label only the final answer")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        # `grpo.py compare` is compare.py's command line: that file runs this one, so it sits
        # above it, and the hand-over is a new program, not an import
        os.execv(sys.executable, [sys.executable, str(ROOT / "compare.py"), *argv[1:]])
    args = runs.parse_args(argv, REWARDS)
    check_args(args)
    try:
        return train(args)
    except (weights.CheckpointError, envs.DataError, probes.FormatError, chat_api.LLMError,
            FileNotFoundError) as e:
        runs.forget_failed(args.out)
        sys.exit(f"error: {e}")         # bad input: one clear line naming the file
    except SystemExit:                  # refused with one line: no run left behind either
        runs.forget_failed(args.out)
        raise
    except KeyboardInterrupt:
        sys.exit("\n" + interrupted(args, argv))


def interrupted(args, argv) -> str:
    """What Ctrl-C leaves, and the command that goes on from there: a checkpoint to resume
    from, exactly; a run with none yet, which --resume starts over from step 1; or no run."""
    out = Path(args.out)
    again = [*argv] + ([] if "--out" in argv else ["--out", args.out])
    resume = [] if "--resume" in argv or "--resume-if-present" in argv else ["--resume"]
    ckpt = runs.latest_checkpoint(out)
    if ckpt is not None:
        return (f"interrupted; the run resumes from its last checkpoint ({ckpt.name}), exactly, "
                f"with: python grpo.py {shlex.join(again + resume)}")
    if (out / "args.json").is_file():
        return (f"interrupted before the first checkpoint (after step "
                f"{min(args.save_every, args.steps)}): no step is kept, and this starts the run "
                f"over from step 1: python grpo.py {shlex.join(again + resume)}")
    return f"interrupted before the run started; start it with: python grpo.py {shlex.join(again)}"


if __name__ == "__main__":
    main()
