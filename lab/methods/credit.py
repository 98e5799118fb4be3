"""Credit experiments on the built-in worlds: which advantage lets a dense per-turn reward beat
the outcome (lab/FINDINGS.md).

- `--reward labels`: each turn's exact step label (1 right, 0 wrong), the perfect process reward,
  the ceiling every dense reward is measured against; `--reward confidence`: each turn's own mean
  token log-probability, the trivial internal signal an internal reward must beat;
- `--advantage position` and `--advantage outcome-turn` (`--turn-weight`), beside the core's
  `process` and `release`;
- the premise gate, before training: does the chosen advantage rank the right decision above the
  slip on held-out own turns? (its AUROC in summary.json, `premise_gate`);
- `--oversample K`, DAPO's dynamic sampling: groups with nothing to say set aside.

lab/train.py's loop adds this module's REWARDS and `forms` to the core's tables and calls the gate
and the oversampling where they run.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch

import grpo
import pair
import probes
from lab.methods import onpolicy
from lab.probing import detection
from lab.worlds import shop


def labels_reward(traj: probes.Trajectory, ctx) -> pair.TurnRewards:
    # the built-in worlds' exact step labels (1 right, 0 wrong): the perfect process reward, the
    # ceiling every dense reward is measured against
    return pair.TurnRewards([float(ok) for ok in traj.episode.labels()])


def confidence_reward(traj: probes.Trajectory, ctx) -> pair.TurnRewards:
    # the trivial internal signal, no probe at all: each turn's own mean token log-probability
    # as sampled (-Step.nll), the policy's confidence in it; the group's normalization centres it
    return pair.TurnRewards([None if step.nll is None else -step.nll for step in traj.steps])


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
    return pair.group_advantages(position_centred(rewards))


def outcome_turn_advantages(rewards: list[list[float | None]], scores: list[float],
                            lam: float) -> tuple[list[list[float]], bool]:
    """`--advantage outcome-turn`: A_{i,t} = z_i + lambda c_{i,t}. z_i = the outcome's group
    advantage, (s_i - mean_j s_j) / (std_j s_j + 1e-6) over the group's task scores s (0 when
    they are all equal): the number `process` gives every token under --reward outcome. c_{i,t}
    = the turn's own reward centred by the group's mean at its turn index (position_centred; 0
    for a turn without a reward): no sum over later turns, so a turn is credited for itself and
    never for the harder turns its right decision leads to. lambda = --turn-weight. A rollout
    that played no turn has no advantage. All equal: no turn gets an advantage."""
    z, _ = pair.group_advantages([[s] if row else [] for row, s in zip(rewards, scores)])
    advantages = [[z_i[0] + lam * (c or 0.0) for c in row] if row else []
                  for row, z_i in zip(position_centred(rewards), z)]
    return advantages, all(abs(a) <= 1e-8 for row in advantages for a in row)


# The premise gate, before training (built-in worlds): a per-turn reward helps only if the
# advantage built from it credits the right decision above the slip. The reward can rank a turn
# right while the advantage does not: under `process` a turn's advantage is the sum of the
# rewards still to come, and after the right decision the later turns may be harder and score
# lower. So the chosen form's advantage is scored on the held-out own turns the probes are
# scored on (groups of --corpus-samples base-policy rollouts of validation episodes), at the
# habits' first-error turns with a clean prefix (onpolicy.habit_at): the slip against the same
# decision made right.

# what stored_rewards computes
GATE_REWARDS = {"outcome", "labels", "confidence", "pair"} | pair.PROBE_REWARDS


def stored_rewards(turns: detection.Split, ctx, args) -> list[float | None] | None:
    """One rollout's rewards from its stored turns (features, labels, task score), as
    pair.turn_rewards gives them from the trajectory; None for a reward that needs more (a
    judge, a forward of the policy, trees)."""
    name, score = args.reward, float(turns.raw["score"][0])
    if name == "outcome":
        return [None] * (len(turns.y) - 1) + [score]
    if name == "labels":
        rewards = [float(y) for y in turns.y.tolist()]
    elif name == "confidence":
        rewards = [None if math.isnan(x) else -x for x in turns.raw["nll"].tolist()]
    elif name == "pair":
        rewards = pair.rewards_from_pair(ctx.pair, turns.raw, ctx.alpha).rewards
    elif name in pair.PROBE_REWARDS:
        rewards = pair.rewards_from_probe(ctx.probe, name, turns.raw).rewards
    else:
        return None
    return pair.with_outcome(rewards, score, args.outcome_weight)


@dataclass
class GateScores:                   # every held-out turn's numbers; NaN where it has none
    advantage: torch.Tensor         # (N,) float64: the form's advantage A_{i,t}
    reward: torch.Tensor            # (N,) float64: the reward r_{i,t} the form was given
    centred: torch.Tensor           # (N,) float64: r_{i,t} against its group's mean at index t
    groups: int                     # groups of rollouts (one an episode)


def gate_scores(turns: detection.Split, ctx, args, form: pair.Objective) -> GateScores | None:
    """Each held-out turn's advantage under `form`, its reward (stored_rewards) and that reward
    centred (position_centred), with each episode's rollouts as one group, as a run's step
    groups them. None for a reward stored_rewards cannot compute."""
    rows = {}                                           # rollout -> its turns' row indices
    for k, r in enumerate(turns.raw["rollout"].tolist()):
        rows.setdefault(r, []).append(k)
    groups = {}                                         # episode -> its rollouts
    for idx in rows.values():
        groups.setdefault(turns.episode_id[idx[0]], []).append(idx)
    scores = GateScores(*(torch.full((len(turns.y),), math.nan, dtype=torch.float64)
                          for _ in range(3)), groups=len(groups))

    def put(into: torch.Tensor, idx: list[int], values: list[float | None]) -> None:
        into[idx] = torch.tensor([math.nan if v is None else v for v in values],
                                 dtype=torch.float64)
    for group in groups.values():
        rewards = [stored_rewards(turns.take(idx), ctx, args) for idx in group]
        if any(r is None for r in rewards):
            return None
        a, _ = form.advantages(rewards, [float(turns.raw["score"][idx[0]]) for idx in group])
        for idx, a_i, r_i, c_i in zip(group, a, rewards, position_centred(rewards)):
            put(scores.advantage, idx, a_i)
            put(scores.reward, idx, r_i)
            put(scores.centred, idx, c_i)
    return scores


def first_errors(turns: detection.Split, at: list[str | None]) -> torch.Tensor:
    """The first-error turns with a clean prefix, as a mask: where `at` (onpolicy.habit_at)
    names the decision made at the turn and no earlier turn of the rollout is wrong."""
    return torch.tensor([a is not None for a in at]) & (turns.raw["distance"] < 0)


def premise_gate(turns: detection.Split, scores: GateScores, at: list[str | None],
                 args) -> dict:
    """AUROC of the `--advantage` (scores.advantage) and of the reward alone for right (1)
    against wrong (0) at the first-error turns with a clean prefix (first_errors); by habit; and
    on every clean-prefix turn."""
    clean = turns.raw["distance"] < 0
    first = first_errors(turns, at)

    def auroc(sel, score):
        y = turns.y[sel]
        if not 0 < int(y.sum()) < len(y) or score[sel].isnan().any():
            return None
        return probes.auroc(y, score[sel])
    adv = scores.advantage
    at = [None if h is None else shop.slip_kind(h) for h in at]      # shop-copy: by kind
    habits = sorted({h for h, f in zip(at, first.tolist()) if f})
    return {"advantage": args.advantage, "reward": args.reward, "groups": scores.groups,
            "turns": int(first.sum()), "slips": int((turns.y[first] == 0).sum()),
            "auroc": auroc(first, adv), "reward_auroc": auroc(first, scores.reward),
            "auroc_interval": bootstrap_auroc(turns.y[first], adv[first]),
            "by_habit": {h: auroc(first & torch.tensor([x == h for x in at]), adv)
                         for h in habits},
            "clean_prefix": auroc(clean, adv)}


GATE_RESAMPLES = 2000     # the bootstrap's resamples of the first-error turns


def bootstrap_auroc(y: torch.Tensor, score: torch.Tensor, level: float = 0.95,
                    seed: int = 0) -> list[float] | None:
    """A percentile bootstrap interval of AUROC(y, score) over the turns, resampled with
    replacement (GATE_RESAMPLES draws, seeded: the same interval every time; a draw holding one
    class only is skipped); None when the turns hold one class or a score is missing."""
    n = len(y)
    if not 0 < int(y.sum()) < n or score.isnan().any():
        return None
    g = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(GATE_RESAMPLES):
        idx = torch.randint(n, (n,), generator=g)
        if 0 < int(y[idx].sum()) < n:
            values.append(probes.auroc(y[idx], score[idx]))
    values.sort()
    lo = values[int((1 - level) / 2 * len(values))]
    hi = values[int((1 + level) / 2 * len(values)) - 1]
    return [lo, hi]


def log_gate(gate: dict, log) -> None:
    """The gate's line at start, and the warning when the advantage credits the slip."""
    num = grpo.num
    log(f"premise gate: the {gate['advantage']} advantage of --reward {gate['reward']} at the "
        f"habits' first-error turns, clean prefix ({gate['turns']} held-out turns, "
        f"{gate['slips']} slips, {gate['groups']} groups of base-policy rollouts): AUROC "
        f"{num(gate['auroc'])}{interval_text(gate.get('auroc_interval'))} (the reward alone "
        f"{num(gate['reward_auroc'])}"
        + "".join(f"; {h} {num(a)}" for h, a in gate["by_habit"].items())
        + f"); on every clean-prefix turn {num(gate['clean_prefix'])}", flush=True)
    if gate["auroc"] is not None and gate["auroc"] < 0.5:
        log(f"warning: the advantage credits the slip: the {gate['advantage']} advantage ranks "
            f"the slip above the same decision made right (AUROC {gate['auroc']:.3f} on "
            f"{gate['turns']} held-out first-error turns, the reward alone "
            f"{num(gate['reward_auroc'])}): {CREDIT_CAUSES.get(gate['advantage'], '')}"
            "(premise_gate in summary.json; python -m lab.premise --gates takes it apart)",
            flush=True)


