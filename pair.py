"""PAIR, the Prefix-Aware Internal Reward (METHOD.md §6-7): the two-stage probe, its fit, its
reward; then what GRPO makes of any per-turn reward: the rewards, the advantages, the batch and
the loss (grpo.update runs them; the lab adds its own to REWARDS and ADVANTAGES).
    Stage 1  s_bc    = sigma(w_1 . h + b_1)            h = last-token hidden state (last_token)
    Stage 2  s_final = sigma(w_2 . [a; s_bc] + b_2)    a = multi_attn: [max, std, prefix, self] of
                                                          every head, every layer (layer-major)
Both are `probes.Probe`s (C = 0.01), fitted by lab/study.py; stage 2 on stage 1's in-sample s_bc
(as released) or, with crossfit = K, its out-of-fold s_bc over folds of episodes. At inference
stage 2 reads the raw s_bc (*departure*: the release temperature-clipped s_bc at inference).
As a reward (METHOD.md §7), with T = 2, eps = 0.05 and alpha = 5 (alpha = 0: vanilla PAIR):
    s~_t = clip(sigma(logit(s_final_t) / T), eps, 1-eps)
    r_1 = s~_1,   r_t = sigma(logit(s~_t) + alpha (s~_t - mean_{k<t} s~_k))
The advantages (METHOD.md §9) normalize the rewards within a group of G rollouts of one prompt;
the loss is PPO-clip + beta KL_k3 on each policy token, its turn's advantage A.
"""
from __future__ import annotations

import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

import model as mdl
import probes
from probes import attn_features, ATTN_STATS, feature, Probe


# ---- The PAIR model (METHOD.md §6) ---------------------------------------------------------------

@dataclass
class Pair:
    stage1: Probe                        # last_token -> s_bc            (Eq. stage1)
    stage2: Probe                        # [multi_attn; s_bc] -> s_final (Eq. stage2)
    stats: tuple[str, ...] = ATTN_STATS  # attention statistics of stage 2 (the ablation varies it)
    info: dict = field(default_factory=dict)

    def scores(self, raw: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(s_bc, s_final), each (N,), for a batch of raw features (probes.raw_features):
        Eq. stage1 s_bc = sigma(w_1 . h + b_1), Eq. stage2 s_final = sigma(w_2 . [a; s_bc] + b_2),
        each stage's input standardized by its own scaler (probes.Probe)."""
        s_bc = self.stage1.predict_proba(feature("last_token", raw))
        X2 = torch.cat([attn_features(raw, self.stats), s_bc[:, None]], dim=1)   # (N, 4HL + 1)
        return s_bc, self.stage2.predict_proba(X2)

    def save(self, directory) -> None:
        """stage1.safetensors, stage2.safetensors and pair.json (written last: a directory
        holding pair.json is complete). Every file is written atomically."""
        directory = Path(directory)
        self.stage1.save(directory / "stage1.safetensors")
        self.stage2.save(directory / "stage2.safetensors")
        config = {"format": "pair/1", "hidden_feature": "last_token", "stats": list(self.stats),
                  "stage1": "stage1.safetensors", "stage2": "stage2.safetensors", **self.info}
        mdl.write_atomic(directory / "pair.json", json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory) -> "Pair":
        directory = Path(directory)
        config_path = directory / "pair.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found: not a PAIR directory "
                                    "(written by `python -m lab.study train` or Pair.save)")
        try:
            config = json.loads(config_path.read_text())
        except (ValueError, RecursionError) as e:
            raise probes.FormatError(f"{config_path}: not JSON ({e})") from None
        if not isinstance(config, dict) or config.get("format") != "pair/1":
            raise probes.FormatError(f"{config_path}: not a pair/1 file")
        stats = tuple(config.get("stats") or ())
        if not stats or not set(stats) <= set(ATTN_STATS):
            raise probes.FormatError(f"{config_path}: bad attention statistics {stats}")
        if config.get("stage1") != "stage1.safetensors" or \
                config.get("stage2") != "stage2.safetensors":
            # the names are joined to the directory: nothing else may be read through them
            raise probes.FormatError(f"{config_path}: unexpected stage file names")
        stage1 = Probe.load(directory / config["stage1"])
        stage2 = Probe.load(directory / config["stage2"])
        info = {k: v for k, v in config.items()
                if k not in ("format", "hidden_feature", "stats", "stage1", "stage2")}
        return cls(stage1, stage2, stats, info)


