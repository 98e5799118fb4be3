"""PAIR, the Prefix-Aware Internal Reward (METHOD.md §6-7), and what GRPO makes of any
per-turn reward (METHOD.md §9): the rewards, the advantages, the batch, the loss, the update.

Where this file departs from the paper and from the authors' release (their published
code); METHOD.md gives the reasons:
  1. The advantage (the paper names none): the default, `process`, is DeepSeekMath's
     process supervision (`group_advantages`); `release` is the release's
     (`release_advantages`).
  2. Stage 2's input (release): stage 2 reads the raw s_bc it was fitted on; at inference
     the release temperature-clipped s_bc first, an input stage 2 never saw in training.
  3. The `release` loss (release): it keeps the PPO ratio and clip of `process`; at one
     epoch rho = 1 and its gradient is the release's REINFORCE step exactly
     (`release_loss`).
  4. The logged KL (release): the k3 estimate in every form, so that the forms compare;
     the release logged the mean log-ratio to the reference, on which `release_loss`
     still trains.
  5. A turn's context in the update (release): the whole of it; the release cut it to its
     last 2,560 tokens.

The PAIR model, two logistic-regression probes (`probes.Probe`, C = 0.01):
    Stage 1  s_bc    = sigma(w_1 . h + b_1)          h: the turn's last-token hidden state
    Stage 2  s_final = sigma(w_2 . [a; s_bc] + b_2)  a: multi_attn, [max, std, prefix,
                                                        self] of every head of every
                                                        layer, layer-major
both fitted by lab/study.py, stage 2 on stage 1's in-sample s_bc (as released) or, with
crossfit = K, on its out-of-fold s_bc over folds of episodes. The reward, with T = 2,
eps = 0.05 and alpha = 5 (alpha = 0: vanilla PAIR):
    s~_t = clip(sigma(logit(s_final_t) / T), eps, 1 - eps)
    r_1 = s~_1,   r_t = sigma(logit(s~_t) + alpha (s~_t - mean_{k<t} s~_k))
The advantages normalize the rewards within a group of G rollouts of one prompt; the loss
is PPO-clip + beta KL_k3 on each policy token, with the advantage A of the token's turn.

Every function takes its parameters (alpha, T, eps, the outcome weight, the clip):
nothing here reads grpo.py's flags. A reward and an advantage form are rows of REWARDS
and ADVANTAGES; the lab's loop (lab/train.py) passes tables with rows of its own.
"""
from __future__ import annotations

import json
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch

import model as mdl
import probes
from probes import attn_features, ATTN_STATS, feature, Probe


# ---- The PAIR model (METHOD.md §6) ----------------------------------------------------