# Where an advantage takes a turn's credit from, by form: why it can rank the slip above the
# same decision made right when the reward alone does not (log_gate's warning)
SUMMED = "the turns that follow a decision, not the decision, set its credit "
CREDIT_CAUSES = {
    "process": SUMMED, "position": SUMMED,
    "release": "a turn is credited with its rollout's normalized total beside its own reward "
               "against the rollout's mean: the rollout, not the decision, sets most of it ",
    "outcome-turn": "beside the outcome's term, the turn's own reward centred within its group "
                    "ranks the slip above the same decision made right ",
}


def interval_text(interval) -> str:
    if interval is None:
        return ""
    return f" [{interval[0]:.3f}, {interval[1]:.3f}]"


OUTCOME_FORMS = ("outcome-turn",)


def check(args, worlds) -> None:
    """The rules between flags of this module's reward and advantage forms."""
    if args.reward == "labels" and args.env not in worlds:
        sys.exit(f"--reward labels: {args.env} has no exact step labels (its replayed tools "
                 f"label only the final answer); only the built-in worlds do "
                 f"({', '.join(worlds)})")
    if args.advantage in OUTCOME_FORMS and args.reward == "outcome":
        sys.exit(f"--advantage {args.advantage} adds a dense per-turn reward to the outcome; "
                 "--reward outcome has none (its own form is --advantage process)")
    if args.advantage in OUTCOME_FORMS and args.outcome_weight:
        sys.exit(f"--outcome-weight: --advantage {args.advantage} adds the outcome's group "
                 "advantage itself; leave it at 0")


