"""python -m lab.premise: does a built-in world hold the paper's premise? Measured on its base
policy, with the runs' own settings, before any reward is tried.

    python -m lab.premise --env shop-copy --out results/shop-copy/regime.json
    python -m lab.premise ... -- --temperature 1.0      # flags after -- change the runs' settings

A per-turn reward can only beat the outcome where the outcome cannot say which turn was wrong.
Three of the four conditions for that are properties of the world and its base policy, and this
command measures them:

  sparse outcome   held-out success of the base policy on --episodes test episodes, greedy and
                   sampled at the training temperature (--samples rollouts of each episode, with
                   a 95% interval over the episodes); and how many groups of G rollouts hold no
                   success at all: the groups of the first training step of each of --seeds, and
                   those of the first --groups prompts of the first seed. The outcome's advantage
                   is zero in such a group, so a run learns nothing from it;
  many decisions   the labelled decision turns of each test episode (shop.slip_turns: the turns
                   at which the policy's slips are made, each alone enough to fail the episode);
  low confidence   at the first-error turns with a clean prefix of held-out base-policy rollouts
                   (the premise gate's turns, onpolicy.heldout_turns), the AUROC of the turn's
                   own mean token log-probability for the right turn against the slip, with a
                   bootstrap interval over those turns, by kind of decision, and within
                   groups (the right and the wrong samples of the same decision of the same
                   episode: the comparison a group-relative advantage makes); and
                   what the turn's hidden states and attention hold of the slip there: the
                   AUROC of linear probes (each feature set of the method's, and PAIR's two
                   stages) fitted on those very turns and scored out of fold (folds of
                   episodes), pooled and within groups. The confidence reads the sampled
                   tokens; the probes, the state the policy sampled them from;
  room in a group  at each decision of the groups of G rollouts of the first --groups prompts
                   of the first seed, of the samples that reach it with a clean prefix: how often a group holds both a
                   right and a wrong one (where all are wrong, no per-turn reward has anything
                   to rank).

The fourth, the ceiling (exact step labels against the outcome after the same number of steps),
is a comparison of trained runs: `python -m lab.compare` (lab/README.md).

    python -m lab.premise ... --gates pair:advantage=outcome-turn confidence -- ...

takes apart, on the same held-out turns, the premise gate of each reward through its form (what
a run of it logs at its start): the advantage's AUROC at the first errors beside the reward's own,
pooled over episodes and within each group of rollouts (gate_apart), and the probe the reward
reads, fitted as a run fits it, scored on those turns, pooled and within groups (probe_apart).
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import grpo
import pair
import probes
from lab import compare, train
from lab.methods import baselines, credit, onpolicy
from lab.probing import detection
from lab.worlds import shop


def decision_counts(env, pool, n: int) -> list[int]:
    """The labelled decision turns (shop.slip_turns) of each of the first n episodes of pool."""
    return [len(shop.slip_turns(env.episode(i).task)) for i in pool[:n]]


def mean_interval(xs: list[float]) -> tuple[float, list[float]]:
    """The mean and its 95% normal interval (1.96 standard errors), clipped to [0, 1]."""
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / max(n - 1, 1))
    half = 1.96 * sd / math.sqrt(n)
    return mean, [max(0.0, mean - half), min(1.0, mean + half)]


def wilson(k: int, n: int) -> list[float]:
    """The 95% Wilson interval of a proportion k / n."""
    z = 1.96
    centre = (k + z * z / 2) / (n + z * z)
    half = z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    return [max(0.0, centre - half), min(1.0, centre + half)]


@dataclass
class Group:
    """One prompt's group of rollouts: whether none succeeded, and at each decision the labels
    of the samples that reached it with a clean prefix (right True, the slip False)."""
    empty: bool
    made: dict[str, list[bool]]


def first_groups(policy, tok, env, pool, args, seed: int, prompts: int) -> list[Group]:
    """The groups of args.group rollouts of the base policy of the first `prompts` prompts of a
    run of `seed`, in the order its steps play them (grpo.prompt_index), with the same generator
    (grpo.sampler)."""
    out = []
    for g in range(prompts):
        index = pool[grpo.prompt_index(seed, g, len(pool))]
        episodes = [env.episode(index) for _ in range(args.group)]
        trajs = probes.rollout(policy, tok, episodes, args, generator=grpo.sampler(policy, seed, g),
                               stats=False)
        decisions = shop.slip_turns(episodes[0].task)
        made = {d: [] for d in decisions}
        for t in trajs:
            labels = t.episode.labels()
            for d, k in decisions.items():
                if k < len(labels) and all(labels[:k]):      # reached with a clean prefix
                    made[d].append(labels[k])
        out.append(Group(not any(t.score > 0 for t in trajs), made))
    return out


def room_in_groups(groups: list[Group]) -> dict:
    """How often a group holds both a right and a wrong sample of a decision: over the (group,
    decision) pairs at least one sample reached with a clean prefix, with a percentile bootstrap
    over the groups; the same at the first decision only (every sample reaches it, unless it went
    wrong earlier); and the share of groups holding such a pair at some decision (Wilson)."""
    both = [[len(set(m)) == 2 for m in g.made.values() if m] for g in groups]
    first = [next((len(set(m)) == 2 for m in g.made.values() if m), False) for g in groups]
    anywhere = sum(any(b) for b in both)
    reached = sum(len(b) for b in both)
    g = torch.Generator().manual_seed(0)
    values = []
    for _ in range(credit.GATE_RESAMPLES):
        idx = torch.randint(len(groups), (len(groups),), generator=g).tolist()
        n = sum(len(both[i]) for i in idx)
        if n:
            values.append(sum(sum(both[i]) for i in idx) / n)
    values.sort()
    return {"groups": len(groups), "decisions_reached": reached,
            "both": sum(map(sum, both)) / reached if reached else None,
            "both_interval95": [values[int(0.025 * len(values))],
                                values[int(0.975 * len(values)) - 1]] if values else None,
            "first_decision_both": sum(first) / len(groups),
            "first_decision_interval95": wilson(sum(first), len(groups)),
            "groups_with_both": anywhere / len(groups),
            "groups_with_both_interval95": wilson(anywhere, len(groups))}


def within_groups(y: torch.Tensor, score: torch.Tensor, keys: list) -> dict | None:
    """The AUROC within groups: over every pair of a right (1) and a wrong (0) turn of the same
    key (an episode's decision: the same decision of the same episode, sampled both ways), the
    fraction where the right one scores higher (ties 1/2; detection.pairwise_accuracy), with a
    percentile bootstrap interval over the keys; None where no key holds a pair."""
    counts = list(detection.group_wins(y, score, keys).values())
    if not counts:
        return None
    wins, pairs = torch.tensor(counts, dtype=torch.float64).T
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(len(pairs), (credit.GATE_RESAMPLES, len(pairs)), generator=g)
    values = (wins[idx].sum(1) / pairs[idx].sum(1)).sort().values.tolist()
    return {"auroc": (wins.sum() / pairs.sum()).item(), "groups": len(pairs),
            "pairs": int(pairs.sum()),
            "interval95": [values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]]}


def decision_keys(turns, at: list[str | None], sel: torch.Tensor) -> list[tuple]:
    """(episode, decision) of each selected turn: the groups within_groups compares in."""
    return [(e, a) for e, a, s in zip(turns.episode_id, at, sel.tolist()) if s]


def confidence_at_first_errors(turns, at: list[str | None]) -> dict:
    """AUROC of the turn's own mean token log-probability (-nll), right (1) against slip (0), at
    the first-error turns with a clean prefix (credit.first_errors: `at`, onpolicy.habit_at,
    names each turn's decision), overall (with its bootstrap interval) and by kind of decision
    (shop.slip_kind)."""
    first = credit.first_errors(turns, at)
    confidence = -turns.raw["nll"].double()

    def auroc(sel):
        y = turns.y[sel]
        return probes.auroc(y, confidence[sel]) if 0 < int(y.sum()) < len(y) else None
    kinds = sorted({shop.slip_kind(a) for a, f in zip(at, first.tolist()) if f})
    by_kind = {}
    for kind in kinds:
        here = first & torch.tensor([a is not None and shop.slip_kind(a) == kind for a in at])
        by_kind[kind] = {"turns": int(here.sum()), "slips": int((turns.y[here] == 0).sum()),
                         "auroc": auroc(here)}
    return {"turns": int(first.sum()), "slips": int((turns.y[first] == 0).sum()),
            "auroc": auroc(first),
            "auroc_interval": credit.bootstrap_auroc(turns.y[first], confidence[first]),
            "within": within_groups(turns.y[first], confidence[first],
                                    decision_keys(turns, at, first)),
            "by_kind": by_kind}


# The feature sets the readout fits (probes.feature), and PAIR's two stages on them.
READOUT_FEATURES = ("last_token", "mean_pooled", "multi_layer", "multi_attn")
READOUT_FOLDS = 5


def readout_at_first_errors(turns, at: list[str | None], folds: int = READOUT_FOLDS,
                            seed: int = 0) -> dict | None:
    """What the turn's own hidden states and attention hold of the slip: at the first-error
    turns with a clean prefix (confidence_at_first_errors' turns), a linear probe of each of
    READOUT_FEATURES and PAIR (pair.fit_pair: stage 1 on last_token, stage 2 on multi_attn and
    s_bc), fitted on those very turns (C 0.01, as the method's), each turn scored by the probe
    fitted on the other folds (`folds` folds of episodes, pair.episode_folds); the AUROC of the
    out-of-fold scores, right (1) against slip (0), with a bootstrap interval over the turns.

    Why: the method's probes are fitted on every turn of the policy's rollouts, most of them
    after an earlier error or away from any slip, so a probe at chance at the slips may only be
    fitted to other turns. Fitted on the slips themselves, a probe at chance says the slip is not
    in the features at all; the turn's confidence, read off the sampled tokens, is the measure
    beside it. None when the turns are too few: fewer episodes than folds, or a fold whose
    complement holds one class only."""
    first = credit.first_errors(turns, at)
    idx = first.nonzero().flatten()
    raw = {k: v[idx] for k, v in turns.raw.items() if k in probes.RAW_KEYS}
    y = turns.y[idx]
    episodes = [turns.episode_id[i] for i in idx.tolist()]
    if len(set(episodes)) < folds:
        return None
    fold = pair.episode_folds(episodes, folds, seed)
    if any(not 0 < int(y[fold != k].sum()) < int((fold != k).sum()) for k in range(folds)):
        return None                                     # a fold would fit on one class
    scores = {name: torch.full((len(idx),), math.nan, dtype=torch.float64)
              for name in (*READOUT_FEATURES, "pair")}
    for k in range(folds):
        held, fit = fold == k, fold != k
        train_raw = {key: v[fit] for key, v in raw.items()}
        held_raw = {key: v[held] for key, v in raw.items()}
        for name in READOUT_FEATURES:
            probe = probes.Probe().fit(probes.feature(name, train_raw), y[fit])
            scores[name][held] = probe.decision_function(probes.feature(name, held_raw))
        scores["pair"][held] = pair.fit_pair(train_raw, y[fit]).scores(held_raw)[1]
    keys = decision_keys(turns, at, first)
    return {"turns": len(idx), "slips": int((y == 0).sum()), "folds": folds,
            "auroc": {name: probes.auroc(y, s) for name, s in scores.items()},
            "auroc_interval": {name: credit.bootstrap_auroc(y, s) for name, s in scores.items()},
            "within": {name: within_groups(y, s, keys) for name, s in scores.items()}}


def probe_apart(turns, at: list[str | None], ctx) -> dict | None:
    """The probe a reward reads (ctx.pair: PAIR's s_final; ctx.probe: its P(correct)), as a run
    fits it, scored at the first-error turns with a clean prefix: its AUROC, right against slip,
    pooled (with a bootstrap interval) and within groups (within_groups). None for a reward that
    reads no probe."""
    if ctx is None or ctx.pair is None and ctx.probe is None:
        return None
    first = credit.first_errors(turns, at)
    raw = {k: v[first] for k, v in turns.raw.items() if k in probes.RAW_KEYS}
    y = turns.y[first]
    if ctx.pair is not None:
        score = ctx.pair.scores(raw)[1]
    else:
        score = ctx.probe.predict_proba(probes.feature(ctx.feature, raw))
    return {"turns": int(first.sum()), "slips": int((y == 0).sum()),
            "auroc": probes.auroc(y, score) if 0 < int(y.sum()) < len(y) else None,
            "auroc_interval": credit.bootstrap_auroc(y, score),
            "within": within_groups(y, score, decision_keys(turns, at, first))}


def gate_apart(turns, at: list[str | None], ctx, args, form: pair.Objective) -> dict | None:
    """The premise gate (credit.premise_gate) of args.reward through `form`, taken apart at the
    first-error turns with a clean prefix, overall and by kind of decision, into four AUROCs of
    the right turn against the slip:
      gate           the advantage's: what a run logs at its start;
      reward pooled  the reward's own, over the turns of every episode (the gate's "reward
                     alone");
      reward within  the reward's within each group of one episode's rollouts: over the pairs
                     of a right turn and a slip of the same group, the fraction where the right
                     one is rewarded higher (ties 1/2; detection.pairwise_accuracy);
      centred        the reward centred by its group's mean at its turn index
                     (credit.position_centred): outcome-turn's per-turn term, what position sums.
    Why: a group-relative advantage sees a reward only against the rest of its group, so where
    the pooled and the within-group readings part (a reward that scores whole episodes apart but
    ranks a slip against the same decision made right the wrong way), the gate follows the
    within-group one. None for a reward credit.stored_rewards cannot compute."""
    scores = credit.gate_scores(turns, ctx, args, form)
    if scores is None:
        return None
    gate = credit.premise_gate(turns, scores, at, args)
    reward, first = scores.reward, credit.first_errors(turns, at)
    kind = [None if a is None else shop.slip_kind(a) for a in at]

    def part(sel, gate_auroc):
        sel = sel & ~reward.isnan()
        y = turns.y[sel]
        if not 0 < int(y.sum()) < len(y):
            return None
        episodes = [e for e, s in zip(turns.episode_id, sel.tolist()) if s]
        within = detection.pairwise_accuracy(y, reward[sel], episodes)
        return {"turns": int(sel.sum()), "slips": int((y == 0).sum()), "gate": gate_auroc,
                "reward_pooled": probes.auroc(y, reward[sel]),
                "reward_within": None if math.isnan(within) else within,    # no pair in a group
                "centred": probes.auroc(y, scores.centred[sel])}
    return {"reward": args.reward, "advantage": args.advantage,
            "all": part(first, gate["auroc"]),
            "by_kind": {k: part(first & torch.tensor([x == k for x in kind]), a)
                        for k, a in gate["by_habit"].items()}}


def run_args(args, reward: str, flags: list[str], procs) -> argparse.Namespace:
    """The runs' settings (lab.train's flags after `--`) for `reward` with its own `flags`, the
    preset resolved as a run resolves it."""
    with tempfile.TemporaryDirectory() as tmp:      # nothing is written there
        argv = ["--env", args.env, "--out", tmp, "--reward", reward, "--threads",
                str(args.threads), "--eval-samples", str(args.samples), *args.run_flags, *flags]
        if args.model:
            argv += ["--model", args.model]
        run = train.parse_args(argv, recorded=False)
    grpo.resolve_preset(run, procs, train.WORLDS)
    return run


def measure(args) -> dict:
    """The regime of args.env's base policy (see the module's docstring)."""
    procs = pair.Processes()
    run = run_args(args, "confidence", [], procs)
    torch.set_num_threads(args.threads)
    policy, tok = grpo.load_policy(run, procs, train.WORLDS)
    env, pool, held = grpo.environments(run, tok, train.WORLDS, train.REPLAYS)
    test_env, test_pool = held["test"]
    t0 = time.perf_counter()
    decisions = decision_counts(test_env, test_pool, args.episodes)
    greedy = probes.evaluate(policy, tok, test_env, test_pool, args.episodes, run, procs, "test")
    print(f"greedy: {greedy['success']:.3f} on {greedy['episodes']} test episodes", flush=True)
    sampled = credit.sampled(policy, tok, test_env, test_pool, args.episodes, run, procs, "test")
    mean, interval = mean_interval(sampled["scores"])
    print(f"sampled: {mean:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]", flush=True)
    first_steps = {}
    for seed in args.seeds:
        groups = first_groups(policy, tok, env, pool, run, seed, run.batch)
        first_steps[str(seed)] = sum(g.empty for g in groups)
    groups = first_groups(policy, tok, env, pool, run, args.seeds[0], args.groups)
    more = [g.empty for g in groups]
    turns = onpolicy.heldout_turns(run, policy, tok, procs, print)
    at = onpolicy.habit_at(turns)
    gates = {}
    for spec in args.gates:
        reward, flags = compare.parse_spec(spec)
        gate_run = run_args(args, reward, flags, procs)
        ctx = baselines.LabContext(policy, tok, env, alpha=gate_run.alpha, args=gate_run)
        if train.REWARDS[reward].reads_probe:
            train.read_probes(ctx, gate_run, policy, tok, procs, print)
        gates[spec] = gate_apart(turns, at, ctx, gate_run,
                                 train.forms(gate_run)[gate_run.advantage])
        if gates[spec] is not None:
            gates[spec]["probe"] = probe_apart(turns, at, ctx)
    n_first = run.batch * len(args.seeds)
    model = Path(run.model).resolve()
    if model.is_relative_to(Path.cwd()):         # the repository's own policy: as it is named
        model = model.relative_to(Path.cwd())
    return {
        "env": args.env, "model": str(model), "temperature": run.temperature, "group": run.group,
        "decisions": {"min": min(decisions), "mean": sum(decisions) / len(decisions),
                      "max": max(decisions), "episodes": len(decisions)},
        "success_greedy": greedy["success"],
        "success_sampled": {"mean": mean, "interval95": interval, "episodes": len(decisions),
                            "samples": args.samples},
        "groups_without_success_first_step": {
            "seeds": args.seeds, "groups": n_first, "without": sum(first_steps.values()),
            "by_seed": first_steps},
        "groups_without_success": {
            "seed": args.seeds[0], "groups": len(more), "without": sum(more),
            "fraction": sum(more) / len(more), "interval95": wilson(sum(more), len(more))},
        "room_in_groups": room_in_groups(groups),
        "confidence": confidence_at_first_errors(turns, at),
        "readout": readout_at_first_errors(turns, at),
        "gates": gates,
        "heldout_turns": {"episodes": run.corpus_heldout, "samples": run.corpus_samples},
        "seconds": round(time.perf_counter() - t0, 1)}


def within_text(w: dict | None) -> str:
    if w is None:
        return "n/a (no group holds both)"
    return f"{grpo.num(w['auroc'])}{credit.interval_text(w['interval95'])} ({w['pairs']} pairs " \
        f"in {w['groups']} groups)"


def report(r: dict) -> str:
    """The regime as the lines this command prints."""
    s, e, c = r["success_sampled"], r["groups_without_success"], r["confidence"]
    f = r["groups_without_success_first_step"]
    d = r["decisions"]
    lines = [
        f"{r['env']} ({r['model']}), sampled at T {r['temperature']}, G {r['group']}:",
        f"  decisions an episode      {d['min']}-{d['max']} (mean {d['mean']:.1f}, "
        f"{d['episodes']} test episodes)",
        f"  held-out success greedy   {r['success_greedy']:.3f}",
        f"  held-out success sampled  {s['mean']:.3f} [{s['interval95'][0]:.3f}, "
        f"{s['interval95'][1]:.3f}] ({s['samples']} samples of each of {s['episodes']})",
        f"  groups with no success    first step: {f['without']} of {f['groups']} (seeds "
        f"{', '.join(map(str, f['seeds']))}); first {e['groups']} prompts of seed {e['seed']}: "
        f"{e['fraction']:.2f} [{e['interval95'][0]:.2f}, {e['interval95'][1]:.2f}]",
        f"  confidence at first errors AUROC {grpo.num(c['auroc'])}"
        f"{credit.interval_text(c['auroc_interval'])} ({c['turns']} turns, {c['slips']} slips)"
        f"; within groups {within_text(c['within'])}"]
    for kind, k in c["by_kind"].items():
        lines.append(f"    {kind:<10} {grpo.num(k['auroc'])} ({k['turns']} turns, {k['slips']} "
                     "slips)")
    m = r["room_in_groups"]
    lines.append(f"  groups of G holding a right and a wrong sample of a decision: "
                 f"{grpo.num(m['both'])}{credit.interval_text(m['both_interval95'])} of the "
                 f"{m['decisions_reached']} (group, decision) pairs reached, {m['groups']} "
                 f"groups; at the first decision {grpo.num(m['first_decision_both'])}"
                 f"{credit.interval_text(m['first_decision_interval95'])}; at some decision "
                 f"{grpo.num(m['groups_with_both'])}")
    for spec, g in r["gates"].items():
        lines.append(f"  premise gate of {spec}, taken apart (AUROC: gate / reward pooled / "
                     "reward within groups / centred):")
        for kind, part in [("all", g and g["all"]), *(g["by_kind"].items() if g else [])]:
            if part is None:
                lines.append(f"    {kind:<10} n/a")
                continue
            numbers = " / ".join(grpo.num(part[k]) for k in
                                 ("gate", "reward_pooled", "reward_within", "centred"))
            lines.append(f"    {kind:<10} {numbers} ({part['turns']} turns, {part['slips']} "
                         "slips)")
        p = g and g.get("probe")
        if p:
            lines.append(f"    its probe, pooled {grpo.num(p['auroc'])}"
                         f"{credit.interval_text(p['auroc_interval'])}; within groups "
                         f"{within_text(p['within'])}")
    o = r["readout"]
    if o is None:
        lines.append("  a probe fitted at first errors: too few first-error turns to fit on")
        return "\n".join(lines)
    lines.append(f"  a probe fitted at first errors ({o['folds']} folds of episodes, "
                 f"{o['turns']} turns, {o['slips']} slips): AUROC out of fold")
    for name, a in o["auroc"].items():
        interval = credit.interval_text(o["auroc_interval"][name])
        lines.append(f"    {name:<12} {grpo.num(a)}{interval}; within groups "
                     f"{within_text(o['within'][name])}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m lab.premise", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 epilog="Flags after `--` are lab.train's, for the runs' settings "
                                 "the regime is measured with (e.g. --temperature).")
    a = ap.add_argument
    a("--env", default="shop-copy", choices=tuple(shop.WORLDS), help="the built-in world")
    a("--model", default=None, help="its policy (default: the world's own)")
    a("--episodes", type=int, default=300, help="test episodes (greedy and sampled)")
    a("--samples", type=int, default=4, help="sampled rollouts of each test episode")
    a("--seeds", type=int, nargs="+", default=[42, 43, 44],
      help="runs' seeds whose first training step's groups are counted")
    a("--groups", type=int, default=64,
      help="prompts of the first seed's run whose groups are counted")
    a("--gates", nargs="*", default=[], metavar="SPEC",
      help="rewards, each through its form, written as lab.compare's --rewards (e.g. "
           "pair:advantage=outcome-turn), whose premise gate is taken apart (gate_apart)")
    a("--threads", type=int, default=1, help="torch CPU threads")
    a("--out", required=True, help="the regime's JSON file")
    argv = sys.argv[1:] if argv is None else argv
    argv, run_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    args = ap.parse_args(argv)
    args.run_flags = run_flags
    for name in ("episodes", "samples", "groups", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    result = measure(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    grpo.write_json(Path(args.out), result)
    print(report(result), flush=True)
    print(f"wrote {args.out}", flush=True)
    return result


if __name__ == "__main__":
    main()