def fit_stage1(raw, y, C=0.01, crossfit=0, groups=None, seed=0, stage1=None):
    """Stage 1 on all records, and the s_bc that stage 2 is fitted on: in-sample (crossfit 0,
    as released) or out-of-fold over K folds of episodes. Stage 1 is the last_token probe: one
    already fitted on the same records can be passed in."""
    X1 = feature("last_token", raw)
    stage1 = stage1 or Probe(info={"feature": "last_token"}).fit(X1, y, C)
    if crossfit == 0:
        return stage1, stage1.predict_proba(X1)
    if crossfit == 1:       # its one fold would leave no record to fit on
        raise ValueError("--crossfit 1: 0 (in-sample) or K >= 2 folds")
    if groups is None:
        raise ValueError("--crossfit needs the episode id of every training record")
    fold = episode_folds(groups, crossfit, seed)
    y = torch.as_tensor(y, dtype=torch.float64)
    s_bc = torch.empty(len(groups), dtype=torch.float64)
    for k in range(crossfit):
        held = fold == k
        s_bc[held] = Probe().fit(X1[~held], y[~held], C).predict_proba(X1[held])
    return stage1, s_bc


def episode_folds(groups: list[str], K: int, seed: int) -> torch.Tensor:
    """A fold in 0..K-1 per record; all records of an episode share one."""
    unique = sorted(set(groups))
    if len(unique) < K:
        raise probes.FormatError(f"--crossfit {K}: only {len(unique)} training episodes")
    order = torch.randperm(len(unique), generator=torch.Generator().manual_seed(seed)).tolist()
    fold_of = {unique[j]: i % K for i, j in enumerate(order)}
    return torch.tensor([fold_of[g] for g in groups])


def fit_stage2(stage1, s_bc, raw, y, C=0.01, stats=ATTN_STATS, info=None) -> Pair:
    X2 = torch.cat([attn_features(raw, stats), s_bc[:, None]], dim=1)   # (N, 4HL + 1)
    stage2 = Probe(info={"feature": "multi_attn+s_bc", "stats": list(stats)}).fit(X2, y, C)
    return Pair(stage1, stage2, tuple(stats), dict(info or {}))


def fit_pair(raw, y, C=0.01, crossfit=0, groups=None, seed=0, stats=ATTN_STATS, info=None,
             stage1=None):
    stage1, s_bc = fit_stage1(raw, y, C, crossfit, groups, seed, stage1)
    return fit_stage2(stage1, s_bc, raw, y, C, stats, {"crossfit": crossfit, **(info or {})})


# ---- The reward (METHOD.md §7): one rollout's rewards from its turns' s_final --------------------

def trajectory_rewards(s_final: list[float], alpha: float = 5.0, T: float = 2.0,
                       eps: float = 0.05) -> list[float]:
    """The rewards r_1..r_n of one rollout from the s_final of its turns (`Pair.scores`): each
    s_final is temperature-clipped, then rewarded against the mean of the earlier clipped ones."""
    s_tilde = [temp_clip(s, T, eps) for s in s_final]
    return [momentum_reward(s, s_tilde[:t], alpha) for t, s in enumerate(s_tilde)]


def temp_clip(s: float, T: float = 2.0, eps: float = 0.05) -> float:
    """Eq. tempclip: s~ = clip(sigma(logit(s) / T), eps, 1 - eps); keeps rewards off {0, 1}."""
    return min(max(sigmoid(logit(s) / T), eps), 1.0 - eps)


def momentum_reward(s_tilde: float, prev: list[float], alpha: float = 5.0) -> float:
    """Eq. pair_momentum: r_t = sigma(logit(s~_t) + alpha (s~_t - mean_{k<t} s~_k)); the first
    turn (no earlier s~) gets no bonus, r_1 = s~_1. alpha = 0 is vanilla PAIR, r_t = s~_t."""
    if not prev or alpha == 0:
        return s_tilde
    bonus = alpha * (s_tilde - sum(prev) / len(prev))
    return sigmoid(logit(s_tilde) + bonus)


def sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)                       # no overflow for very negative z
    return e / (1.0 + e)


def logit(s: float, clamp: float = 1e-6) -> float:
    s = min(max(s, clamp), 1.0 - clamp)
    return math.log(s / (1.0 - s))


# ---- The probes a run reads: found, checked against the policy, their report ---------------------

def check_probe_model(probe_path, model_dir) -> None:
    """Refuse a PAIR directory or probe file fitted on another model than `model_dir`'s (those
    of the same widths would be read without error): by the model_sha256 and dims it recorded."""
    probe_path = Path(probe_path)
    if (probe_path / "pair.json").is_file():
        pair = Pair.load(probe_path)
        info, d = pair.info, pair.stage1.w.numel()
    else:
        info, d = Probe.load(probe_path).info, None
    config = mdl.read_config(model_dir)
    have = {"d": config.hidden_size, "L": config.num_hidden_layers,
            "H": config.num_attention_heads}
    model = {"model": str(model_dir), "dims": have}
    if d is not None and d != have["d"]:
        raise probes.FormatError(f"{probe_path} reads hidden states of width {d} but --model "
                                 f"is {probes.describe_source(model)}: fitted on another model")
    recorded = probes.source(info)
    if "model_sha256" in recorded:
        model["model_sha256"] = mdl.checkpoint_sha256(model_dir)
    if "dims" in recorded or "model_sha256" in recorded:
        probes.check_same_source(recorded, probe_path, model, f"--model {model_dir}")
    else:
        print(f"warning: {probe_path} does not record the model it was fitted for; it cannot "
              "be checked against --model", file=sys.stderr)


STUDY = ("; `python -m lab.study train --out DIR` fits them into DIR/seed<S>/ (PAIR: its "
         "pair_mixed/), and `python -m lab.train --probes DIR` reads DIR itself")


def load_head(where: Path, reward: str, config, model_dir=None) -> Pair | Probe:
    """What `--reward` reads in `where` (a PAIR directory, or its pair/; a probe file, or a
    directory of them), checked against the policy's widths (config) and, given model_dir,
    against the model it was fitted for: a damaged or foreign file fails before any rollout."""
    if reward == "pair":
        path = next((d for d in (where, where / "pair") if (d / "pair.json").is_file()), None)
        if path is None:
            raise SystemExit(f"--probes {where}: no pair.json there nor in pair/ of it{STUDY}")
        head = Pair.load(path)
    else:
        path = where / f"{reward}.safetensors" if where.is_dir() else where
        if not path.is_file():
            raise SystemExit(f"--probes {where}: no probe {path.name} for --reward {reward}"
                             f"{STUDY}")
        head = Probe.load(path)
    if model_dir is not None:
        check_probe_model(path, model_dir)
    if isinstance(head, Probe) and (name := head.info.get("feature")) != reward:
        raise SystemExit(f"--probes {path}: a {name} probe, not {reward}")
    d, L, H = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    if isinstance(head, Pair):
        want = {"stage1": d, "stage2": len(head.stats) * H * L + 1}
        have = {"stage1": head.stage1.w.numel(), "stage2": head.stage2.w.numel()}
    else:
        want, have = {reward: probes.feature_width(reward, d, L, H)}, {reward: head.w.numel()}
    for part, n in want.items():
        if have[part] != n:
            raise SystemExit(f"{path}: the {part} probe reads {have[part]} features, this "
                             f"policy gives {n} (d={d}, L={L}, H={H}): fitted on another model, "
                             "or damaged")
    return head