def gate_at_setup(args, policy, tok, procs, log, ctx, form: pair.Objective) -> dict | None:
    """The premise gate of the run's reward and advantage form on a built-in world, logged;
    returned for summary.json (None where it does not apply)."""
    if args.reward not in GATE_REWARDS:
        return None
    turns = onpolicy.heldout_turns(args, policy, tok, procs, log)
    scores = gate_scores(turns, ctx, args, form)
    if scores is None:
        return None
    gate = premise_gate(turns, scores, onpolicy.habit_at(turns), args)
    log_gate(gate, log)
    return gate


def oversample(step: int, run, t: dict, play_group) -> tuple[list, list]:
    """`--oversample K` (DAPO's dynamic sampling): up to K x this process's share of the step's
    prompts is played (play_group: the loop's), in order, and a group with no advantage
    (Group.all_equal) is set aside while enough later prompts remain to fill the batch. Returns
    (the groups kept, every group played)."""
    args, procs = run.args, run.procs
    need = len(range(procs.rank, args.batch, procs.size))
    candidates = list(range(procs.rank, args.batch * args.oversample, procs.size))
    kept, played = [], []
    for n, j in enumerate(candidates):
        if len(kept) == need:
            break
        group = play_group(step * args.batch * args.oversample + j, run, t)
        played.append(group)
        if not (group.all_equal and len(candidates) - n - 1 >= need - len(kept)):
            kept.append(group)
    return kept, played


