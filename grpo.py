"""Multi-turn GRPO with LoRA and step-level rewards (METHOD.md §9).

    python grpo.py --reward pair                   # shop, built-in policy, PAIR fitted on the fly
    python grpo.py --reward outcome --out runs/o   # the sparse baseline, same budget
    python grpo.py --env gta --model Qwen/Qwen2.5-7B-Instruct --probes runs/pair-gta --reward pair
    torchrun --nproc_per_node 2 grpo.py ...        # prompts sharded, LoRA gradients all-reduced
    python grpo.py compare --rewards outcome pair --seeds 42 43 44 --out runs/cmp   # the table
    python grpo.py compare --cost --seeds 42 --out runs/cost -- --steps 3  # Table complexity

What runs, once per training step:
 1. rollout. `--batch` prompts x `--group` G rollouts (paper: 1 x 4). A rollout plays up to 10
    assistant turns in an `envs` environment. The G rollouts of one prompt are one batch whose KV
    cache lives for the whole episode: the rendered prompt is prefilled once, and each later turn
    appends only the new tokens (the "\\n" after the <|im_end|> the model wrote, the observation as
    a user message, `<|im_start|>assistant\\n`) at the row's own offset, then samples again. The
    per-turn statistics every internal reward reads (hidden states and the attention statistics of
    METHOD.md §4) come out of that same generation pass: no second forward for PAIR or the probes.
 2. rewards. One reward r_{i,t} per assistant turn t of rollout i, from `--reward` (the REWARDS
    dict below). `--outcome-weight w` adds w x task score to the last turn's reward.
 3. advantages (DeepSeekMath process supervision). The group's step rewards are pooled and
    normalized, r^ = (r - mean) / (std + 1e-6) with the population std, and every token of turn t
    gets A_{i,t} = sum_{k>=t} r^_{i,k}. With `outcome` the only reward of a rollout is its task
    score, on its last turn, so this is the usual group-normalized outcome on every token. A group
    whose rewards are all equal has nothing to say: A = 0, counted in `frac_zero_std`.
 4. update. Per policy token: -min(rho A, clip(rho, 1-eps, 1+eps) A) + beta KL_k3(pi || pi_ref),
    rho = exp(logp - logp_old), KL_k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1, pi_ref = the
    same model with its LoRA adapter disabled. Only the policy's own tokens count (prompt and
    observations are masked; the <|im_end|> it generated counts); their sum is divided by the
    number of such tokens in the whole batch, over all processes. AdamW on the LoRA parameters
    (r 16, alpha 32, dropout 0.05 on q,k,v,o,gate,up,down), lr constant after a 5% linear warmup,
    grad-norm clip 1.0. Probes stay frozen. A batch without a single policy token (every prompt
    longer than --max-len) makes no update, logs loss 0 and is counted in `empty_batch`.

The paper's two tree-search baselines change steps 1 and 3 (section 3b states their exact rules):
`--reward tree_grpo` (Tree-GRPO) and `--reward at2po` (AT²PO) grow rollout trees whose nodes are
whole turns, branching from a copy of the parent's KV cache rows, and derive per-turn advantages
from the leaves' outcomes; AT²PO also replaces the per-token ratio of step 4 by a per-turn one.

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
   distribution the tokens were drawn from (T = 1 in the paper, where this changes nothing).

Every checkpoint (`--save-every`, and the last step) stores the adapter in PEFT's layout, the
optimizer, the RNG states and the step, atomically; `--resume` continues from the newest one and
gives the same metrics as a run that was never interrupted. The base model and every checkpoint
are evaluated with greedy decoding on two held-out splits: validation, which selects the
checkpoint, and test, on which it is reported (the paper picks the best checkpoint on test
itself; `best_on_test` keeps that number, labelled). GTA answers are matched loosely there, as
the paper evaluates, and strictly in the training reward. Metrics go to OUT/metrics.jsonl (one
line per step), OUT/eval.jsonl (per evaluation, with every episode's score) and
OUT/summary.json.

The built-in policy (data/shop-policy, rebuilt by `python shop.py sft`) is a ~0.3M
parameter Qwen2 trained from scratch on shop dialogs, then given one habit on purpose: on most
non-USD tasks it converts the wrong way round (divides by the rate), a fluent error that GRPO can
unlearn in a few steps. With it, the flags left unset take the TINY
preset below (printed at start); with any other model they take the paper's 7B values. Its PAIR
and probe rewards are fitted on the fly, once per policy and corpus, and cached under
$PAIR_CACHE: by default on the policy's own rollouts (`--probe-corpus`; shop.py fits them).
`--probe-reads base` makes the probes read every turn through the frozen base model instead of
the generation pass. `grpo.py compare` runs rewards x seeds and writes the comparison table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import envs
import model
import pair
import probes

ROOT = Path(__file__).resolve().parent
BUILTIN_POLICY = ROOT / "data" / "shop-policy"

# ---------------------------------------------------------------------------------------------
# Hyperparameters: the paper's Table grpo_config, and a preset for the tiny built-in policy
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
# decodes 128 episodes at a time (the turns of greedy rows end close together). Everything not
# listed keeps the paper's value.
TINY = dict(batch=4, group=8, max_new_tokens=96, temperature=0.7, lr=3e-4, lora_dropout=0.0,
            steps=20, save_every=10, eval_batch=128)
# What the probes of the built-in policy are fitted on (--probe-corpus; shop.py fits them)
PROBE_CORPORA = ("on-policy", "contaminated", "both")


# ---------------------------------------------------------------------------------------------
# Stages hand off through three small dataclasses: a step, a trajectory, a batch
# ---------------------------------------------------------------------------------------------

@dataclass
class Step:                         # one assistant turn of one rollout
    tokens: list[int]               # what the policy generated (ends with <|im_end|> if finished)
    segment: int                    # which of Trajectory.segments holds it ...
    span: tuple[int, int]           # ... at these positions [start, end)
    text: str                       # the assistant text handed to the environment
    trace: model.TurnTrace | None     # statistics from the generation pass (None: not collected)
    observation: str | None         # the environment's answer (None: the episode ended here)
    nll: float | None = None        # mean -log pi of its tokens as sampled (AT²PO's entropy H)


@dataclass
class Trajectory:                   # one rollout of one episode
    episode: envs.Episode
    # The tokens exactly as the model saw them. One sequence, unless the environment rewrote
    # earlier messages (ToolBench's history cap): then the cache is refilled with the new history
    # and a new segment starts, so that every turn is later scored in the context it came from.
    segments: list[list[int]] = field(default_factory=lambda: [[]])
    steps: list[Step] = field(default_factory=list)
    score: float = 0.0              # task score in [0, 1]
    truncated: bool = False         # stopped by --max-len, not by the episode


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


# ---------------------------------------------------------------------------------------------
# 1. Rollout: multi-turn, one KV cache per group kept across turns
# ---------------------------------------------------------------------------------------------

def turn_opening(tok, finished: bool, observation: str | None) -> list[int]:
    """The tokens between one assistant turn and the next: what a later turn appends to the cache.

    Exactly what the chat template puts there (METHOD.md §2): the newline after <|im_end|> (plus the
    <|im_end|> itself when the turn hit max_new_tokens), the observation as a user message, and the
    next generation prompt. Special tokens split the text, so these tokens are the ones
    Tokenizer.render gives for the whole conversation."""
    text = "\n" if finished else "<|im_end|>\n"
    if observation is not None:
        text += f"<|im_start|>user\n{observation}<|im_end|>\n"
    return tok.encode(text + "<|im_start|>assistant\n")


@torch.no_grad()
def rollout(policy, tok, episodes: list, args, greedy=False, generator=None,
            stats=True, caches: list | None = None) -> list[Trajectory]:
    """Play each episode (one batch row each) to its end; returns one Trajectory per row.
    With `caches`, the KV cache of the batch is appended to it, row i holding trajectory i's
    last segment (tree search branches from it)."""
    trajs = [Trajectory(ep) for ep in episodes]
    new = [tok.render(ep.messages, add_generation_prompt=True)[0] for ep in episodes]
    cache = policy.new_cache(len(episodes), capacity=min(
        args.max_len, max(map(len, new)) + 4 * args.max_new_tokens))     # it grows if needed
    play(policy, tok, trajs, cache, new, args, greedy, generator, stats)
    if caches is not None:
        caches.append(cache)
    return trajs


@torch.no_grad()
def play(policy, tok, trajs: list[Trajectory], cache, new: list[list[int]], args, greedy=False,
         generator=None, stats=True):
    """Continue every row to the end of its episode. Row i's cache holds traj.segments[-1]; it
    appends new[i] before its next turn (the prompt, or the rest of a branch's prefix)."""
    active = [True] * len(trajs)
    refill = [False] * len(trajs)
    for _ in range(args.max_turns - min(len(t.steps) for t in trajs)):
        for i, traj in enumerate(trajs):
            if len(traj.steps) >= args.max_turns:       # a branch that started deep in a tree
                active[i] = False
            # a turn that might not fit ends the rollout (it is scored as it stands)
            seen = 0 if refill[i] else len(traj.segments[-1])
            if active[i] and seen + len(new[i]) + args.max_new_tokens > args.max_len:
                active[i], traj.truncated = False, True
        if not any(active):
            break
        if any(a and r for a, r in zip(active, refill)):
            lengths = cache[0].lengths.clone()
            for i, traj in enumerate(trajs):
                if active[i] and refill[i]:
                    lengths[i] = 0           # the row's old slots are free: overwrite them
                    traj.segments.append([])
                    refill[i] = False
            model.set_lengths(cache, lengths)
        # a row no longer playing gets nothing appended (its cache row stays) and no trace
        traces = model.generate(policy, cache, new, max_new_tokens=args.max_new_tokens,
                              temperature=0.0 if greedy else args.temperature, top_p=args.top_p,
                              stop_ids=[tok.im_end_id], generator=generator, stats=stats,
                              active=active)
        for i, (traj, tr) in enumerate(zip(trajs, traces)):
            if tr is None:
                continue
            seq = traj.segments[-1]
            seq += new[i]
            start = len(seq)
            assert tuple(tr.span) == (start, start + len(tr.tokens)), (tr.span, start)
            seq += tr.tokens
            text = tok.decode(tr.tokens[:-1] if tr.finished else tr.tokens)
            result = traj.episode.step(text)
            obs = None if result.done else traj.episode.messages[-1]["content"]
            traj.steps.append(Step(list(tr.tokens), len(traj.segments) - 1, (start, len(seq)),
                                   text, tr if stats else None, obs,
                                   nll=-sum(tr.logprobs) / max(len(tr.logprobs), 1)))
            if result.done:
                active[i], new[i] = False, []
            elif getattr(result, "rewritten_from", None) is not None:
                new[i] = tok.render(traj.episode.messages, add_generation_prompt=True)[0]
                refill[i] = True
            else:
                new[i] = turn_opening(tok, tr.finished, obs)
    for traj in trajs:
        score = traj.episode.score()
        traj.score = 0.0 if score is None else float(score)


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
    judge: envs.ChatClient | None = None        # reward "llm_judge"
    lagged: dict[str, torch.Tensor] | None = None   # tips: the lagged teacher's LoRA parameters
    probe_report: dict | None = None    # shop: the fitted probes' AUROC on held-out own turns
    cost: dict[str, int] = field(default_factory=dict)  # this step's extra work (COSTS)


def outcome_reward(traj: Trajectory, ctx) -> list[float | None]:
    return [None] * (len(traj.steps) - 1) + [traj.score]


def pair_reward(traj: Trajectory, ctx) -> tuple[list[float], list[float]]:
    # METHOD.md §6-7: each turn's s_final from the two stages (paper Eq. stage1, stage2), then the
    # rollout's rewards from them (Appendix reward: temperature clip, momentum)
    _, s_final = ctx.pair.scores(turn_features(traj))
    s_final = s_final.tolist()
    return pair.trajectory_rewards(s_final, ctx.args.alpha), s_final


def probe_reward(traj: Trajectory, ctx) -> tuple[list[float], list[float]]:
    # METHOD.md §7: a probe baseline used as a reward gives r_t = its P(correct)
    p = ctx.probe.predict_proba(probes.feature(ctx.args.reward, turn_features(traj))).tolist()
    return p, p


def turn_features(traj: Trajectory, coe: bool = False) -> dict[str, torch.Tensor]:
    """probes.raw_features of every turn, stacked: (turns, ...) each."""
    return probes.stack_raw([probes.raw_features(step.trace, coe) for step in traj.steps])


def coe_reward(traj: Trajectory, ctx) -> list[float]:
    # CoE is unsupervised (METHOD.md §4-5): r_t = the turn's CoE-C score (the paper's baseline);
    # only its ordering within the group matters after normalization.
    return probes.unsupervised_score("coe_c", turn_features(traj, coe=True)).tolist()


def judge_reward(traj: Trajectory, ctx) -> list[float]:
    """LLM-as-a-judge (paper baseline): a 1-10 score of each step given the task and the
    trajectory up to it, from an OpenAI-compatible endpoint, normalized to [0, 1]."""
    messages = traj.episode.messages
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    count(ctx.cost, external_calls=len(turns))
    return [envs.judge_step(ctx.judge, messages[:k + 1]) for k in turns]


def count(cost: dict, **amounts):
    for k, v in amounts.items():
        cost[k] = cost.get(k, 0) + v


# --- rewards from the teacher-forced probability of the gold answer (need the answer: training
# only). A state s_t is the token prefix right before turn t's content; the gold answer is
# appended there as a final turn ("Final Answer: <gold>") and its tokens are scored. Both methods
# give the final turn the task score (IGPO's rule; TIPS adds shaping to the environment reward)
# and the turns before it a per-turn change:

def igpo_reward(traj: Trajectory, ctx) -> list[float]:
    """IGPO (Wang et al. 2025): r_t = p(gold | s_{t+1}) - p(gold | s_t), information gain of turn t,
    with p = exp(mean token log-probability) under the current policy."""
    states = traj_states(traj)
    logp, n = gold_logprobs(ctx.policy, ctx.tok, states, gold_answer(ctx, traj.episode),
                            ctx.args.micro_batch, ctx.cost)
    p = [math.exp(lp / k) for lp, k in zip(logp, n)]
    return [p[t + 1] - p[t] for t in range(len(traj.steps) - 1)] + [traj.score]


def tips_reward(traj: Trajectory, ctx) -> list[float]:
    """TIPS-style potential-based shaping: r_t = gamma Phi(s_{t+1}) - Phi(s_t), Phi = the
    log-probability of the gold answer under a lagged copy of the policy (a LoRA snapshot,
    refreshed every --tips-refresh steps). The terminal state's potential is not set to 0: with
    group-normalized returns that term would cancel the shaping signal of every turn."""
    states = traj_states(traj)
    with lora_swapped(ctx.policy, ctx.lagged):
        phi, _ = gold_logprobs(ctx.policy, ctx.tok, states, gold_answer(ctx, traj.episode),
                               ctx.args.micro_batch, ctx.cost)
    g = ctx.args.tips_gamma
    return [g * phi[t + 1] - phi[t] for t in range(len(traj.steps) - 1)] + [traj.score]


def traj_states(traj: Trajectory) -> list[list[int]]:
    """s_1 .. s_T: the prefix each turn was generated from (the first turn's is the prompt)."""
    return [traj.segments[s.segment][:s.span[0]] for s in traj.steps]


def gold_answer(ctx, episode) -> str:
    """The gold final answer of an episode: the shop world's answer, the gold dialog's last
    answer (replay environments), else the whitelist."""
    answer = getattr(getattr(episode, "task", None), "answer", None)
    if isinstance(answer, str):
        return answer
    record = getattr(ctx.env, "records", {}).get(episode.id, {})
    for m in reversed(record.get("dialogs") or []):
        if m.get("role") == "assistant" and isinstance(m.get("content"), str) and m["content"]:
            return m["content"]
    gt = getattr(episode, "gt_answer", None) or record.get("gt_answer")
    if isinstance(gt, dict) and gt.get("whitelist"):
        return ", ".join(group[0] for group in gt["whitelist"])
    raise SystemExit(f"--reward {ctx.args.reward}: episode {episode.id} has no gold answer")


@torch.no_grad()
def gold_logprobs(policy, tok, states: list[list[int]], answer: str, rows_per_forward: int,
                  cost: dict | None = None) -> tuple[list[float], list[int]]:
    """Sum of log pi(answer tokens | state, "Final Answer:") per state, and the token count.
    The teacher-forced rows and tokens are added to `cost`."""
    full = tok.encode(envs.render_final(None, answer))
    head = tok.encode("Final Answer:")
    target = full[len(head):] if full[:len(head)] == head else full
    cond = full[:len(full) - len(target)]
    seqs = [s + cond + target for s in states]
    if cost is not None:
        count(cost, tf_rows=len(seqs), tf_tokens=sum(map(len, seqs)))
    sums, dev = [], input_device(policy)
    for i in range(0, len(seqs), rows_per_forward):
        chunk = seqs[i:i + rows_per_forward]
        T = max(len(x) for x in chunk)
        ids = torch.full((len(chunk), T), tok.pad_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), T, dtype=torch.bool)
        for r, x in enumerate(chunk):
            ids[r, :len(x)] = torch.tensor(x)
            mask[r, len(x) - len(target):len(x)] = True
        lp = token_logprobs(policy, ids.to(dev), mask).view(len(chunk), len(target))
        sums += lp.sum(1).tolist()
    return sums, [len(target)] * len(states)