def read_report(where: Path, reward: str, log) -> dict:
    """The report (probes.json) of probes shipped in `where`: it logs `reward`'s AUROC on
    held-out own turns, and warns where it is below chance (as a reward it favours wrong turns)."""
    try:
        report = json.loads((where / "probes.json").read_text())
        auroc, n = report["heldout"][reward]["all"], report["heldout"]["n"]["all"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{where}: damaged shipped probes ({type(e).__name__}: {e}); rebuild "
                         "them with `python -m lab.onpolicy`") from None
    log(f"probes: {where}, fitted on {report['n_train']} own turns of this policy; {reward}'s "
        f"AUROC on {n} held-out own turns {auroc:.3f}", flush=True)
    for part, a in report["heldout"][reward].items():
        if a is not None and a < 0.5 and (part == "all" or part.startswith("slip=")):
            which = "the held-out own turns" if part == "all" else \
                f"the {part[5:]} slip above the same turn made right"
            log(f"warning: the {reward} probe ranks {which} below chance ({a:.3f}): as a reward "
                "it favours the wrong turn", flush=True)
    return report


def report_summary(report: dict, reward: str) -> dict:
    """What summary.json keeps of a probes report: the AUROC on held-out own turns."""
    h = report["heldout"]
    return {"corpus": report["settings"]["corpus"], "turns": h["n"]["all"],
            "pair": h["pair"]["all"], "pair_clean_prefix": h["pair"]["clean_prefix"],
            "pair_contaminated_prefix": h["pair"]["contaminated_prefix"],
            "contaminated_corpus_pair": report["contaminated_corpus_pair"]["all"],
            **({reward: h[reward]["all"]} if reward in h else {})}


# ---- The per-turn rewards: `--reward` name -> function(trajectory, ctx) --------------------------
# Each gives a float per turn, or None for a turn without reward; those that read a frozen probe
# (READS_PROBE) give (rewards, each turn's P(correct)) for the drift monitor.

@dataclass
class RewardContext:                                # what the rewards need besides the rollout
    policy: mdl.Transformer
    tok: mdl.Tokenizer
    args: object                                    # grpo.py's flags
    env: object = None                              # the training environment (an envs.Env)
    pair: Pair | None = None                        # reward "pair"
    probe: Probe | None = None                      # the probe of the feature set --reward names
    judge: object = None                            # the lab's llm_judge (lab/toolbench.py)
    lagged: dict[str, torch.Tensor] | None = None   # the lab's tips: a lagged LoRA snapshot
    probe_report: dict | None = None                # the probes' AUROC on held-out own turns
    summary: dict = field(default_factory=dict)     # what the lab adds to summary.json
    cost: Counter = field(default_factory=Counter)  # this step's extra work (grpo.COSTS)
    stats: bool = True                              # rollouts keep the generation's statistics


def outcome_reward(traj, ctx) -> list[float | None]:
    return [None] * (len(traj.steps) - 1) + [traj.score]


def turn_features(traj) -> dict[str, torch.Tensor]:
    """probes.raw_features of every turn of a rollout (probes.Trajectory), stacked: (turns, ...)."""
    return probes.stack_raw([probes.raw_features(step.trace, False) for step in traj.steps])


def pair_reward(traj, ctx, raw=None) -> tuple[list[float], list[float]]:
    """METHOD.md §6-7: each turn's s_final (Eq. stage1, stage2), then the rollout's rewards
    (trajectory_rewards with ctx.args.alpha), and the s_final themselves. raw: the turns'
    stacked raw features where they are stored rather than generated (lab/credit.py)."""
    _, s_final = ctx.pair.scores(turn_features(traj) if raw is None else raw)
    s_final = s_final.tolist()
    return trajectory_rewards(s_final, ctx.args.alpha), s_final


def probe_reward(traj, ctx, raw=None) -> tuple[list[float], list[float]]:
    """METHOD.md §7: a probe baseline used as a reward gives r_t = its P(correct)."""
    X = feature(ctx.args.reward, turn_features(traj) if raw is None else raw)
    p = ctx.probe.predict_proba(X).tolist()
    return p, p


REWARDS = {"outcome": outcome_reward, "pair": pair_reward,
           **{name: probe_reward for name in probes.FEATURES}}
PROBE_REWARDS = set(probes.FEATURES)
READS_PROBE = {"pair"} | PROBE_REWARDS
NEEDS_STATS = set(READS_PROBE)          # rewards that read the generation pass's statistics


def turn_rewards(traj, ctx) -> tuple[list[float | None], list[float] | None]:
    """The `--reward` function plus `--outcome-weight`, and the frozen probe's P(correct) of
    every turn when the reward reads one (else None)."""
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