@dataclass
class Pair:
    """The two-stage probe: stage 1 reads a turn's last-token hidden state, stage 2 the
    attention statistics `stats` of every head and layer beside stage 1's s_bc. `info`
    records what it was fitted on (the source model, the settings), kept in pair.json."""
    stage1: Probe                        # last_token -> s_bc            (Eq. stage1)
    stage2: Probe                        # [multi_attn; s_bc] -> s_final (Eq. stage2)
    stats: tuple[str, ...] = ATTN_STATS  # stage 2's statistics (the ablation varies them)
    info: dict = field(default_factory=dict)

    def scores(self, raw: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(s_bc, s_final), each (N,), for N turns' stacked raw features (probes.raw_features):
            Eq. stage1  s_bc = sigma(w_1 . h + b_1)
            Eq. stage2  s_final = sigma(w_2 . [a; s_bc] + b_2)
        each stage's input standardized by its own scaler (probes.Probe)."""
        s_bc = self.stage1.predict_proba(feature("last_token", raw))
        X2 = torch.cat([attn_features(raw, self.stats), s_bc[:, None]], dim=1)   # (N, 4HL + 1)
        return s_bc, self.stage2.predict_proba(X2)

    def save(self, directory) -> None:
        """stage1.safetensors, stage2.safetensors and pair.json (written last: a
        directory holding pair.json is complete). Every file is written atomically."""
        directory = Path(directory)
        self.stage1.save(directory / "stage1.safetensors")
        self.stage2.save(directory / "stage2.safetensors")
        config = {"format": "pair/1", "hidden_feature": "last_token", "stats": list(self.stats),
                  "stage1": "stage1.safetensors", "stage2": "stage2.safetensors", **self.info}
        mdl.write_atomic(directory / "pair.json", json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory) -> "Pair":
        """The Pair that `save` wrote in `directory`. A directory without pair.json is a
        FileNotFoundError; a foreign or damaged file a probes.FormatError naming it."""
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
        # the names are joined to the directory: nothing else may be read through them
        if config.get("stage1") != "stage1.safetensors" or \
                config.get("stage2") != "stage2.safetensors":
            raise probes.FormatError(f"{config_path}: unexpected stage file names")
        stage1 = Probe.load(directory / config["stage1"])
        stage2 = Probe.load(directory / config["stage2"])
        info = {k: v for k, v in config.items()
                if k not in ("format", "hidden_feature", "stats", "stage1", "stage2")}
        return cls(stage1, stage2, stats, info)


def fit_stage1(raw, y, C=0.01, crossfit=0, groups=None, seed=0, stage1=None):
    """Stage 1 fitted on all N records (raw: their stacked raw features; y: (N,), 1 = a
    correct turn), and the (N,) s_bc that stage 2 is fitted on: in-sample (crossfit 0, as
    released) or out-of-fold over K folds of episodes (groups: each record's episode id).
    Stage 1 is the last_token probe: one already fitted on the same records may be given."""
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
    """A fold in 0..K-1 per record, (N,); all records of an episode share one."""
    unique = sorted(set(groups))
    if len(unique) < K:
        raise probes.FormatError(f"--crossfit {K}: only {len(unique)} training episodes")
    order = torch.randperm(len(unique), generator=torch.Generator().manual_seed(seed)).tolist()
    fold_of = {unique[j]: i % K for i, j in enumerate(order)}
    return torch.tensor([fold_of[g] for g in groups])


def fit_stage2(stage1, s_bc, raw, y, C=0.01, stats=ATTN_STATS, info=None) -> Pair:
    """Stage 2 fitted on [a; s_bc] of the records (s_bc: fit_stage1's, (N,)); returns the
    Pair of both stages, `info` kept in its pair.json."""
    X2 = torch.cat([attn_features(raw, stats), s_bc[:, None]], dim=1)   # (N, 4HL + 1)
    stage2 = Probe(info={"feature": "multi_attn+s_bc", "stats": list(stats)}).fit(X2, y, C)
    return Pair(stage1, stage2, tuple(stats), dict(info or {}))


def fit_pair(raw, y, C=0.01, crossfit=0, groups=None, seed=0, stats=ATTN_STATS, info=None,
             stage1=None):
    """PAIR fitted on N labelled records: fit_stage1, then fit_stage2 on its s_bc; the
    crossfit is recorded in the Pair's info."""
    stage1, s_bc = fit_stage1(raw, y, C, crossfit, groups, seed, stage1)
    return fit_stage2(stage1, s_bc, raw, y, C, stats, {"crossfit": crossfit, **(info or {})})


# ---- The reward (METHOD.md §7): one rollout's rewards from its turns' s_final ---------

def trajectory_rewards(s_final: list[float], alpha: float = 5.0, T: float = 2.0,
                       eps: float = 0.05) -> list[float]:
    """The rewards r_1..r_n of one rollout from the s_final of its turns (`Pair.scores`):
    each s_final is temperature-clipped, then rewarded against the mean of the earlier
    clipped ones."""
    s_tilde = [temp_clip(s, T, eps) for s in s_final]
    return [momentum_reward(s, s_tilde[:t], alpha) for t, s in enumerate(s_tilde)]


def temp_clip(s: float, T: float = 2.0, eps: float = 0.05) -> float:
    """Eq. tempclip: s~ = clip(sigma(logit(s) / T), eps, 1 - eps), which keeps the rewards
    off 0 and 1."""
    return min(max(sigmoid(logit(s) / T), eps), 1.0 - eps)


def momentum_reward(s_tilde: float, prev: list[float], alpha: float = 5.0) -> float:
    """Eq. pair_momentum: r_t = sigma(logit(s~_t) + alpha (s~_t - mean_{k<t} s~_k)); the
    first turn (no earlier s~) gets no bonus, r_1 = s~_1. alpha = 0 is vanilla PAIR:
    r_t = s~_t."""
    if not prev or alpha == 0:
        return s_tilde
    bonus = alpha * (s_tilde - sum(prev) / len(prev))
    return sigmoid(logit(s_tilde) + bonus)


def sigmoid(z: float) -> float:
    """sigma(z) = 1 / (1 + e^-z), for any float z."""
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)                       # no overflow for very negative z
    return e / (1.0 + e)