REWARDS = {
    "outcome": outcome_reward,
    "pair": pair_reward,
    **{name: probe_reward for name in probes.FEATURES},
    "coe": coe_reward,
    "llm_judge": judge_reward,
    "igpo": igpo_reward,
    "tips": tips_reward,
    # tree search: the leaves' outcome; the advantages come from the trees (section 3b)
    "tree_grpo": outcome_reward,
    "at2po": outcome_reward,
}
PROBE_REWARDS = set(probes.FEATURES)
READS_PROBE = {"pair"} | PROBE_REWARDS
NEEDS_STATS = {"coe"} | READS_PROBE


def turn_rewards(traj: Trajectory, ctx) -> tuple[list[float | None], list[float] | None]:
    """The `--reward` function, plus `--outcome-weight` x task score on the last turn; and the
    frozen probe's P(correct) of every turn when the reward reads one (else None)."""
    if not traj.steps:              # a prompt longer than --max-len: nothing was generated
        return [], None
    rewards, p_correct = REWARDS[ctx.args.reward](traj, ctx), None
    if ctx.args.reward in READS_PROBE:
        rewards, p_correct = rewards
    assert len(rewards) == len(traj.steps), (len(rewards), len(traj.steps))
    w = ctx.args.outcome_weight
    if w and ctx.args.reward != "outcome":
        rewards[-1] = (rewards[-1] or 0.0) + w * traj.score
    return rewards, p_correct


def reward_context(args, policy, tok, env, world, log) -> RewardContext:
    """Load (or, on shop, fit once and cache) whatever the `--reward` function reads."""
    ctx = RewardContext(policy, tok, args, env=env)
    if args.reward == "pair" or args.reward in PROBE_REWARDS:
        if args.probes:
            where = seed_dir(Path(args.probes), log)
        elif args.env != "shop":
            raise SystemExit(f"--reward {args.reward} on {args.env} needs --probes DIR (train "
                             "them with `python pair.py extract` and `python pair.py train`)")
        else:                           # the built-in world: fitted once for this policy
            import shop
            where, ctx.probe_report = shop.shop_probes(args, policy, tok, world, log, rollout)
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
    if args.reward == "llm_judge":
        try:
            ctx.judge = envs.ChatClient(args.judge_model)
        except envs.LLMError as e:
            raise SystemExit(f"--reward llm_judge: {e}") from e
    return ctx


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
    n_seqs = 0
    for traj, a in zip(trajs, advantages):
        n = sum(len(step.tokens) for step in traj.steps)
        n_seqs += n > 0
        for step, a_t in zip(traj.steps, a):
            r, (s, e) = row_of[id(traj), step.segment], step.span
            mask[r, s:e] = True
            adv[r, s:e] = a_t
            turn[r, s:e] = r * T + s           # unique in the batch: one id per (row, turn)
            weight[r, s:e] = 1.0 / n
    return Batch(ids, mask, adv, [len(traj.segments[k]) for traj, k in rows], turn, weight,
                 n_seqs)