# ---- Advantages (METHOD.md §9: DeepSeekMath process supervision) ---------------------------------

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
        advantages.append(rhat.flip(0).cumsum(0).flip(0).tolist())     # returns to go
    return advantages, False


def release_advantages(rewards: list[list[float | None]]) -> tuple[list[list[float]], bool]:
    """`--advantage release`, the authors' release: A_{i,t} = r_{i,t} - mean_t r_{i,.} + z_i,
    z_i = the group-normalized total R_i = sum_t r_{i,t} (population std; only centered when
    std <= 1e-8). A turn without a reward counts 0; a group of one rollout keeps A = r. "All
    equal": no turn of the group gets an advantage."""
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


# --advantage name -> function(the group's per-turn rewards r[i][t], its task scores s[i], args)
# -> (advantages, all equal); the lab adds forms (lab/credit.py)
ADVANTAGES = {"process": lambda rewards, scores, args: group_advantages(rewards),
              "release": lambda rewards, scores, args: release_advantages(rewards)}


# ---- The batch and the loss (METHOD.md §9): each turn's advantage on its tokens, PPO-clip + KL

@dataclass
class Batch:                        # rollouts right-padded into rows, what the update consumes
    ids: torch.Tensor               # (B, T) long
    mask: torch.Tensor              # (B, T) bool: True on tokens the policy generated
    adv: torch.Tensor               # (B, T) float32: A of the turn each policy token belongs to
    lengths: list[int]              # real length of each row
    turn: torch.Tensor              # (B, T) long: a policy token's turn, -1 elsewhere (AT²PO)
    weight: torch.Tensor            # (B, T) float32: 1 / its trajectory's policy tokens (AT²PO)
    n_seqs: int                     # trajectories with a policy token (AT²PO)
    per_turn: torch.Tensor          # (B, T) float32: 1 / its turn's policy tokens (release)
    n_turns: int                    # turns with a policy token (release)


def make_batch(trajs: list[probes.Trajectory], advantages: list[list[float]], pad_id: int) -> Batch:
    """One right-padded row per token sequence; the mask covers the generated tokens only."""
    rows = [(traj, k) for traj in trajs for k in range(len(traj.segments))]
    B, T = len(rows), max(len(traj.segments[k]) for traj, k in rows)
    ids, mask = torch.full((B, T), pad_id, dtype=torch.long), torch.zeros(B, T, dtype=torch.bool)
    adv, weight, per_turn = (torch.zeros(B, T, dtype=torch.float32) for _ in range(3))
    turn, row_of, n_seqs, n_turns = torch.full((B, T), -1, dtype=torch.long), {}, 0, 0
    for r, (traj, k) in enumerate(rows):
        ids[r, :len(traj.segments[k])] = torch.tensor(traj.segments[k])
        row_of[id(traj), k] = r
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


def grpo_loss(logp, logp_old, logp_ref, adv, eps: float, beta: float, n_tokens: float):
    """METHOD.md §9: sum over N policy tokens (inputs (N,)) of
    -min(rho A, clip(rho, 1-eps, 1+eps) A) + beta KL_k3, divided by n_tokens (the batch's).
    Returns (loss, sums of KL, clip indicator, rho and the surrogate, for batch metrics)."""
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
    """`--advantage release`: per turn, the mean over its tokens (turn_weight = 1 / its tokens)
    of the clipped surrogate + beta (logp - logp_ref), the release's KL estimate; then the mean
    over the batch's turns. At one epoch this is the release's REINFORCE step:
    -(1 / n_turns) sum_turns (A mean_t grad log pi_t - beta mean_t grad(log pi_t - log pi_ref,t)).
    The logged KL is k3, as grpo_loss's, so that the two forms compare."""
    ratio = torch.exp(logp - logp_old)                          # rho
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
    loss = ((pg + beta * (logp - logp_ref)) * turn_weight).sum() / n_turns
    with torch.no_grad():
        d = logp_ref - logp
        clip = ((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + eps) & (adv > 0))
        sums = {"kl": (torch.expm1(d) - d).sum().item(), "clip": clip.sum().item(),
                "ratio": ratio.sum().item(), "pg": pg.sum().item()}
    return loss, sums