def logit(s: float, clamp: float = 1e-6) -> float:
    """log(s / (1 - s)), s first clamped to [clamp, 1 - clamp] (METHOD.md §7)."""
    s = min(max(s, clamp), 1.0 - clamp)
    return math.log(s / (1.0 - s))


# ---- The probes a run reads: found, checked against the policy, their report ----------

def check_probe_model(probe_path, model_dir) -> None:
    """Refuse a PAIR directory or probe file fitted on another model than `model_dir`'s
    (those of the same widths would be read without error): by the model_sha256 and dims
    it recorded."""
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


# how a missing probe's error ends: where probes come from
STUDY = ("; `python -m lab.study train --out DIR` fits them into DIR/seed<S>/ (PAIR: its "
         "pair_mixed/), and `python -m lab.train --probes DIR` reads DIR itself")


def load_head(where: Path, reward: str, config, model_dir=None) -> Pair | Probe:
    """What `--reward` reads in `where` (a PAIR directory, or its pair/; a probe file, or
    a directory of them), checked against the policy's widths (config) and, given
    model_dir, against the model it was fitted for: a damaged or foreign file fails
    before any rollout."""
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
    if isinstance(head, Probe) and head.info.get("feature") != reward:
        raise SystemExit(f"--probes {path}: a {head.info.get('feature')} probe, not {reward}")
    # the widths each part reads against those this policy's features have
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
    held-out own turns, and warns where it is below chance (as a reward it favours wrong
    turns)."""
    try:
        report = json.loads((where / "probes.json").read_text())
        auroc, n = report["heldout"][reward]["all"], report["heldout"]["n"]["all"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{where}: damaged shipped probes ({type(e).__name__}: {e}); rebuild "
                         "them with `python -m lab.onpolicy`") from None
    log(f"probes: {where}, fitted on {report['n_train']} own turns of this policy; {reward}'s "
        f"AUROC on {n} held-out own turns {auroc:.3f}", flush=True)
    # a warning for the held-out turns as a whole, and for each slip of the world ranked
    # against the same turn made right
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


# ---- The per-turn rewards: `--reward` name -> Reward ----------------------------------
# A reward is a function of one rollout (probes.Trajectory) and of what it reads besides
# (RewardContext), giving a reward per assistant turn (None: no reward at that turn).

@dataclass
class RewardContext:
    """What the rewards read besides the rollout: the policy, the environment, the probe a
    probe reward reads (set by the run's setup), PAIR's alpha; and the step's costs."""
    policy: mdl.Transformer
    tok: mdl.Tokenizer
    env: object = None                  # the training environment (an envs.Env)
    pair: Pair | None = None            # reward "pair": the two-stage probe
    probe: Probe | None = None          # a probe reward: the probe of feature set `feature`
    feature: str | None = None          # ... whose name is the --reward name (probes.FEATURES)
    alpha: float = 5.0                  # PAIR's momentum scaling (Eq. pair_momentum)
    # this step's work by the rewards (grpo.COSTS): a reward that teacher-forces sequences
    # or calls an external model counts it here, and the step's metrics report it
    cost: Counter = field(default_factory=Counter)


class TurnRewards(NamedTuple):
    """What a reward gives one rollout: r_t for each assistant turn (None: no reward there)
    and, for a reward read from a frozen probe, that probe's P(correct) of each turn, which
    the drift monitor scores against the turns' labels (None for other rewards)."""
    rewards: list[float | None]
    p_correct: list[float] | None = None


@dataclass(frozen=True)
class Reward:
    """One row of REWARDS: `fn`, (trajectory, ctx) -> TurnRewards, and what it reads."""
    fn: Callable
    reads_probe: bool = False           # a frozen probe (RewardContext.pair or .probe)
    needs_stats: bool = False           # the generation pass's statistics (probes.TurnTrace)


def outcome_reward(traj, ctx) -> TurnRewards:
    """The sparse baseline: the task score on the last turn, no reward on the others."""
    return TurnRewards([None] * (len(traj.steps) - 1) + [traj.score])


def turn_features(traj) -> dict[str, torch.Tensor]:
    """probes.raw_features of every turn of a rollout (probes.Trajectory), each stacked
    over the turns: (turns, ...)."""
    return probes.stack_raw([probes.raw_features(step.trace) for step in traj.steps])


def rewards_from_pair(head: Pair, raw: dict, alpha: float = 5.0, T: float = 2.0,
                      eps: float = 0.05) -> TurnRewards:
    """METHOD.md §6-7 for one rollout, from its turns' stacked raw features (turn_features):
    each turn's s_final (Eq. stage1, stage2), then the rewards r_1..r_n (trajectory_rewards);
    each turn's P(correct) is its s_final."""
    _, s_final = head.scores(raw)
    s_final = s_final.tolist()
    return TurnRewards(trajectory_rewards(s_final, alpha, T, eps), s_final)


def rewards_from_probe(probe: Probe, name: str, raw: dict) -> TurnRewards:
    """METHOD.md §7: a probe baseline of feature set `name` used as a reward gives, for each
    turn t, r_t = its P(correct) of turn t (the rewards and the P(correct) are one list)."""
    p = probe.predict_proba(feature(name, raw)).tolist()
    return TurnRewards(p, p)


def pair_reward(traj, ctx) -> TurnRewards:
    """--reward pair: rewards_from_pair of the rollout's turns, with the paper's T and eps
    and the run's alpha (ctx.alpha)."""
    return rewards_from_pair(ctx.pair, turn_features(traj), ctx.alpha)


def probe_reward(traj, ctx) -> TurnRewards:
    """--reward <feature set>: rewards_from_probe of the rollout's turns."""
    return rewards_from_probe(ctx.probe, ctx.feature, turn_features(traj))


PROBE_REWARDS = set(probes.FEATURES)
REWARDS = {"outcome": Reward(outcome_reward),
           "pair": Reward(pair_reward, reads_probe=True, needs_stats=True),
           **{name: Reward(probe_reward, reads_probe=True, needs_stats=True)
              for name in probes.FEATURES}}


def turn_rewards(traj, reward: Reward, ctx: RewardContext,
                 outcome_weight: float = 0.0) -> TurnRewards:
    """One rollout's rewards (`reward.fn`) plus `outcome_weight` x its task score on the
    last turn; the frozen probe's P(correct) as the reward gave it."""
    if not traj.steps:              # a prompt longer than --max-len: nothing was generated
        return TurnRewards([], None)
    given = reward.fn(traj, ctx)
    assert len(given.rewards) == len(traj.steps), (len(given.rewards), len(traj.steps))
    if reward.fn is outcome_reward:         # the outcome is the task score already
        return given
    return TurnRewards(with_outcome(given.rewards, traj.score, outcome_weight), given.p_correct)


def with_outcome(rewards: list[float | None], score: float,
                 weight: float) -> list[float | None]:
    """`--outcome-weight w`: w x the task score added to the last turn's reward."""
    if not weight:
        return rewards
    # a new list: a probe reward's list is also its P(correct), which the monitor scores
    return rewards[:-1] + [(rewards[-1] or 0.0) + weight * score]


# ---- Advantages (METHOD.md §9): a group's per-turn rewards -> each turn's A -----------

def group_advantages(rewards: list[list[float | None]]) -> tuple[list[list[float]], bool]:
    """Per-turn advantages of one group of G rollouts, and whether the group was all equal.

    rewards[i][t] = r_{i,t} or None (turn without reward). Pool every reward of the group:
        r^ = (r - mean) / (std + 1e-6)  (the population std),   A_{i,t} = sum_{k>=t} r^_{i,k}
    "All equal" allows rounding noise (std <= 1e-8): the same score summed in another order."""
    pooled = torch.tensor([r for row in rewards for r in row if r is not None],
                          dtype=torch.float64)
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
    """`--advantage release`, the authors' release: A_{i,t} = r_{i,t} - mean_t r_{i,.} +
    z_i, z_i = the group-normalized total R_i = sum_t r_{i,t} (population std; only
    centered when std <= 1e-8). A turn without a reward counts 0; a group of one rollout
    keeps A = r. "All equal": no turn of the group gets an advantage."""
    rows = [torch.tensor([0.0 if r is None else r for r in row], dtype=torch.float64)
            for row in rewards]
    # a group of one rollout has no standing in it: its advantages are its rewards
    if len(rows) == 1:
        advantages = [rows[0].tolist()]
    else:
        totals = torch.stack([row.sum() for row in rows])
        std = totals.std(correction=0)
        z = (totals - totals.mean()) / std if std > 1e-8 else totals - totals.mean()
        advantages = [(row - row.mean() + z_i).tolist() if len(row) else []
                      for row, z_i in zip(rows, z.tolist())]
    return advantages, all(abs(a) <= 1e-8 for row in advantages for a in row)


# ---- The batch and the loss (METHOD.md §9): each turn's A on its tokens, PPO-clip + KL

@dataclass
class Batch:
    """A step's rollouts right-padded into B rows of T tokens, as the update consumes
    them: one row per token sequence of a rollout (make_batch)."""
    ids: torch.Tensor               # (B, T) long
    mask: torch.Tensor              # (B, T) bool: True on tokens the policy generated
    adv: torch.Tensor               # (B, T) float32: A of the turn each policy token belongs to
    lengths: list[int]              # real length of each row
    per_turn: torch.Tensor          # (B, T) float32: 1 / its turn's policy tokens (release)
    n_turns: int                    # turns with a policy token (release)

    def counts(self) -> dict[str, int]:
        """What a loss divides by, this process's share: policy tokens that are predicted
        (a row's first token is not) and turns. The update sums them over the processes."""
        return {"tokens": int(self.mask[:, 1:].sum().item()), "turns": self.n_turns}


def batch_rows(trajs: list[probes.Trajectory]) -> tuple[list, dict]:
    """The rows of a batch, one per token sequence (traj, k) of each rollout (a rollout
    is one sequence, or several where it was cut, probes.Trajectory.segments), and each
    one's index."""
    rows = [(traj, k) for traj in trajs for k in range(len(traj.segments))]
    row_of = {(id(traj), k): r for r, (traj, k) in enumerate(rows)}
    return rows, row_of


def make_batch(trajs: list[probes.Trajectory], advantages: list[list[float]],
               pad_id: int) -> Batch:
    """One right-padded row per token sequence; the mask covers the generated tokens
    only, and each of them carries its turn's advantage (advantages[i][t]: rollout i's
    turn t)."""
    rows, row_of = batch_rows(trajs)
    B = len(rows)
    T = max(len(traj.segments[k]) for traj, k in rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    adv = torch.zeros(B, T, dtype=torch.float32)
    per_turn = torch.zeros(B, T, dtype=torch.float32)
    n_turns = 0
    for r, (traj, k) in enumerate(rows):
        ids[r, :len(traj.segments[k])] = torch.tensor(traj.segments[k])
    # each turn's generated tokens: in the mask, with the turn's advantage and weight
    for traj, a in zip(trajs, advantages):
        for step, a_t in zip(traj.steps, a):
            r = row_of[id(traj), step.segment]
            s, e = step.span                    # the turn's tokens in its row
            mask[r, s:e] = True
            adv[r, s:e] = a_t
            per_turn[r, s:e] = 1.0 / max(e - s, 1)
            n_turns += e > s
    return Batch(ids, mask, adv, [len(traj.segments[k]) for traj, k in rows], per_turn, n_turns)


def grpo_loss(logp, logp_old, logp_ref, adv, eps: float, beta: float, n_tokens: float):
    """METHOD.md §9: over N policy tokens (each input (N,)), the sum of
        -min(rho A, clip(rho, 1-eps, 1+eps) A) + beta KL_k3
    divided by n_tokens (the batch's). Returns the loss (a scalar tensor) and, for the
    step's metrics, the sums over the N tokens of the KL, the clip indicator, rho and the
    surrogate (floats)."""
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
    """`--advantage release` (departures 3 and 4 above): per turn, the mean over its tokens
    (turn_weight = 1 / its tokens) of the clipped surrogate + beta (logp - logp_ref), the
    release's KL estimate; then the mean over the batch's turns. At one epoch this is the
    release's REINFORCE step:
        -(1 / n_turns) sum_turns (A mean_t grad log pi_t
                                  - beta mean_t grad(log pi_t - log pi_ref,t))
    Returns what grpo_loss returns, the KL summed being k3 as there."""
    ratio = torch.exp(logp - logp_old)                          # rho
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
    loss = ((pg + beta * (logp - logp_ref)) * turn_weight).sum() / n_turns
    with torch.no_grad():
        d = logp_ref - logp
        clip = ((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + eps) & (adv > 0))
        sums = {"kl": (torch.expm1(d) - d).sum().item(), "clip": clip.sum().item(),
                "ratio": ratio.sum().item(), "pg": pg.sum().item()}
    return loss, sums


# ---- An advantage form with its loss: `--advantage` name -> Objective -----------------

@dataclass
class Part:
    """One micro-batch of the update, as a loss reads it: some rows of the batch, cut to
    the longest of them, and the divisors of the whole batch."""
    batch: Batch
    rows: list[int]                 # its rows of the batch ...
    T: int                          # ... cut to the longest of them
    totals: dict[str, float]        # Batch.counts summed over the processes: the loss's divisors

    def at_policy_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """A (B, T) per-token tensor of the batch at this part's predicted policy tokens,
        (N,): the order of the log-probabilities model.token_logprobs gives."""
        mask = self.batch.mask[self.rows, :self.T][:, 1:]
        return x[self.rows, 1:self.T][mask]


def process_loss(logp, logp_old, logp_ref, adv, part: Part, eps: float, beta: float):
    """--advantage process (and the lab's forms): grpo_loss over the policy tokens."""
    return grpo_loss(logp, logp_old, logp_ref, adv, eps, beta, part.totals["tokens"])


def release_turn_loss(logp, logp_old, logp_ref, adv, part: Part, eps: float, beta: float):
    """--advantage release: release_loss, each token weighted by 1 / its turn's tokens."""
    turn_weight = part.at_policy_tokens(part.batch.per_turn).to(adv.device)
    return release_loss(logp, logp_old, logp_ref, adv, turn_weight, eps, beta,
                        part.totals["turns"])


@dataclass(frozen=True)
class Objective:
    """One row of ADVANTAGES, what `--advantage` chooses: how a group's rewards become
    advantages, the loss they enter, and the temperature of that loss's log pi."""
    # (the group's per-turn rewards r[i][t], its task scores s[i]) -> (A[i][t], all_equal)
    advantages: Callable
    # (logp, logp_old, logp_ref, adv, part, eps, beta) -> (loss, sums), each input (N,)
    # over the part's policy tokens
    loss: Callable = process_loss
    # log pi's temperature: None, the one the tokens were sampled at; the release's is 1
    # whatever it sampled at
    temperature: float | None = None


ADVANTAGES = {"process": Objective(lambda rewards, scores: group_advantages(rewards)),
              "release": Objective(lambda rewards, scores: release_advantages(rewards),
                                   release_turn_loss, temperature=1.0)}


# ---- The update: the objective's loss over micro-batches, an AdamW step a pass --------

@dataclass
class Processes:
    """The processes a run is shared over, as the update, the metrics and the evaluation
    see them: this process alone. lab/torchrun.py's subclass reduces across the processes
    of torchrun, each playing its share of the prompts."""
    rank: int = 0
    size: int = 1
    device: str = "cpu"             # where reduced tensors live (cuda for nccl)

    @property
    def main(self) -> bool:
        """Whether this is the process that writes the run's files and prints its lines."""
        return self.rank == 0

    def log(self, *args, **kw) -> None:
        """print, on the main process alone (the others would repeat its lines)."""
        if self.main:
            print(*args, **kw)

    def all_sum(self, values: list[float]) -> list[float]:
        """Each of `values` summed over the processes (every process passes as many)."""
        return [float(v) for v in values]

    def all_max(self, value: float) -> float:
        """The largest `value` over the processes."""
        return float(value)

    def gather(self, values: list[float], size: int) -> list[float]:
        """Every process's `values` (at most `size` each), concatenated in rank order."""
        return list(values)

    def barrier(self, *_) -> None:
        """Wait until every process is here; also all_reduce_grads (sum each parameter's
        gradient) and close (leave the group), which one process alone need not do."""
        pass

    all_reduce_grads = close = barrier


def micro_batches(lengths: list[int], rows: int, token_budget: int) -> list[list[int]]:
    """Consecutive rows in groups of at most `rows` rows and `token_budget` padded tokens
    (rows x the longest), bounding the update's memory; a longer row goes alone."""
    chunks, longest = [], 0
    for r, n in enumerate(lengths):
        longest = max(longest, n)
        if chunks and len(chunks[-1]) < rows and \
                (len(chunks[-1]) + 1) * longest <= token_budget:
            chunks[-1].append(r)
        else:
            chunks.append([r])
            longest = n
    return chunks


# the statistics of a step whose batch has no policy token: no update was made
EMPTY_UPDATE = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio": 0.0, "grad_norm": 0.0,
                "tokens": 0, "empty_batch": 1, "skipped_updates": 0}


def update(policy, optimizer, batch: Batch, objective: Objective, procs, *, temperature: float,
           eps: float, beta: float, grad_clip: float, epochs: int = 1, rows: int = 4,
           token_budget: int = 16384) -> dict:
    """`epochs` passes over the batch, each one optimizer step on the gradient of the
    objective's loss summed over micro-batches of at most `rows` rows and `token_budget`
    padded tokens. log pi is taken at `temperature`, the one the tokens were sampled at
    (or the objective's own); the reference log pi (adapter off) and the old one (the
    first pass's) once. `procs`: the processes the batch is shared over (Processes: their
    counts and gradients are summed). Returns the first pass's metrics, each token's mean
    (loss, KL, clip fraction, ratio), and the gradient norm before the clip."""
    counts = batch.counts()
    totals = dict(zip(counts, procs.all_sum(list(counts.values()))))
    n_tokens = totals["tokens"]
    if n_tokens == 0:   # 0/0 loss; and AdamW on zero gradients still moves by its momentum
        return dict(EMPTY_UPDATE)
    parts = [Part(batch, chunk, max(batch.lengths[r] for r in chunk), totals)
             for chunk in micro_batches(batch.lengths, rows, token_budget)]
    # log pi at the temperature the tokens were drawn at, unless the objective fixes it
    if objective.temperature is not None:
        temperature = objective.temperature
    ref, old = {}, {}
    skipped = 0
    for epoch in range(epochs):
        sums = backward_pass(policy, optimizer, parts, objective, temperature, ref, old, eps,
                             beta)
        grad_norm = optimizer_step(optimizer, grad_clip, procs)
        if not math.isfinite(grad_norm):
            skipped += 1
        if epoch == 0:
            first = procs.all_sum(sums)
    loss, kl, clip, ratio = first
    return {"loss": loss, "kl": kl / n_tokens, "clip_frac": clip / n_tokens,
            "ratio": ratio / n_tokens, "grad_norm": grad_norm, "tokens": int(n_tokens),
            "empty_batch": 0, "skipped_updates": skipped}


def backward_pass(policy, optimizer, parts: list[Part], objective: Objective,
                  temperature: float, ref: dict, old: dict, eps: float,
                  beta: float) -> list[float]:
    """One pass: the gradient of the loss accumulated over the micro-batches. ref and old
    hold each part's reference and old log pi, filled at the first pass. Returns the sums
    of the loss, the KL, the clip indicator and the ratio over this process's tokens."""
    dev = mdl.input_device(policy)
    optimizer.zero_grad(set_to_none=True)
    sums = [0.0] * 4
    for c, part in enumerate(parts):
        ids = part.batch.ids[part.rows, :part.T].to(dev)
        mask = part.batch.mask[part.rows, :part.T]
        adv = part.at_policy_tokens(part.batch.adv).to(dev)         # (N,) A of each token
        if c not in ref:
            with torch.no_grad(), mdl.lora_disabled(policy):
                ref[c] = mdl.token_logprobs(policy, ids, mask, temperature)
        logp = mdl.token_logprobs(policy, ids, mask, temperature)    # (N,)
        if c not in old:
            old[c] = logp.detach()
        loss, s = objective.loss(logp, old[c], ref[c], adv, part, eps, beta)
        loss.backward()
        sums = [a + b for a, b in zip(sums, (loss.item(), s["kl"], s["clip"], s["ratio"]))]
    return sums


def optimizer_step(optimizer, grad_clip: float, procs) -> float:
    """The gradients all-reduced over the processes, their global norm clipped to
    grad_clip, one AdamW step. Returns the norm before the clip; a norm that is not
    finite skips the step (a NaN or inf in the gradient would ruin the adapter)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # processes with fewer tokens, or none, still join the all-reduce
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    procs.all_reduce_grads(params)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip).item()
    if math.isfinite(grad_norm):
        optimizer.step()
    return grad_norm