# ---------------------------------------------------------------------------------------------
# 3b. Tree search: Tree-GRPO and AT²PO (the paper's tree-based baselines)
# ---------------------------------------------------------------------------------------------
# Both replace the G independent rollouts of a prompt by rollout trees whose nodes are whole
# agent turns (thought, action, and the observation that answers it), and both learn from the
# outcome alone: the task score of each leaf. A branch at a node keeps the turns above it and
# plays on from the exact context they left: the environment is replayed with those turns' texts
# (every environment here is deterministic, which is checked: the replayed observations must be
# the recorded ones), and the branch's KV cache row is a copy of the cache row of the rollout
# that played those turns (model.copy_rows), so the shared prefix is never prefilled again. Only
# its last token is fed once more, because its logits are where the branch's first token is
# drawn from. (A ToolBench rollout whose history was rewritten holds only its last segment in its
# cache: a branch from an earlier segment copies what the two share and prefills the rest.)
# Every root-to-leaf path is one sample of the update, the turns it shares with other paths
# included (as both releases train): make_batch gets one Trajectory per leaf.
#
# Tree-GRPO (Ji et al. 2025, arXiv 2509.21240; public code AMAP-ML/Tree-GRPO):
#   1. M trees per prompt, each grown from one chain rollout (--tree-m);
#   2. L times (--tree-l): in each tree draw N nodes (--tree-n) uniformly, with replacement, from
#      the root (the prompt: expanding it plays a fresh chain) and every turn that has a child
#      (a leaf has no turn after it to redo), and play one new branch from each, continuing
#      after that turn (the branch's first turn is the node's new child);
#   3. every leaf H gets its outcome R(H), and
#        A(H) = (R - mean_T) / (std_T + 1e-6) + (R - mean_P) / (std_P + 1e-6)
#      intra-tree over the leaves of its tree T plus inter-tree over all leaves of the prompt P
#      (the release's `adv_estimator=tree`, the paper's sum of the two). Every token of the path
#      gets A(H). Two leaves below a branching node share every turn above it, so the
#      difference of their intra-tree advantages lands on the turns below it: the siblings of that
#      node are compared (the paper shows this is step-level preference learning).
#   Choices: std is the population std, as in this file's GRPO (METHOD.md §9; the release's
#   torch.std is Bessel-corrected); a group whose leaves all scored alike gives 0 (the release
#   gives a lone leaf its raw score); every leaf is kept (the release's k samples leaves, and its
#   scripts set k to the leaf count).
#
# AT²PO (Zong et al. 2026, arXiv 2601.04767; public code zzfoutofspace/ATPO):
#   1. one tree per prompt whose root has M chain rollouts (--tree-m, the release's
#      initial_rollouts);
#   2. L times (--tree-l, expansion_iterations): score every non-leaf node n of the tree (the
#      root and every turn with a child) by its entropy minus the branching penalty,
#        score(n) = H(n) - alpha * (siblings of n),   H(n) = mean over n's tokens of -log pi,
#      (alpha = --at2po-penalty, the root's H is 0 and its "siblings" are its own children but
#      one, as in the release), take the top K (--tree-n, beam_size; fewer candidates are cycled
#      from the top), and regenerate each chosen turn: a new sibling of n, played from the
#      context n was generated in (the root: a fresh chain);
#   3. turn-wise credit assignment (the release's leaf_value_norm, node_value_mode
#      child_softmax, node_adv_mode node_value): leaf values V = (R - mean) / (std + 1e-6) over
#      the tree's leaves (population std), then bottom-up V(n) = sum_c softmax_c(H(c)) V(c) over
#      n's children c, and the advantage of every token of turn n is V(n);
#   4. the turn-level objective (the release's gspo_turn, see turn_loss): one importance ratio
#      per turn, PPO-clipped in [1 - 3e-3, 1 + 4e-3] (--at2po-clip), averaged over each
#      trajectory's tokens and then over trajectories.
#   Choices: H(n) is read from the generation pass itself (model.generate records log pi of
#   every sampled token, at the sampling temperature); the KL term stays this pipeline's
#   (k3, token mean, --beta; the release ran with its KL coefficient at 0).
#
# Budget (flags left unset; G = --group): Tree-GRPO M = G/2, N = 2, L = 1, which at the paper's
# G = 4 is the release's script (m 2, n 2, l 1: 6 leaves, 2 whole chains + 4 partial ones);
# AT²PO M = G/2, K = G/4, L = 2, so that its leaves number G, as in the release, whose group
# size is its samples per tree (10 + 2 x 6 = 22). Per step the branches are priced like a reward:
# t_rollout is the M chains, t_reward the branches plus the advantages; `branch_rollouts` and
# `branch_tokens` count them, `mem_kv_mb` is the KV cache the trees hold at once.

TREE_GRPO, AT2PO = "tree_grpo", "at2po"


@dataclass(eq=False)                # a node is itself: compared and hashed by identity
class Node:                         # one assistant turn of a rollout tree; a root is the prompt
    parent: Node | None
    step: Step | None               # None at a root
    owner: Trajectory | None        # the rollout that played this turn (its cache row holds it)
    tree: int                       # which of the prompt's trees
    depth: int = 0                  # turns from the root
    children: list[Node] = field(default_factory=list)
    value: float = 0.0              # AT²PO's V(n)


@dataclass
class Forest:                       # the rollout trees of one prompt
    roots: list[Node]
    leaves: list[Trajectory] = field(default_factory=list)  # one per root-to-leaf path
    leaf_tree: list[int] = field(default_factory=list)      # the tree of each leaf
    node_of: dict = field(default_factory=dict)     # id(Step) -> Node
    caches: dict = field(default_factory=dict)      # id(Trajectory) -> (KV cache, row)
    branch_rollouts: int = 0        # rollouts started from a copied prefix
    branch_tokens: int = 0          # the tokens they generated


def attach(forest: Forest, traj: Trajectory, parent: Node, kept: int):
    """Hang traj's turns after its first `kept` (shared with parent's path) below parent."""
    for step in traj.steps[kept:]:
        node = Node(parent, step, traj, parent.tree, parent.depth + 1)
        parent.children.append(node)
        forest.node_of[id(step)] = node
        parent = node
    forest.leaves.append(traj)
    forest.leaf_tree.append(parent.tree)


def plant(policy, tok, fresh, args, generator) -> Forest:
    """The M chain rollouts: one tree each (Tree-GRPO) or all under one root (AT²PO)."""
    caches = []
    chains = rollout(policy, tok, [fresh() for _ in range(args.tree_m)], args,
                     generator=generator, stats=False, caches=caches)
    forest = Forest([Node(None, None, None, k)
                     for k in range(args.tree_m if args.reward == TREE_GRPO else 1)])
    for i, traj in enumerate(chains):
        forest.caches[id(traj)] = (caches[0], i)
        attach(forest, traj, forest.roots[i if args.reward == TREE_GRPO else 0], 0)
    return forest


def inner_nodes(root: Node) -> list[Node]:
    """The root and every turn with a child below it, breadth first (the expandable nodes)."""
    out, queue = [], [root]
    while queue:
        node = queue.pop(0)
        if node.children:
            out.append(node)
            queue += node.children
    return out


def branch_point(node: Node, after: bool) -> tuple[Node, Trajectory, int]:
    """(parent of the new branch, a rollout holding the context, turns it keeps) for a branch
    that continues after `node` (Tree-GRPO) or regenerates it (AT²PO). A root's context is the
    prompt, held by any of its chains."""
    if node.step is None:
        return node, node.children[0].owner, 0
    if after:
        return node, node.owner, node.depth
    return node.parent, node.owner, node.depth - 1


def tree_grpo_points(forest: Forest, args, generator) -> list:
    points = []
    for root in forest.roots:
        candidates = inner_nodes(root)
        if not candidates:          # a chain that never got to play a turn: nothing to branch
            continue
        draws = torch.randint(len(candidates), (args.tree_n,), generator=generator,
                              device=generator.device).tolist()
        points += [branch_point(candidates[k], after=True) for k in draws]
    return points


def at2po_score(node: Node, alpha: float) -> float:
    """H(n) - alpha x (branches already drawn beside n), the release's expansion score."""
    if node.step is None:
        return 0.0 - alpha * max(0, len(node.children) - 1)
    return node.step.nll - alpha * max(0, len(node.parent.children) - 1)


def at2po_points(forest: Forest, args, generator) -> list:
    (root,) = forest.roots
    candidates = inner_nodes(root)
    if not candidates:
        return []
    # a stable sort: equal scores keep breadth-first order
    ranked = sorted(candidates, key=lambda n: -at2po_score(n, args.at2po_penalty))
    chosen = [ranked[k % len(ranked)] for k in range(args.tree_n)]
    return [branch_point(n, after=False) for n in chosen]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def fork_episode(fresh, owner: Trajectory, kept: int):
    """A new episode in the state owner's was in after its first `kept` turns: replayed."""
    episode = fresh()
    for step in owner.steps[:kept]:
        result = episode.step(step.text)
        obs = None if result.done else episode.messages[-1]["content"]
        if obs != step.observation:
            raise RuntimeError(f"episode {episode.id}: replaying a turn gave another observation "
                               "than the rollout got; tree search needs a deterministic "
                               "environment")
    return episode


def grow(policy, tok, fresh, forest: Forest, points: list, args, generator, stats=False):
    """One new rollout per branch point, all in one batch, each from a copy of its context's
    cache row (see the section comment), hung below its parent node."""
    if not points:
        return
    trajs, new, sources = [], [], []
    for parent, owner, kept in points:
        at = owner.steps[kept]                          # the turn the branch replaces
        context = owner.segments[at.segment][:at.span[0]]
        cache, row = forest.caches[id(owner)]
        # the row holds owner.segments[-1]; re-feed at least the last token (its logits)
        n = min(common_prefix(context, owner.segments[-1]), len(context) - 1)
        trajs.append(Trajectory(fork_episode(fresh, owner, kept),
                                segments=[list(x) for x in owner.segments[:at.segment]]
                                + [context[:n]], steps=list(owner.steps[:kept])))
        new.append(context[n:])
        sources.append((cache, row, n))
    cache = policy.new_cache(len(trajs), capacity=min(args.max_len, max(
        len(t.segments[-1]) + len(x) for t, x in zip(trajs, new)) + 4 * args.max_new_tokens))
    for b, (src, row, n) in enumerate(sources):
        model.copy_rows(src, row, cache, b, n)
    play(policy, tok, trajs, cache, new, args, generator=generator, stats=stats)
    for b, (traj, (parent, _, kept)) in enumerate(zip(trajs, points)):
        forest.branch_rollouts += 1
        if len(traj.steps) == kept:     # cut by --max-len before its first turn: no new leaf
            continue
        forest.caches[id(traj)] = (cache, b)
        forest.branch_tokens += sum(len(step.tokens) for step in traj.steps[kept:])
        attach(forest, traj, parent, kept)


def expand(policy, tok, fresh, forest: Forest, args, generator):
    """The L expansion rounds of the method."""
    points_of = tree_grpo_points if args.reward == TREE_GRPO else at2po_points
    for _ in range(args.tree_l):
        grow(policy, tok, fresh, forest, points_of(forest, args, generator), args, generator)