def evaluate_sampled(step: int, policy, tok, held: dict, args, procs) -> dict:
    """`--eval-samples K`: probes.evaluate_all's evaluation, each held-out episode played K times
    at --temperature and --top-p (the training's) instead of once greedily, its score the mean of
    its K. Where a policy's slips are minority samples, greedy decoding makes almost none of
    them and its success says nothing of the policy a run trains."""
    return {"step": step, "samples": args.eval_samples, "temperature": args.temperature,
            "val": sampled(policy, tok, *held["val"], args.val_episodes, args, procs,
                           "validation"),
            "test": sampled(policy, tok, *held["test"], args.eval_episodes, args, procs, "test")}


EVAL_SEED = 7919        # the sampled evaluation's draws: the same in every run and evaluation


def sampled(policy, tok, env, pool, n: int, args, procs, name: str = "held-out") -> dict:
    """The first n episodes of `pool` (0: all), each played args.eval_samples times: mean task
    score, mean turns, every episode's mean score in pool order. The episodes go --eval-batch
    rollouts at a time (whole episodes), each chunk's draws from a generator seeded by its first
    episode's index, so an evaluation draws the same tokens in every run of these settings. Shared
    between processes as probes.evaluate shares its episodes (my_episodes, in_pool_order)."""
    k = args.eval_samples
    count = len(pool) if not n else min(n, len(pool))
    mine = probes.my_episodes(count, procs)
    chunk = max(1, args.eval_batch // k)
    policy.eval()
    scores, turns, t0 = [], 0, time.perf_counter()
    for i in range(0, len(mine), chunk):
        js = mine[i:i + chunk]
        episodes = [env.episode(pool[j]) for j in js for _ in range(k)]
        g = torch.Generator(device=policy.lm_head.weight.device).manual_seed(EVAL_SEED + js[0])
        trajs = probes.rollout(policy, tok, episodes, args, generator=g, stats=False)
        for e in range(len(js)):
            scores.append(sum(t.score for t in trajs[e * k:(e + 1) * k]) / k)
        turns += sum(len(t.steps) for t in trajs)
        if procs.main:
            probes.say_progress(len(scores), len(mine), t0, f"{name} episodes x {k} samples")
    turns = procs.all_sum([turns])[0]
    scores = probes.in_pool_order(scores, mine, count, procs)
    return {"success": sum(scores) / max(count, 1), "episodes": count, "samples": k,
            "decoding": f"{k} samples an episode at T {args.temperature}",
            "turns": turns / max(count * k, 1), "scores": scores}


def add_flags(ap) -> None:
    """This module's flags, on the lab's parser."""
    a = ap.add_argument
    a("--eval-samples", type=int, default=0,
      help="held-out success sampled: each evaluation episode played K times at --temperature, "
           "its score the mean of the K (0: once, greedy)")
    a("--turn-weight", type=float, default=1.0,
      help="--advantage outcome-turn: lambda, the weight of the turn's own centred reward "
           "beside the outcome's group advantage")
    a("--oversample", type=int, default=1, help="DAPO dynamic sampling: play up to K x --batch "
      "prompts, keep the first --batch groups that give some turn an advantage")


REWARDS = {"labels": pair.Reward(labels_reward), "confidence": pair.Reward(confidence_reward)}
FORM_NAMES = ("position", "outcome-turn")


def forms(turn_weight: float = 1.0) -> dict[str, pair.Objective]:
    """This module's advantage forms (rows of pair.ADVANTAGES), outcome-turn with its lambda."""
    return {"position": pair.Objective(lambda rewards, scores: position_advantages(rewards)),
            "outcome-turn": pair.Objective(
                lambda rewards, scores: outcome_turn_advantages(rewards, scores, turn_weight))}


RANGES = {"turn_weight": grpo.finite(), "oversample": grpo.at_least(1),
          "eval_samples": grpo.at_least(0)}
RESUME_KEYS = ("turn_weight", "oversample", "eval_samples")
RESUME_DEFAULTS = {"turn_weight": 1.0, "oversample": 1, "eval_samples": 0}
