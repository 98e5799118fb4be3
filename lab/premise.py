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
                   bootstrap interval over those turns, and by kind of decision.

The fourth, the ceiling (exact step labels against the outcome after the same number of steps),
is a comparison of trained runs: `python -m lab.compare` (lab/README.md).
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

import grpo
import pair
import probes
from lab import credit, onpolicy, shop, train


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


def groups_without_success(policy, tok, env, pool, args, seed: int, prompts: int) -> list[bool]:
    """For each of the first `prompts` prompts of a run of `seed`, in the order its steps play
    them (grpo.prompt_index), with the same generator (grpo.sampler): whether its group of
    args.group rollouts of the base policy holds no success."""
    out = []
    for g in range(prompts):
        index = pool[grpo.prompt_index(seed, g, len(pool))]
        episodes = [env.episode(index) for _ in range(args.group)]
        trajs = probes.rollout(policy, tok, episodes, args, generator=grpo.sampler(policy, seed, g),
                               stats=False)
        out.append(not any(t.score > 0 for t in trajs))
    return out


def confidence_at_first_errors(turns) -> dict:
    """AUROC of the turn's own mean token log-probability (-nll), right (1) against slip (0), at
    the first-error turns with a clean prefix, overall (with its bootstrap interval) and by kind of
    decision (shop.slip_kind)."""
    at = onpolicy.habit_at(turns)
    first = torch.tensor([a is not None for a in at]) & (turns.raw["distance"] < 0)
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
            "by_kind": by_kind}


def measure(args) -> dict:
    """The regime of args.env's base policy (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as tmp:      # the run's settings; nothing is written there
        flags = ["--env", args.env, "--out", tmp, "--reward", "confidence", "--threads",
                 str(args.threads), "--eval-samples", str(args.samples), *args.run_flags]
        if args.model:
            flags += ["--model", args.model]
        run = train.parse_args(flags, recorded=False)
    procs = pair.Processes()
    grpo.resolve_preset(run, procs, train.WORLDS)
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
        empty = groups_without_success(policy, tok, env, pool, run, seed, run.batch)
        first_steps[str(seed)] = sum(empty)
    more = groups_without_success(policy, tok, env, pool, run, args.seeds[0], args.groups)
    turns = onpolicy.heldout_turns(run, policy, tok, procs, print)
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
        "confidence": confidence_at_first_errors(turns),
        "heldout_turns": {"episodes": run.corpus_heldout, "samples": run.corpus_samples},
        "seconds": round(time.perf_counter() - t0, 1)}


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
        f"{credit.interval_text(c['auroc_interval'])} ({c['turns']} turns, {c['slips']} slips)"]
    for kind, k in c["by_kind"].items():
        lines.append(f"    {kind:<10} {grpo.num(k['auroc'])} ({k['turns']} turns, {k['slips']} "
                     "slips)")
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