def normalized(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / (std + 1e-6), population std; all zeros when x does not vary."""
    std = x.std(correction=0) if len(x) > 1 else torch.tensor(0.0, dtype=x.dtype)
    return torch.zeros_like(x) if std <= 1e-8 else (x - x.mean()) / (std + 1e-6)


def tree_grpo_advantages(forest: Forest) -> tuple[list[list[float]], bool]:
    """Per-turn advantages of every leaf path, and whether all the prompt's leaves scored alike."""
    R = torch.tensor([t.score for t in forest.leaves], dtype=torch.float64)
    trees = torch.tensor(forest.leaf_tree)
    A = normalized(R)                                            # inter-tree
    for k in trees.unique().tolist():
        A[trees == k] += normalized(R[trees == k])               # intra-tree
    return ([[a] * len(t.steps) for a, t in zip(A.tolist(), forest.leaves)],
            bool(normalized(R).abs().sum() == 0))


def at2po_advantages(forest: Forest) -> tuple[list[list[float]], bool]:
    R = torch.tensor([t.score for t in forest.leaves], dtype=torch.float64)
    V = normalized(R)
    for traj, v in zip(forest.leaves, V.tolist()):
        if traj.steps:
            forest.node_of[id(traj.steps[-1])].value = v

    def value(node: Node) -> float:          # bottom-up: entropy-weighted mean of the children
        if node.children:
            H = torch.tensor([c.step.nll for c in node.children], dtype=torch.float64)
            w = torch.softmax(H, 0).tolist()
            node.value = sum(wc * value(c) for wc, c in zip(w, node.children))
        return node.value
    for root in forest.roots:
        value(root)
    return ([[forest.node_of[id(s)].value for s in t.steps] for t in forest.leaves],
            bool(V.abs().sum() == 0))


TREE_SEARCH = {TREE_GRPO: tree_grpo_advantages, AT2PO: at2po_advantages}


def tree_defaults(args):
    """The budget of the flags left unset (see the section comment)."""
    G = args.group
    M, N, L = (G // 2, 2, 1) if args.reward == TREE_GRPO else (G // 2, G // 4, 2)
    for name, v in (("tree_m", M), ("tree_n", N), ("tree_l", L)):
        if getattr(args, name) is None:
            setattr(args, name, max(1, v))


def cache_bytes(caches) -> int:
    return sum(c.k.nbytes + c.v.nbytes for cache in caches for c in cache)


# ---------------------------------------------------------------------------------------------
# 4. Update: PPO-clip + k3 KL, token-normalized, AdamW on LoRA
# ---------------------------------------------------------------------------------------------

def token_logprobs(policy, ids: torch.Tensor, mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log pi(x_j | x_<j) at the masked positions j, in row-major order -> (N,) float32.

    The head runs only on the N positions that count: the (B, T, V) logits of a long multi-turn
    rollout with a 150k vocabulary would not fit in memory."""
    h, _, _ = policy.trunk(ids)                                 # (B, T, d) after the final norm
    h = h[:, :-1]                                               # position j predicts x_{j+1}
    target = mask[:, 1:].to(h.device)
    logits = policy.lm_head(h[target]).float()                  # (N, V)
    if temperature > 0:
        logits = logits / temperature
    labels = ids[:, 1:].to(h.device)[target]                    # (N,)
    return torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)


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


def turn_loss(logp, logp_old, logp_ref, adv, turn, weight, clip: tuple[float, float],
              beta: float, n_tokens: float, n_seqs: float):
    """AT²PO's turn-level objective (the release's gspo_turn) summed over N policy tokens.

    Turn k of a trajectory has one importance ratio s_k = exp(mean_{t in k}(logp_t - logp_old_t)),
    and every token of the turn carries it with its own gradient: rho_t = sg[s_k] pi_t / sg[pi_t]
    (GSPO's construction, per turn). Per token -min(rho A, clip(rho, 1 - lo, 1 + hi) A), weighted
    by 1 / (policy tokens of its trajectory) and divided by the number of trajectories (a mean
    over each trajectory's tokens, then over trajectories); the KL term is this pipeline's (k3,
    summed and divided by n_tokens). turn (N,) labels each token's turn; weight (N,)."""
    if logp.numel() == 0:
        zero = logp.sum()
        return zero, {"kl": 0.0, "clip": 0.0, "ratio": 0.0, "pg": 0.0}
    d = (logp - logp_old).detach()
    _, k = torch.unique(turn, return_inverse=True)
    n = torch.zeros(int(k.max()) + 1, dtype=d.dtype, device=d.device)
    n.index_add_(0, k, torch.ones_like(d))
    log_s = torch.zeros_like(n).index_add_(0, k, d) / n                    # log s_k per turn
    ratio = torch.exp((log_s[k] + logp - logp.detach()).clamp(max=10.0))   # the release's clamp
    lo, hi = clip
    clipped = torch.clamp(ratio, 1 - lo, 1 + hi)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    dk = logp_ref - logp
    kl = torch.expm1(dk) - dk
    loss = (pg * weight).sum() / n_seqs + beta * kl.sum() / n_tokens
    with torch.no_grad():
        hit = ((ratio < 1 - lo) & (adv < 0)) | ((ratio > 1 + hi) & (adv > 0))
        sums = {"kl": kl.sum().item(), "clip": hit.sum().item(),
                "ratio": ratio.sum().item(), "pg": pg.sum().item()}
    return loss, sums


def lr_at(step: int, args) -> float:
    """Constant lr after a linear warmup over the first `--warmup` fraction of the steps."""
    warm = max(1, round(args.warmup * args.steps))
    return args.lr * min(1.0, (step + 1) / warm)


def update(policy, optimizer, batch: Batch, args, world) -> dict:
    """`--ppo-epochs` passes over the batch in micro-batches; one AdamW step per pass."""
    params = [p for p in policy.parameters() if p.requires_grad]
    n_tokens, n_seqs = all_sum(world, [batch.mask[:, 1:].sum().item(), batch.n_seqs])
    if n_tokens == 0:
        # no rollout generated a token (every prompt outgrew --max-len): the loss would be 0/0,
        # and an AdamW step on zero gradients would still move the adapter by its momentum
        return {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio": 0.0, "grad_norm": 0.0,
                "tokens": 0, "empty_batch": 1}
    rows = len(batch.lengths)
    chunks = [list(range(i, min(i + args.micro_batch, rows)))
              for i in range(0, rows, args.micro_batch)]
    dev = input_device(policy)
    ref, old = {}, {}
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
                    ref[c] = token_logprobs(policy, ids, mask, args.temperature)
            logp = token_logprobs(policy, ids, mask, args.temperature)
            if epoch == 0:
                old[c] = logp.detach()
            if args.reward == AT2PO:
                sel = mask[:, 1:]
                loss, s = turn_loss(logp, old[c], ref[c], adv,
                                    batch.turn[rows_c, 1:T][sel].to(dev),
                                    batch.weight[rows_c, 1:T][sel].to(dev), args.at2po_clip,
                                    args.beta, n_tokens, n_seqs)
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
        optimizer.step()
        if epoch == 0:
            first = all_sum(world, [sums[k] for k in ("loss", "kl", "clip", "ratio")])
    loss, kl, clip, ratio = first
    return {"loss": loss, "kl": kl / max(n_tokens, 1), "clip_frac": clip / max(n_tokens, 1),
            "ratio": ratio / max(n_tokens, 1), "grad_norm": grad_norm, "tokens": int(n_tokens),
            "empty_batch": 0}


# ---------------------------------------------------------------------------------------------
# LoRA (model.py) and devices
# ---------------------------------------------------------------------------------------------

def input_device(policy) -> torch.device:
    return policy.model.embed_tokens.weight.device


def add_lora(policy, args):
    # apply_lora freezes the base: only the adapter is trained (and all-reduced)
    model.apply_lora(policy, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                   targets=tuple(args.lora_targets.split(",")))


def lora_state(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.lora_parameters(policy)}


def load_lora_state(policy, state: dict[str, torch.Tensor]):
    with torch.no_grad():
        for n, p in model.lora_parameters(policy):
            p.copy_(state[n])


@contextlib.contextmanager
def lora_swapped(policy, state: dict[str, torch.Tensor]):
    """Run with other adapter weights (the lagged teacher of tips), then put the policy's back."""
    own = lora_state(policy)
    load_lora_state(policy, state)
    try:
        yield policy
    finally:
        load_lora_state(policy, own)


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


# ---------------------------------------------------------------------------------------------
# Checkpoints: adapter (PEFT layout), optimizer, RNG states, step; written atomically
# ---------------------------------------------------------------------------------------------

def save_checkpoint(out: Path, step: int, policy, optimizer, world, ctx) -> Path:
    final = out / f"checkpoint-{step:06d}"
    tmp = out / f".checkpoint-{step:06d}.tmp"
    if world.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world)
    # every process has its own RNG streams (LoRA dropout); each saves its own
    rng_tensors, rng_meta = rng_state()
    save_file(rng_tensors, tmp / f"rng-{world.rank}.safetensors")
    envs.write_json(tmp / f"rng-{world.rank}.json", rng_meta)
    barrier(world)
    if world.main:
        model.save_adapter(policy, tmp / "adapter")
        tensors, meta = optimizer_to_tensors(optimizer)
        save_file(tensors, tmp / "optimizer.safetensors")
        if ctx.lagged is not None:
            save_file(ctx.lagged, tmp / "lagged.safetensors")
        envs.write_json(tmp / "trainer.json", {"step": step, "processes": world.size,
                                          "optimizer": meta})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)        # the directory appears complete or not at all
    barrier(world)
    return final


def barrier(world):
    if world.size > 1:
        dist.barrier()


def latest_checkpoint(out: Path) -> Path | None:
    done = sorted(p for p in out.glob("checkpoint-*") if (p / "trainer.json").is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path, policy, optimizer, world, ctx) -> int:
    try:
        info = json.loads((path / "trainer.json").read_text())
        if info["processes"] != world.size:
            raise ValueError(f"it was written by {info['processes']} processes, this run has "
                             f"{world.size}; the RNG streams would differ")
        model.load_adapter(policy, path / "adapter")
        optimizer_from_tensors(optimizer, load_file(path / "optimizer.safetensors"),
                               info["optimizer"])
        set_rng_state(load_file(path / f"rng-{world.rank}.safetensors"),
                      json.loads((path / f"rng-{world.rank}.json").read_text()))
        if (path / "lagged.safetensors").exists():
            ctx.lagged = load_file(path / "lagged.safetensors")
        return int(info["step"])
    except (OSError, KeyError, ValueError, SafetensorError) as e:
        raise SystemExit(f"{path}: cannot resume from this checkpoint ({e})") from e


def optimizer_to_tensors(optimizer) -> tuple[dict, dict]:
    # safetensors holds the tensors and JSON the rest: no pickle anywhere
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
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
# Evaluation: greedy decoding on the held-out split
# ---------------------------------------------------------------------------------------------

# GTA answers are matched as the paper matches them: strictly (an alias must stand alone) for the
# training reward, loosely (a substring) wherever a policy is evaluated. Shop and ToolBench have
# one scorer.
def make_env(args, split: str, evaluation: bool = False):
    """The `--env` environment of one split, scored for training or for evaluation."""
    kw = {"match": "loose" if evaluation else "strict"} if args.env == "gta" else {}
    return envs.make(args.env, split=split, data_dir=args.data_dir, **kw)


def evaluate(policy, tok, env, pool, n: int, args, world) -> dict:
    """Greedy rollouts on the first n episodes of `pool` (0: all): mean task score, mean turns,
    and every episode's score in pool order (for paired comparisons between runs)."""
    n = len(pool) if not n else min(n, len(pool))
    mine = list(range(world.rank, n, world.size))
    policy.eval()
    scores, turns = [], 0
    for i in range(0, len(mine), args.eval_batch):
        episodes = [env.episode(pool[j]) for j in mine[i:i + args.eval_batch]]
        for traj in rollout(policy, tok, episodes, args, greedy=True, stats=False):
            scores.append(traj.score)
            turns += len(traj.steps)
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
    if args.env == "shop":
        val = make_env(args, "val", evaluation=True)
        return {"val": (val, scorable(val)), "test": (test, scorable(test))}, train_pool
    k = min(args.val_episodes or max(1, len(train_pool) // 10), len(train_pool) // 2)
    val = make_env(args, "train", evaluation=True)
    return ({"val": (val, train_pool[len(train_pool) - k:]), "test": (test, scorable(test))},
            train_pool[:len(train_pool) - k])


def evaluate_all(step: int, policy, tok, held: dict, args, world) -> dict:
    sizes = {"val": args.val_episodes, "test": args.eval_episodes}
    return {"step": step, **{name: evaluate(policy, tok, env, pool, sizes[name], args, world)
                             for name, (env, pool) in held.items()}}


def base_eval_cache(policy, args, world) -> Path | None:
    """Where the base model's evaluation is kept for later runs: greedy decoding of a fixed pool
    is the same in every run of one policy and one set of evaluation settings (every reward and
    every seed of a comparison), so it is done once. Shop only: its held-out pools are procedural
    and fixed (a replay pool depends on the data directory). The key holds everything the greedy
    rollouts depend on, threads and batch included (they change float summation order)."""
    if args.env != "shop" or world.size > 1:
        return None
    import shop                         # the built-in world: its cache root and policy key
    settings = {"val": args.val_episodes, "test": args.eval_episodes, "batch": args.eval_batch,
                "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens,
                "max_len": args.max_len, "dtype": args.dtype, "devices": args.devices,
                "threads": torch.get_num_threads()}
    return (envs.cache_root() / "grpo-base-eval" /
            f"shop-{shop.policy_hash(policy.checkpoint_dir)}-{shop.settings_hash(settings)}.json")


# ---------------------------------------------------------------------------------------------
# The training loop: rollout -> rewards -> advantages -> update, checkpoints, evaluation
# ---------------------------------------------------------------------------------------------

def scorable(env) -> list[int]:
    """Indices of the episodes that can be scored (GTA skips some, METHOD.md §10; shop none)."""
    import shop                         # the built-in world: every episode is scorable
    if isinstance(env, shop.ShopEnv):
        return list(range(len(env)))
    return [i for i in range(len(env)) if env.episode(i).skip_reason is None]


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


def read_from_base(policy, trajs: list[Trajectory], rows_per_forward: int,
                   cost: dict | None = None) -> None:
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
        count(cost, tf_rows=len(seqs), tf_tokens=sum(map(len, seqs)))
    with model.lora_disabled(policy):
        traces = model.trace_batch(policy, seqs, spans, rows_per_forward=rows_per_forward)
    for step, trace in zip(steps, traces):
        step.trace = trace


@dataclass
class Training:                     # what every training step reads; train() builds it once
    policy: model.Transformer
    tok: model.Tokenizer
    env: envs.Env                   # the training environment ...
    pool: list[int]                 # ... and the indices of its episodes the prompts come from
    ctx: RewardContext
    optimizer: torch.optim.Optimizer
    args: argparse.Namespace
    world: World


def train_step(step: int, run: Training) -> dict:
    """One GRPO step: this process's share of the prompts, then the all-reduced update.

    With --oversample K (DAPO's dynamic sampling) up to K x its share of prompts are played, in
    order, and a group whose rewards are all equal is set aside while later prompts remain: it
    has no advantage to give, and with a sparse reward most groups are such groups.

    With tree search (section 3b) a prompt's group is the leaves of its trees."""
    policy, tok, env, pool, ctx, args, world = (run.policy, run.tok, run.env, run.pool, run.ctx,
                                                run.args, run.world)
    t = {k: 0.0 for k in TIMING}
    ctx.cost = dict.fromkeys(COSTS, 0)
    kv_bytes = 0
    on_cuda = input_device(policy).type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(input_device(policy))
    policy.eval()
    need = len(range(world.rank, args.batch, world.size))
    groups, rewards, p_correct, advs, tried, zero = [], [], [], [], 0, 0
    candidates = list(range(world.rank, args.batch * args.oversample, world.size))
    for n, j in enumerate(candidates):
        if len(groups) == need:
            break
        g = step * args.batch * args.oversample + j
        t0 = time.perf_counter()
        index = pool[prompt_index(args.seed, g, len(pool))]
        generator = sampler(policy, args.seed, g)
        caches, forest = [], None
        if args.reward in TREE_SEARCH:
            forest = plant(policy, tok, lambda: env.episode(index), args, generator)
        else:
            # G fresh copies of the same episode: the group GRPO compares
            episodes = [env.episode(index) for _ in range(args.group)]
            group = rollout(policy, tok, episodes, args, generator=generator, caches=caches,
                            stats=args.reward in NEEDS_STATS and args.probe_reads == "policy")
        t1 = time.perf_counter()
        if forest is not None:      # the sibling rollouts: the price of the trees' credit
            expand(policy, tok, lambda: env.episode(index), forest, args, generator)
            group = forest.leaves
            caches = list({id(c): c for c, _ in forest.caches.values()}.values())
            count(ctx.cost, branch_rollouts=forest.branch_rollouts,
                  branch_tokens=forest.branch_tokens)
        tb = time.perf_counter()
        if args.reward in NEEDS_STATS and args.probe_reads == "base":
            read_from_base(policy, group, args.micro_batch, ctx.cost)
        t2 = time.perf_counter()
        r, p = zip(*[turn_rewards(traj, ctx) for traj in group])
        if forest is not None:
            a, all_equal = TREE_SEARCH[args.reward](forest)
        t3 = time.perf_counter()
        t["t_rollout"] += t1 - t0
        t["t_base_read"] += t2 - tb
        t["t_reward"] += t3 - t1
        tried += 1
        if forest is None:
            a, all_equal = group_advantages(r)
        # every turn once: a tree's shared turns count where they were generated
        played = [n.step for n in forest.node_of.values()] if forest is not None else \
            [st for traj in group for st in traj.steps]
        count(ctx.cost, gen_turns=len(played), gen_tokens=sum(len(st.tokens) for st in played))
        kv_bytes = max(kv_bytes, cache_bytes(caches))
        del caches, forest
        zero += all_equal
        if all_equal and len(candidates) - n - 1 >= need - len(groups) and args.oversample > 1:
            continue                    # set aside: enough prompts remain to fill the batch
        groups.append(group)
        rewards.append(list(r))
        p_correct += p
        advs += a
    t0 = time.perf_counter()
    trajs = [traj for group in groups for traj in group]
    policy.train()
    stats = update(policy, run.optimizer, make_batch(trajs, advs, tok.pad_id), args, world)
    policy.eval()
    t["t_update"] = time.perf_counter() - t0
    memory = {"mem_kv_mb": kv_bytes / 2**20}
    if on_cuda:
        memory["mem_cuda_peak_mb"] = torch.cuda.max_memory_allocated(input_device(policy)) / 2**20
    return step_metrics(step, trajs, rewards, p_correct, (zero, tried), stats,
                        [t[k] for k in TIMING], args, world, [ctx.cost[k] for k in COSTS], memory)


def step_metrics(step, trajs, rewards, p_correct, played, stats, times, args, world, costs=(),
                 memory=None) -> dict:
    """One metrics.jsonl record, summed over processes (memory: the largest). played = (groups
    whose rewards were all equal, groups played); the rest is about the groups kept for the
    update. p_correct: per trajectory, the frozen probe's P(correct) of each turn (or None)."""
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
    sums = all_sum(world, [len(flat), sum(flat), sum(r * r for r in flat), len(trajs),
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
        p = gather_floats(world, [x for x, _ in pairs], size)
        y = gather_floats(world, [y for _, y in pairs], size)
        rec["probe_auroc"] = probes.auroc(y, p) if 0 < sum(y) < len(y) else None
    for name, t in zip(TIMING, times):
        rec[name] = t / world.size
    rec.update({name: int(c) for name, c in zip(COSTS, costs)})
    for name, v in (memory or {}).items():
        rec[name] = round(all_max(world, v), 3)
    return rec


def all_max(world: World, value: float) -> float:
    if world.size == 1:
        return float(value)
    t = torch.tensor([value], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def ctx_has_probe(args) -> bool:
    # probe rewards and PAIR score every turn; only shop knows the exact labels to check them on
    return args.env == "shop" and (args.reward == "pair" or args.reward in PROBE_REWARDS)


def gather_floats(world: World, values: list[float], size: int) -> list[float]:
    """Concatenate every process's list (each at most `size` long)."""
    if world.size == 1:
        return list(values)
    t = torch.full((size,), float("nan"), dtype=torch.float64, device=world.device)
    t[:len(values)] = torch.tensor(values, dtype=torch.float64)
    parts = [torch.empty_like(t) for _ in range(world.size)]
    dist.all_gather(parts, t)
    return [v for part in parts for v in part.tolist() if not math.isnan(v)]


def append_jsonl(path: Path, record: dict):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL log. A last line cut short by a kill is dropped (the step it
    logged is redone on resume); a broken line before the last one is an error."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for k, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if k == len(lines) - 1:
                break
            raise SystemExit(f"{path}: line {k + 1} is not JSON ({e}); the log is damaged") \
                from e
    return records


def truncate_jsonl(path: Path, last_step: int):
    """Keep the records up to `last_step`: what an interrupted run logged after its last
    checkpoint is redone on resume."""
    if not path.exists():
        return
    keep = [r for r in read_jsonl(path) if r["step"] <= last_step]
    envs.write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


CHANCE_WINDOW = 5       # steps the drift monitor's alarm averages over


def below_chance(aurocs: list) -> float | None:
    """The drift monitor's alarm: the mean probe AUROC of the last CHANCE_WINDOW steps when it
    is below chance (the frozen probe now ranks the run's wrong turns above its right ones, so
    its reward favours them), else None."""
    recent = [a for a in aurocs[-CHANCE_WINDOW:] if a is not None]
    mean = sum(recent) / CHANCE_WINDOW
    return mean if len(recent) == CHANCE_WINDOW and mean < 0.5 else None


def progress_line(rec: dict, steps: int, elapsed: list[float], evals_left: float = 0.0) -> str:
    """The step's own time, and an ETA from the median of the last 10 steps (a rollout that
    rambles to --max-new-tokens makes single steps slow; the median does not jump with it)
    plus `evals_left`, the seconds the evaluations still to come will take."""
    left = float(np.median(elapsed[-10:])) * (steps - rec["step"]) + evals_left
    auroc = rec.get("probe_auroc")
    return (f"step {rec['step']:>4}/{steps}  reward {rec['reward_mean']:.3f}"
            f"±{rec['reward_std']:.3f}"
            f"  success {rec['success']:.2f}  zero-std {rec['frac_zero_std']:.2f}"
            f"  kl {rec['kl']:.2e}" + (f"  probe-auroc {auroc:.2f}" if auroc is not None else "")
            + f"  {elapsed[-1]:.1f}s (rollout {rec['t_rollout']:.1f} reward "
            f"{rec['t_reward']:.2f} update {rec['t_update']:.1f})  ETA {model.duration(left)}")


# flags that must not change when a run is resumed
RESUME_KEYS = ("env", "model", "reward", "alpha", "outcome_weight", "probes", "seed", "steps",
               "batch", "group", "max_turns", "max_new_tokens", "max_len", "temperature", "top_p",
               "lr", "warmup", "beta", "eps", "oversample", "ppo_epochs", "micro_batch", "lora_r",
               "lora_alpha", "lora_dropout", "lora_targets", "save_every", "tips_refresh",
               "tips_gamma", "probe_corpus", "probe_reads", "corpus_episodes", "corpus_samples",
               "corpus_heldout", "probe_episodes", "eval_episodes", "val_episodes", "tree_m",
               "tree_n", "tree_l", "at2po_penalty", "at2po_clip")


def is_builtin(args) -> bool:
    return args.env == "shop" and Path(args.model).resolve() == BUILTIN_POLICY.resolve()


def resolve_preset(args, world) -> None:
    """Fill the flags left unset: the tiny preset for the built-in policy, else the paper's."""
    preset = dict(PAPER_HPARAMS, **TINY) if is_builtin(args) else PAPER_HPARAMS
    given = {k for k in preset if getattr(args, k) is not None}
    for k, v in preset.items():
        if k not in given:
            setattr(args, k, v)
    if args.micro_batch is None:
        args.micro_batch = args.group
    if args.reward in TREE_SEARCH:
        tree_defaults(args)
        for name in ("tree_m", "tree_n", "tree_l"):
            if getattr(args, name) < 1:
                raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(args, name)}")
        if args.outcome_weight:
            raise SystemExit(f"--outcome-weight: --reward {args.reward} learns from the outcome "
                             "alone already; leave it at 0")
    if world.main and is_builtin(args):
        def flags(keys):
            return ", ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in keys)
        print("preset for the tiny built-in policy (the paper's 7B values for everything else): "
              + flags(k for k in TINY if k not in given)
              + (f"; from the command line: {flags(k for k in TINY if k in given)}"
                 if given & set(TINY) else ""), flush=True)


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
        except (OSError, ValueError) as e:
            raise SystemExit(f"--resume: {saved} is not readable ({e}); the flags of the "
                             "run cannot be checked") from None
        for k in RESUME_KEYS:
            if k in old and old[k] != getattr(args, k):
                raise SystemExit(f"--resume: --{k.replace('_', '-')} is {getattr(args, k)!r} "
                                 f"but the run in {out} used {old[k]!r}")
    elif args.resume and latest_checkpoint(out):
        # without it any flag could change under the checkpoint's optimizer and RNG states
        raise SystemExit(f"--resume: {out} holds checkpoints but no args.json, so the flags "
                         "of that run cannot be checked; restore it, or start a new --out")
    elif args.resume:
        # a typo in --out must not start a new run from scratch under the user's nose
        raise SystemExit(f"--resume: nothing to resume in {out} (no run was started there); "
                         "leave out --resume to start one, or pass --resume-if-present to "
                         "start one only when there is none")
    elif (out / "metrics.jsonl").exists() or latest_checkpoint(out):
        raise SystemExit(f"--out {out} already holds a run: pass --resume to continue it, or "
                         "choose another --out")


def prepare_out(args, world) -> Path:
    out = Path(args.out)
    if world.main:
        # One run per --out, held until this process exits: two would interleave their metrics
        # and checkpoints.
        pair.claim(out)
        check_out(args)
        envs.write_json(out / "args.json", vars(args))
    if world.size > 1:
        dist.barrier()
    return out


def train(args) -> dict:
    world = init_world(args)
    resolve_preset(args, world)
    if args.batch % world.size:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {world.size} processes")
    if args.threads:
        torch.set_num_threads(args.threads)
    # Every input is checked before OUT is written, so that a bad flag leaves nothing behind;
    # OUT itself is checked read-only first, so that a --resume mistake costs no model load.
    check_out(args)
    barrier(world)          # every process reads OUT as it was before any of them writes
    log = print if world.main else (lambda *a, **k: None)
    started = time.perf_counter()
    seed_all(args.seed)
    devices = args.devices.split(",") if args.devices else (
        [world.device] if world.device != "cpu" else None)
    if Path(args.model).resolve() == BUILTIN_POLICY.resolve() and not BUILTIN_POLICY.is_dir():
        sys.exit(f"--model: the built-in policy {BUILTIN_POLICY} is missing; build it with "
                 f"`python shop.py sft --out {BUILTIN_POLICY}`")
    policy, tok = model.load_model(args.model, dtype=model.DTYPES[args.dtype], devices=devices)
    add_lora(policy, args)
    env = make_env(args, "train")
    pool = scorable(env)
    held, pool = eval_splits(args, env, pool)
    if not pool or not all(p for _, p in held.values()):
        raise SystemExit(f"--env {args.env}: no scorable episode in the train, validation or "
                         "test split")
    # Probes fitted on the fly take minutes on a first run: OUT is claimed before them, so that
    # a busy OUT is refused at once. Given probes and the judge's key are checked before OUT.
    fit_later = ctx_has_probe(args) and not args.probes
    ctx = None if fit_later else reward_context(args, policy, tok, env, world, log)
    out = prepare_out(args, world)
    ctx = ctx or reward_context(args, policy, tok, env, world, log)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    run = Training(policy, tok, env, pool, ctx, optimizer, args, world)
    n_lora = sum(p.numel() for p in params)
    log(f"policy {args.model}: {sum(p.numel() for p in policy.parameters()) - n_lora:,} "
        f"parameters, + {n_lora:,} in the LoRA adapter (trained); env {args.env}: {len(pool)} "
        f"training / {len(held['val'][1])} validation / {len(held['test'][1])} test episodes; "
        f"reward {args.reward}; {args.steps} steps of {args.batch} x {args.group} rollouts on "
        f"{world.size} process(es); run in {out}", flush=True)
    if args.reward in TREE_SEARCH:
        log(f"tree search instead of the {args.group} rollouts: --tree-m {args.tree_m} "
            f"--tree-n {args.tree_n} --tree-l {args.tree_l} (see grpo.py section 3b)", flush=True)

    start = 0
    ckpt = latest_checkpoint(out) if args.resume else None
    if ckpt is not None:
        start = load_checkpoint(ckpt, policy, optimizer, world, ctx)
        log(f"resumed from {ckpt} at step {start}", flush=True)
    if world.main and args.resume:
        # what the interrupted run logged after its last checkpoint is redone, exactly
        truncate_jsonl(out / "metrics.jsonl", start)
        truncate_jsonl(out / "eval.jsonl", start)
    barrier(world)
    evaluated = {e["step"] for e in read_jsonl(out / "eval.jsonl")}
    eval_seconds = []

    def evaluate_and_log(step: int):
        if args.no_eval or step in evaluated:
            return
        t = time.perf_counter()
        cache = base_eval_cache(policy, args, world) if step == 0 else None
        if cache is not None and cache.is_file():
            ev = json.loads(cache.read_text())
            log(f"base model: evaluated by an earlier run of this policy with these evaluation "
                f"settings ({cache})", flush=True)
        else:
            ev = evaluate_all(step, policy, tok, held, args, world)
            eval_seconds.append(time.perf_counter() - t)   # what the ETA expects of the next
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                envs.write_json(cache, ev)
        if world.main:
            append_jsonl(out / "eval.jsonl", ev)
        evaluated.add(step)
        what = "base model" if step == 0 else f"step {step}"
        log(f"{what}: held-out success {ev['test']['success']:.3f} on {ev['test']['episodes']} "
            f"test episodes, {ev['val']['success']:.3f} on {ev['val']['episodes']} validation "
            "episodes (greedy)", flush=True)

    evaluate_and_log(start)      # the base model, or a checkpoint killed before its evaluation
    elapsed, aurocs, warned = [], [], False
    for step in range(start, args.steps):
        t = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        if args.reward == "tips" and step % args.tips_refresh == 0:
            ctx.lagged = lora_state(policy)           # the lagged teacher moves to the policy
        rec = train_step(step, run)
        elapsed.append(time.perf_counter() - t)
        if world.main:
            append_jsonl(out / "metrics.jsonl", rec)
        to_come = 0 if args.no_eval or not eval_seconds else eval_seconds[-1] * sum(
            s % args.save_every == 0 or s == args.steps for s in range(step + 1, args.steps + 1))
        log(progress_line(rec, args.steps, elapsed, to_come), flush=True)
        aurocs.append(rec.get("probe_auroc"))
        if not warned and (mean := below_chance(aurocs)) is not None:
            warned = True
            log(f"warning: the probe ranks this run's own turns below chance (mean AUROC "
                f"{mean:.2f} over the last {CHANCE_WINDOW} steps, probe_auroc in "
                "metrics.jsonl): its reward now favours wrong turns", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            path = save_checkpoint(out, step + 1, policy, optimizer, world, ctx)
            log(f"checkpoint {path}", flush=True)
            evaluate_and_log(step + 1)
    summary = summarize(out, time.perf_counter() - started, args, ctx.probe_report)
    if world.main:
        envs.write_json(out / "summary.json", summary)
        log(summary_text(summary), flush=True)
    if world.size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return summary


def summarize(out: Path, seconds: float, args, probe_report: dict | None = None) -> dict:
    """base / selected / final held-out success on test. `selected` is the checkpoint with the
    best validation success (ties: the earliest); `best_on_test` picks on the test split itself,
    the paper's protocol, which flatters every method alike."""
    evals = read_jsonl(out / "eval.jsonl")
    base = next((e for e in evals if e["step"] == 0), None)
    ckpts = [e for e in evals if e["step"] > 0]

    def on_test(e):
        return None if e is None else {"step": e["step"], "val": e["val"]["success"],
                                       **{k: v for k, v in e["test"].items() if k != "scores"}}
    selected = max(ckpts, key=lambda e: (e["val"]["success"], -e["step"])) if ckpts else None
    best = max(ckpts, key=lambda e: (e["test"]["success"], -e["step"])) if ckpts else None
    final = ckpts[-1] if ckpts else None
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
    lines = [f"done in {model.duration(s['seconds'])} (reward {s['reward']})."]
    if s["base"] and s["selected"]:
        lines.append(
            f"held-out success (greedy, {s['base']['episodes']} test episodes): before "
            f"{s['base']['success']:.3f} -> selected {s['selected']['success']:.3f} (step "
            f"{s['selected']['step']}, chosen on validation) -> final {s['final']['success']:.3f}"
            f" (step {s['final']['step']}); best on test {s['best_on_test']['success']:.3f} "
            f"(step {s['best_on_test']['step']}, the paper's protocol)")
    if s.get("probe_auroc_heldout"):
        p = s["probe_auroc_heldout"]
        lines.append(f"PAIR AUROC on {p['turns']} held-out own turns: {_num(p['pair'])} "
                     f"({p['corpus']} corpus); contaminated-corpus PAIR: "
                     f"{_num(p['contaminated_corpus_pair'])}")
    lines.append(f"run: {s['out']}  (metrics.jsonl per step, eval.jsonl per checkpoint, "
                 "summary.json)")
    if s["selected_adapter"]:
        lines.append(f"selected adapter (PEFT layout): {s['selected_adapter']}")
    return "\n".join(lines)


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


# ---------------------------------------------------------------------------------------------
# compare: rewards x seeds -> the table and the learning curves a user would put in a paper
# ---------------------------------------------------------------------------------------------
# Each run is an ordinary `grpo.py` run in OUT/runs/<name>-s<seed>, started as its own process
# (so `--jobs 2` uses two cores) and resumed with --resume if it was interrupted; a run with a
# summary.json is finished and never redone. A reward is written NAME or NAME:flag=value,...
# (e.g. pair:alpha=0), and flags after `--` go to every run.

COMPARE_REWARDS = ("outcome", "pair", "pair:alpha=0", "last_token", "multi_attn", "attention",
                   "head_entropy", "igpo", "tips", "tree_grpo", "at2po",
                   "pair:probe-corpus=contaminated")
BOOTSTRAP = 1000


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """'pair:alpha=0,probe-corpus=contaminated' -> ('pair', ['--alpha', '0', ...])."""
    reward, _, rest = spec.partition(":")
    if reward not in REWARDS:
        raise SystemExit(f"compare: unknown reward {reward!r} in {spec!r} (choose from "
                         f"{', '.join(REWARDS)})")
    flags = []
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"compare: {spec!r}: write flags as name=value, e.g. pair:alpha=0")
        flags += [f"--{key}", value]
    return reward, flags


def run_name(spec: str, seed: int) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "-" for c in spec) + f"-s{seed}"


def compare(argv: list[str]) -> dict:
    command = " ".join(["python grpo.py compare", *argv])
    ap = argparse.ArgumentParser(
        prog="grpo.py compare", formatter_class=HelpFormatter,
        description="Train every reward with every seed (resumable) and write compare.md, "
                    "compare.json and curves.svg. Flags after `--` go to every run.")
    ap.add_argument("--rewards", nargs="+", default=list(COMPARE_REWARDS),
                    help="rewards, each NAME or NAME:flag=value,...")
    ap.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44],
                    help="seeds, each a run per reward")
    ap.add_argument("--out", required=True, help="directory of the runs and the tables")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--cost", action="store_true",
                    help="the paper's Table complexity, measured: train every reward (default: "
                         "all but llm_judge without an endpoint) for the few steps given after "
                         "`--` without evaluations, one run at a time, and write cost.md")
    argv, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    args = ap.parse_args(argv)
    if args.cost:
        if "--rewards" not in argv:
            args.rewards = [r for r in REWARDS if r != "llm_judge"
                            or os.environ.get("OPENAI_API_KEY")]
        # latencies measured beside another run are not latencies
        args.jobs, extra = 1, [*extra, "--no-eval"]
    for spec in args.rewards:
        parse_spec(spec)                         # every spec is checked before any run starts
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    todo = []
    # Seed by seed: every reward has its first seed before any has its second, so a comparison
    # cut short still has a row for each (`--seeds 42` then tabulates what is done).
    for seed in args.seeds:
        for spec in args.rewards:
            reward, flags = parse_spec(spec)
            run = out / "runs" / run_name(spec, seed)
            if (run / "summary.json").is_file():
                continue
            cmd = [sys.executable, str(Path(__file__).resolve()), "--reward", reward, *flags,
                   "--seed", str(seed), "--out", str(run), "--threads", str(args.threads),
                   *extra] + (["--resume"] if (run / "args.json").is_file() else [])
            todo.append((run, cmd))
    print(f"compare: {len(args.rewards)} rewards x {len(args.seeds)} seeds, {len(todo)} runs to "
          f"do, {args.jobs} at a time; logs in {out / 'runs'}/<run>.log", flush=True)
    running: list[tuple[Path, subprocess.Popen]] = []
    failed = []
    while todo or running:
        while todo and len(running) < args.jobs:
            run, cmd = todo.pop(0)
            run.parent.mkdir(parents=True, exist_ok=True)
            with open(run.with_name(run.name + ".log"), "a") as log:
                running.append((run, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
            print(f"  started {run.name}", flush=True)
        time.sleep(0.5)
        for run, proc in list(running):
            if proc.poll() is not None:
                running.remove((run, proc))
                print(f"  {'finished' if proc.returncode == 0 else 'FAILED'} {run.name}",
                      flush=True)
                if proc.returncode != 0:
                    failed.append(run.name)
    if failed:
        raise SystemExit(f"compare: {len(failed)} runs failed ({', '.join(failed)}); see their "
                         "logs; run the same command again to retry them")
    if args.cost:
        result = cost_table(out, args.rewards, args.seeds)
        envs.write_json(out / "cost.json", result)
        envs.write_atomic(out / "cost.md", cost_markdown(result, command))
        print((out / "cost.md").read_text() + f"\nwrote {out / 'cost.md'}, {out / 'cost.json'}",
              flush=True)
        return result
    result = compare_table(out, args.rewards, args.seeds)
    envs.write_json(out / "compare.json", result)
    envs.write_atomic(out / "compare.md", compare_markdown(result, command))
    envs.write_atomic(out / "curves.svg", curves_svg(result))
    print((out / "compare.md").read_text() + f"\nwrote {out / 'compare.md'}, "
          f"{out / 'compare.json'}, {out / 'curves.svg'}", flush=True)
    return result


# The paper's Table complexity (A6000, Qwen2.5-7B-Instruct): latency per agent step of the
# reward, additional forward passes, external calls, cost growth
PAPER_COST = {
    "outcome": ("0 ms", "0", "none", "O(1) per trajectory"),
    "probe": ("~0.1 ms", "0", "none", "O(1) per step"),
    "pair": ("~0.2 ms", "0", "none", "O(1) per step"),
    "igpo": ("~30-50 ms", "1 (teacher-forced)", "none", "O(|y*|)"),
    "tree": ("~5-25 s", "K sibling rollouts", "none", "O(K) per step"),
    "llm_judge": ("~500 ms", "0", "GPT-4o-mini", "O(1) per step"),
}


def paper_cost(reward: str) -> tuple[str, str, str, str]:
    if reward in ("igpo", "tips"):
        return PAPER_COST["igpo"]
    if reward in TREE_SEARCH:
        return PAPER_COST["tree"]
    if reward in PAPER_COST:
        return PAPER_COST[reward]
    return PAPER_COST["probe"]          # every probe baseline and CoE


def cost_table(out: Path, specs: list[str], seeds: list[int]) -> dict:
    """Per reward, the mean over every logged step of every seed: what the reward itself cost
    (t_reward: the probes' read-out, the teacher-forced passes, the judge's calls, a tree's
    sibling rollouts), and the work of the step around it."""
    rows = []
    for spec in specs:
        ms = [m for seed in seeds for m in read_jsonl(out / "runs" / run_name(spec, seed) /
                                                      "metrics.jsonl")]
        if not ms:
            raise SystemExit(f"compare --cost: no logged step for {spec}")
        row = {"reward": spec, "steps": len(ms)}
        for key in (*TIMING, *COSTS, "mem_kv_mb", "mem_cuda_peak_mb"):
            row[key] = _mean([m.get(key) for m in ms])
        # the paper's latency is per agent step (one turn's reward)
        row["ms_per_turn"] = 1000 * row["t_reward"] / max(row["gen_turns"] or 0, 1)
        row["reward_share"] = row["t_reward"] / max(
            row["t_rollout"] + row["t_reward"] + row["t_update"], 1e-9)
        row["paper"] = dict(zip(("latency", "forwards", "external", "growth"),
                                paper_cost(parse_spec(spec)[0])))
        rows.append(row)
    return {"rows": rows, "seeds": seeds}


def cost_markdown(result: dict, command: str) -> str:
    def extra(r):
        parts = []
        if r["branch_rollouts"]:
            parts.append(f"{r['branch_rollouts']:.1f} sibling rollouts "
                         f"({r['branch_tokens']:.0f} tokens)")
        if r["tf_rows"]:
            parts.append(f"{r['tf_rows']:.1f} teacher-forced rows ({r['tf_tokens']:.0f} tokens)")
        return "; ".join(parts) or "0"
    lines = [
        "Per training step, mean over every logged step of seeds "
        f"{result['seeds']}; the paper's numbers (Table complexity, per agent step, A6000, 7B) "
        "beside them. *reward*: t_reward, the time of the reward itself (for tree search: the "
        "sibling rollouts and the advantages; the chains are the rollout); per turn: divided by "
        "the turns played in the step.", "", f"`{command}`", "",
        "| reward | reward s / step | ms / turn | paper latency / step | extra forward work / "
        "step | paper add. fwd passes | external calls / step | paper external | tokens "
        "generated / step | turns / step | reward share of step | KV cache MB | paper growth |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        p = r["paper"]
        lines.append(
            f"| {r['reward']} | {r['t_reward']:.3f} | {r['ms_per_turn']:.2f} | {p['latency']} "
            f"| {extra(r)} | {p['forwards']} | {r['external_calls']:.1f} | {p['external']} | "
            f"{r['gen_tokens']:.0f} | {r['gen_turns']:.1f} | {100 * r['reward_share']:.1f}% | "
            f"{r['mem_kv_mb']:.1f} | {p['growth']} |")
    return "\n".join(lines) + "\n"


def bootstrap_mean(rows: list[list[float]], base: list[list[float]] | None = None,
                   seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean success over seeds x episodes (minus `base`'s, seed by seed and
    episode by episode, when given): seeds and episodes both resampled (a two-level bootstrap),
    so the interval holds both the training noise and the evaluation pool's."""
    x = torch.tensor(rows, dtype=torch.float64)                       # (seeds, episodes)
    if base is not None:
        x = x - torch.tensor(base, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    S, n = x.shape
    s_idx = torch.randint(S, (BOOTSTRAP, S), generator=g)
    e_idx = torch.randint(n, (BOOTSTRAP, n), generator=g)
    means = torch.stack([x[s_idx[b]][:, e_idx[b]].mean() for b in range(BOOTSTRAP)])
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def compare_table(out: Path, specs: list[str], seeds: list[int]) -> dict:
    rows, scores = [], {}
    for spec in specs:
        runs = []
        for seed in seeds:
            run = out / "runs" / run_name(spec, seed)
            evals = {e["step"]: e for e in read_jsonl(run / "eval.jsonl")}
            runs.append((json.loads((run / "summary.json").read_text()),
                         read_jsonl(run / "metrics.jsonl"), evals))
        row = {"reward": spec, "seeds": seeds, "runs": [str(out / "runs" / run_name(spec, s))
                                                         for s in seeds]}
        for key in ("base", "selected", "final", "best_on_test"):
            vals = [s[key]["success"] for s, _, _ in runs]
            row[key] = {"mean": float(np.mean(vals)), "std": float(np.std(vals)),
                        "per_seed": vals}
        for key in ("selected", "final"):
            per_episode = [ev[s[key]["step"]]["test"]["scores"] for s, _, ev in runs]
            scores[spec, key] = per_episode
            row[key]["ci95"] = bootstrap_mean(per_episode)
        first = [m.get("probe_auroc") for _, ms, _ in runs for m in ms[:5]]
        last = [m.get("probe_auroc") for _, ms, _ in runs for m in ms[-5:]]
        row["probe_auroc"] = {"first5": _mean([x for x in first if x is not None]),
                              "last5": _mean([x for x in last if x is not None])}
        row["heldout_auroc"] = _mean([s.get("probe_auroc_heldout", {}).get("pair")
                                      for s, _, _ in runs])
        all_m = [m for _, ms, _ in runs for m in ms]
        row["frac_zero_std"] = _mean([m["frac_zero_std"] for m in all_m])
        row["kl_final"] = _mean([ms[-1]["kl"] for _, ms, _ in runs])
        for key in TIMING:
            row[key] = _mean([m.get(key, 0.0) for m in all_m])
        row["minutes"] = _mean([s["seconds"] / 60 for s, _, _ in runs])
        # the learning curves: test success at every evaluation, mean reward at every step
        steps = sorted(set.intersection(*(set(ev) for _, _, ev in runs)))
        row["curve_success"] = [(k, _mean([ev[k]["test"]["success"] for _, _, ev in runs]))
                                for k in steps]
        n_steps = min(len(ms) for _, ms, _ in runs)
        row["curve_reward"] = [(k + 1, _mean([ms[k]["reward_mean"] for _, ms, _ in runs]))
                               for k in range(n_steps)]
        rows.append(row)
    ref = specs[0]
    for row in rows:          # paired against the first reward (outcome by default): same seeds
        for key in ("selected", "final"):
            d = np.mean(scores[row["reward"], key]) - np.mean(scores[ref, key])
            row[key]["delta_vs_first"] = float(d)
            row[key]["delta_ci95"] = bootstrap_mean(scores[row["reward"], key],
                                                    scores[ref, key])
    return {"rows": rows, "reference": ref, "bootstrap": BOOTSTRAP,
            "selection": "checkpoint with the best validation success, reported on test"}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def compare_markdown(result: dict, command: str) -> str:
    def pct(x):
        return "—" if x is None else f"{100 * x:.1f}"

    def cell(r, key):
        lo, hi = r[key]["ci95"]
        return f"{pct(r[key]['mean'])} ± {pct(r[key]['std'])} [{pct(lo)}, {pct(hi)}]"

    def delta(r, key):
        lo, hi = r[key]["delta_ci95"]
        return f"{100 * r[key]['delta_vs_first']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"

    ref = result["reference"]
    lines = [
        f"Held-out success in % (greedy, test split), mean ± std over seeds "
        f"{result['rows'][0]['seeds']} [95% interval, two-level bootstrap over seeds and "
        f"episodes, {result['bootstrap']} draws]. *selected*: the checkpoint with the best "
        f"validation success, reported on test; *best on test*: the paper's protocol (chosen on "
        f"test itself). Δ: paired against `{ref}` (same seeds, same episodes).", "",
        f"`{command}`", "",
        "| reward | base | selected | Δ selected | final | Δ final | best on test "
        "| PAIR AUROC held-out own turns | probe AUROC first → last 5 steps | zero-std "
        "| KL final | s/step rollout / reward / update | min/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        pa = r["probe_auroc"]
        lines.append(
            f"| {r['reward']} | {pct(r['base']['mean'])} | {cell(r, 'selected')} | "
            f"{delta(r, 'selected') if r['reward'] != ref else '—'} | {cell(r, 'final')} | "
            f"{delta(r, 'final') if r['reward'] != ref else '—'} | "
            f"{pct(r['best_on_test']['mean'])} | {_num(r['heldout_auroc'])} | "
            + (f"{_num(pa['first5'])} → {_num(pa['last5'])}" if pa["first5"] is not None
               else "—")
            + f" | {r['frac_zero_std']:.2f} | {r['kl_final']:.3f} | {r['t_rollout']:.1f} / "
            f"{r['t_reward']:.2f} / {r['t_update']:.1f} | {r['minutes']:.1f} |")
    return "\n".join(lines) + "\n"


def curves_svg(result: dict) -> str:
    """Two panels, one line per reward: held-out test success vs step, mean reward vs step."""
    W, H, pad = 460, 300, 48
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
              "#7f7f7f", "#bcbd22", "#17becf"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" '
             f'height="{H + 24 * ((len(result["rows"]) + 1) // 2) + 20}" font-family="sans-serif"'
             ' font-size="12"><rect width="100%" height="100%" fill="white"/>']
    for p, (key, title) in enumerate((("curve_success", "held-out success (test, greedy)"),
                                      ("curve_reward", "mean turn reward (training rollouts)"))):
        series = [r[key] for r in result["rows"]]
        xs = [x for s in series for x, _ in s] or [0, 1]
        ys = [y for s in series for _, y in s if y is not None] or [0, 1]
        x0, x1 = min(xs), max(max(xs), min(xs) + 1)
        y0, y1 = min(ys), max(max(ys), min(ys) + 1e-3)
        y0, y1 = y0 - 0.05 * (y1 - y0), y1 + 0.05 * (y1 - y0)
        ox = p * W

        def X(x):
            return ox + pad + (x - x0) / (x1 - x0) * (W - 1.5 * pad)

        def Y(y):
            return H - pad + (y - y0) / (y1 - y0) * -(H - 1.6 * pad)
        parts.append(f'<text x="{ox + W / 2}" y="18" text-anchor="middle">{title}</text>')
        parts.append(f'<line x1="{X(x0)}" y1="{Y(y0)}" x2="{X(x1)}" y2="{Y(y0)}" '
                     'stroke="black"/>'
                     f'<line x1="{X(x0)}" y1="{Y(y0)}" x2="{X(x0)}" y2="{Y(y1)}" stroke="black"/>')
        for t in range(5):
            yv, xv = y0 + t * (y1 - y0) / 4, x0 + t * (x1 - x0) / 4
            parts.append(f'<text x="{X(x0) - 4}" y="{Y(yv) + 4}" text-anchor="end">{yv:.2f}'
                         f'</text><text x="{X(xv)}" y="{Y(y0) + 16}" text-anchor="middle">'
                         f'{xv:.0f}</text>')
        parts.append(f'<text x="{ox + W / 2}" y="{H - 8}" text-anchor="middle">step</text>')
        for c, s in enumerate(series):
            pts = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in s if y is not None)
            parts.append(f'<polyline points="{pts}" fill="none" stroke="{colors[c % 10]}" '
                         'stroke-width="1.6"/>')
    for c, r in enumerate(result["rows"]):
        x, y = 20 + (c % 2) * W, H + 24 * (c // 2) + 10
        parts.append(f'<line x1="{x}" y1="{y}" x2="{x + 24}" y2="{y}" stroke="{colors[c % 10]}"'
                     f' stroke-width="3"/><text x="{x + 30}" y="{y + 4}">{r["reward"]}</text>')
    return "\n".join(parts) + "\n</svg>\n"


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every default in --help, but never "(default: None)": a flag whose default is decided
    at run time (by the preset, or from another flag) says so in its own help text."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def preset_help(key: str, what: str) -> str:
    """`what` and the flag's effective default, read from the presets themselves: TINY's with
    the built-in policy, the paper's (Table grpo_config) with any other model."""
    tiny, paper = dict(PAPER_HPARAMS, **TINY)[key], PAPER_HPARAMS[key]
    if tiny == paper:
        return f"{what} (default: {paper}, the paper's)"
    return f"{what} (default: {tiny} with the built-in policy, {paper} otherwise: the paper's)"


def train_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="grpo.py", formatter_class=HelpFormatter,
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
    a("--env", default="shop", choices=("shop", "gta", "toolbench"), help="environment (envs.py)")
    a("--data-dir", default=None, help="gta / toolbench: the released files' root (default: "
      "$PAIR_DATA, else ~/.cache/pair/data; `python envs.py download` fills it)")
    a("--model", default=str(BUILTIN_POLICY),
      help="policy: a checkpoint directory or a Hugging Face model name")
    a("--reward", default="pair", choices=tuple(REWARDS), help="per-turn reward source")
    a("--alpha", type=float, default=5.0,
      help="PAIR momentum scaling (METHOD.md §7); 0 = vanilla PAIR, r_t = s~_t")
    a("--outcome-weight", type=float, default=0.0,
      help="add this times the task score to the last turn's reward (METHOD.md §9)")
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
                   help=preset_help("max_turns", "assistant turns per rollout"))
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
                                    "rewards are not all equal (1: off)"))
    g.add_argument("--ppo-epochs", type=int, default=1,
                   help="passes over each batch (1: on-policy, rho = 1)")
    g.add_argument("--micro-batch", type=int, default=None,
                   help="rollouts per forward in the update (default: --group)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--lora-r", type=int, default=None, help=preset_help("lora_r", "LoRA rank"))
    g.add_argument("--lora-alpha", type=float, default=None,
                   help=preset_help("lora_alpha", "LoRA alpha"))
    g.add_argument("--lora-dropout", type=float, default=None,
                   help=preset_help("lora_dropout", "LoRA dropout"))
    g.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
                   "down_proj", help="comma-separated projections that get an adapter")
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
                   help="torch CPU threads (default: torch's choice, or $OMP_NUM_THREADS)")
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        return compare(argv[1:])
    ap = train_parser()
    args = ap.parse_args(argv)
    if args.resume and args.resume_if_present:
        ap.error("--resume and --resume-if-present: pass one")
    if args.out is None:
        if args.resume:
            ap.error("--resume: nothing to resume without --out (the run directory to continue)")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--out is required with several processes")
        args.out = str(Path("runs") / f"{args.env}-{args.reward}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        return train(args)
    except (model.CheckpointError, envs.DataError, probes.FormatError) as e:
        sys.exit(f"error: {e}")         # bad input: one clear line naming the file


if __name__ == "__main__":
    main()
