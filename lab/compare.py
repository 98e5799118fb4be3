"""Rewards x seeds -> the comparison a user would put in a paper, and the paper's Table complexity.

    python -m lab.compare --rewards outcome pair pair:alpha=0 --seeds 42 43 44 --out runs/cmp
    python -m lab.compare --cost --seeds 42 --out runs/cost -- --steps 3

Each run is an ordinary `python -m lab.train` run in OUT/runs/<name>-s<seed>, started as its own process
(so `--jobs 2` uses two cores) and resumed with --resume if it was interrupted; a run with a
summary.json is finished and never redone. A reward is written NAME or NAME:flag=value,...
(e.g. pair:alpha=0), and flags after `--` go to every run.

It writes compare.md (held-out success of the checkpoint selected on validation and of the final
one, mean ± sample std over seeds, a 95% Student's t interval from the seeds' and the episodes'
variances, the paired difference to the first reward; with several seeds, each seed's success at
every evaluation; on a built-in world, success on the tasks of each habit), compare.json and
curves.svg;
with --cost, cost.md: what a training step of each reward costs, beside the paper's numbers.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import envs
import grpo
import model
import pair
from lab import curves, train
from lab.methods import baselines, credit
from lab.worlds import shop, stale

COMPARE_REWARDS = ("outcome", "pair", "pair:alpha=0", "last_token", "multi_attn", "attention",
                   "head_entropy", "igpo", "tips", "tree_grpo", "at2po",
                   "pair:probe-corpus=contaminated")


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """'pair:alpha=0,probe-corpus=contaminated' -> ('pair', ['--alpha', '0', ...])."""
    reward, _, rest = spec.partition(":")
    if reward not in train.REWARDS:
        raise SystemExit(f"compare: unknown reward {reward!r} in {spec!r} (choose from "
                         f"{', '.join(train.REWARDS)})")
    flags = []
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"compare: {spec!r}: write flags as name=value, e.g. pair:alpha=0")
        flags += [f"--{key}", value]
    return reward, flags


def run_name(spec: str, seed: int) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "-" for c in spec) + f"-s{seed}"


def check_out_dir(out: Path) -> None:
    """OUT/runs and every folder above it are folders or not there yet (mkdir would raise)."""
    for p in (out / "runs", *(out / "runs").parents):
        if p.exists():
            if not p.is_dir():
                raise SystemExit(f"compare: --out {out}: {p} is a file, not a directory")
            return


def check_run(spec: str, argv: list[str], reward: str, seed: int, run: Path, resume: bool,
              done: bool) -> argparse.Namespace:
    """grpo.py's own checks of one run's command line, those that load nothing: its parser,
    flag ranges and rules between flags, the presets and, for a run still to do, what its
    directory holds against --resume. A mistake is one line naming the spec, before any run has
    started."""
    said = io.StringIO()                # argparse's usage and the preset line: not for here
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            # the command line alone (no flag taken from the run's args.json): a run made with
            # other flags must be refused, not continued as if asked for
            args = train.parse_args(argv, recorded=False)
            # compare sets these per run: given again they would put every seed in one run
            if (args.reward, args.seed, args.out, args.resume, args.resume_if_present) != \
                    (reward, seed, str(run), resume, False):
                raise SystemExit("--reward, --seed, --out and --resume are compare's to set; "
                                 "leave them out of the spec and of the flags after --")
            grpo.resolve_preset(args, pair.Processes(), train.WORLDS)
            if not done:
                grpo.check_out(args, train.RESUME_KEYS, train.RESUME_DEFAULTS)
    except SystemExit as e:
        if e.code in (0, None):         # `-- --help`: grpo.py's help is what was asked for
            print(said.getvalue(), end="")
            raise
        why = e.code if isinstance(e.code, str) else \
            (said.getvalue().strip().splitlines() or ["refused"])[-1].removeprefix(
                "grpo.py: error: ")
        raise SystemExit(f"compare: {spec!r} (run {run.name}): {why}") from None
    if done:            # tabulated as it is, so it must be the run this command asks for
        old = read_run_json(run / "args.json")
        changed = grpo.changed_flag(args, old)
        if changed:
            flag, now, then = changed
            raise damaged(run / "args.json", f"the run used {flag} {then!r}, where this command "
                          f"gives {now!r} (or choose another --out)")
        if args.no_eval and not old.get("no_eval"):     # --cost's runs: alone, no evaluations
            raise damaged(run / "args.json", "the run was trained with evaluations, perhaps "
                          "beside another run, so its step times are not --cost's (or choose "
                          "another --out)")
    return args


# What the tables read from each step of metrics.jsonl: numbers that must be there, and numbers
# that may be missing (a run from before they were logged)
TABLE_METRICS = ("reward_mean", "frac_zero_std", "kl"), (*train.TIMING, *curves.STEP_SECONDS)
COST_METRICS = ("t_rollout", "t_reward", "t_update", *grpo.COSTS, "mem_kv_mb"), \
    ("t_base_read", "mem_cuda_peak_mb")


def damaged(path: Path, what: str) -> SystemExit:
    """The one line for a finished run's file that cannot be tabulated; a run with a
    summary.json is never redone, so say how to have it redone."""
    return SystemExit(f"compare: {path}: {what}; delete {path.parent} and run the same command "
                      "again to redo that run")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def read_run_json(path: Path) -> dict:
    """A finished run's JSON object; anything else is `damaged`, the run to be redone."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise damaged(path, "missing") from None
    except (OSError, ValueError, RecursionError) as e:
        raise damaged(path, f"not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise damaged(path, "not a JSON object")
    return data


def read_log(path: Path) -> list[dict]:
    try:
        return grpo.read_jsonl(path)
    except SystemExit as e:             # common's line names the damaged line
        raise SystemExit(f"compare: {e.code}; delete {path.parent} and run the same command "
                         "again to redo that run") from None
    except (OSError, ValueError) as e:  # a folder there, or bytes that are not UTF-8
        raise damaged(path, f"not readable ({type(e).__name__}: {e})") from None


def read_metrics(run: Path, keys: tuple[tuple[str, ...], tuple[str, ...]]) -> list[dict]:
    path = run / "metrics.jsonl"
    ms = read_log(path)
    if not ms:
        raise damaged(path, "missing or empty: no training step logged")
    need, may = keys
    for m in ms:
        bad = [k for k in need if not _is_number(m.get(k))] + \
            [k for k in may if k in m and not _is_number(m[k])]
        if m.get("probe_auroc") is not None and not _is_number(m["probe_auroc"]):
            bad.append("probe_auroc")
        if bad:
            raise damaged(path, f"step {m['step']}: {', '.join(bad)} not a number")
    return ms


def read_run(run: Path) -> tuple[dict, list[dict], dict]:
    """A finished run's summary.json, metrics.jsonl and eval.jsonl (by step), with what the
    table reads from each checked."""
    path = run / "summary.json"
    s = read_run_json(path)
    if not _is_number(s.get("seconds")):
        raise damaged(path, 'no number "seconds"')
    heldout = s.get("probe_auroc_heldout", {})
    if not isinstance(heldout, dict) or not (heldout.get("pair") is None
                                             or _is_number(heldout["pair"])):
        raise damaged(path, '"probe_auroc_heldout" is not an object with a number "pair"')
    evals = {}
    for e in read_log(run / "eval.jsonl"):
        test = e.get("test")
        if not (isinstance(test, dict) and _is_number(test.get("success"))
                and isinstance(test.get("scores"), list) and test["scores"]
                and all(map(_is_number, test["scores"]))):
            raise damaged(run / "eval.jsonl", f"step {e['step']}: \"test\" is not an object with "
                          "a number \"success\" and a list of numbers \"scores\"")
        evals[e["step"]] = e
    for key in ("base", "selected", "final", "best_on_test"):
        c = s.get(key)
        if c is None:
            raise damaged(path, f'"{key}" is null: the run has no held-out evaluation (was it '
                          "run with --no-eval, or by compare --cost?)")
        if not (isinstance(c, dict) and type(c.get("step")) is int
                and _is_number(c.get("success"))):
            raise damaged(path, f'"{key}" is not an object with an integer "step" and a number '
                          '"success"')
        if key != "best_on_test" and c["step"] not in evals:
            raise damaged(run / "eval.jsonl", f"no evaluation of step {c['step']}, summary.json's "
                          f'"{key}"')
    return s, read_metrics(run, TABLE_METRICS), evals


def compare(argv: list[str]) -> dict:
    command = " ".join(["python -m lab.compare", *argv])
    ap = argparse.ArgumentParser(
        prog="python -m lab.compare", formatter_class=grpo.HelpFormatter,
        description="Train every reward with every seed (resumable) and write compare.md, "
                    "compare.json and curves.svg. Flags after `--` go to every run.")
    ap.add_argument("--rewards", nargs="+", default=list(COMPARE_REWARDS),
                    help="rewards, each NAME or NAME:flag=value,...")
    ap.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44],
                    help="seeds, each a run per reward")
    ap.add_argument("--out", required=True, help="directory of the runs and the tables")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--ceiling", default=None, metavar="SPEC",
                    help="one of --rewards (exact labels): each row's share of its gain over "
                         "the first reward, (R - first) / (SPEC - first)")
    ap.add_argument("--cost", action="store_true",
                    help="the paper's Table complexity, measured: train every reward (default: "
                         "all but llm_judge without an endpoint) for the few steps given after "
                         "`--` without evaluations, one run at a time, and write cost.md")
    argv, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    args = ap.parse_args(argv)
    if args.jobs < 1:                   # 0 would start nothing and wait for it forever
        raise SystemExit(f"compare: --jobs must be at least 1, got {args.jobs}")
    if args.ceiling is not None and args.ceiling not in args.rewards[1:]:
        raise SystemExit(f"compare: --ceiling {args.ceiling}: not one of --rewards after the "
                         "first (the first is what the ceiling's gain is measured from)")
    # one run directory each: a repeat would be trained twice at once and tabulated twice
    for flag, values, name in (("--seeds", args.seeds, str),
                               ("--rewards", args.rewards, lambda spec: run_name(spec, 0))):
        names = [name(v) for v in values]
        twice = [v for k, v in enumerate(values) if names[k] in names[:k]]
        if twice:
            raise SystemExit(f"compare: {flag}: {', '.join(map(str, twice))} given twice")
    if args.cost:
        if "--rewards" not in argv:
            args.rewards = [r for r in train.REWARDS if r != "llm_judge"
                            or os.environ.get("OPENAI_API_KEY")]
        # latencies measured beside another run are not latencies
        args.jobs, extra = 1, [*extra, "--no-eval"]
    out = Path(args.out)
    check_out_dir(out)
    todo = []
    # Seed by seed: every reward has its first seed before any has its second, so a comparison
    # cut short still has a row for each (`--seeds 42` then tabulates what is done).
    # Every run's command line is checked here, before any run starts or anything is written.
    for seed in args.seeds:
        for spec in args.rewards:
            reward, flags = parse_spec(spec)
            run = out / "runs" / run_name(spec, seed)
            done = (run / "summary.json").is_file()
            resume = (run / "args.json").is_file()
            run_argv = ["--reward", reward, *flags, "--seed", str(seed), "--out", str(run),
                        "--threads", str(args.threads), *extra] + (["--resume"] if resume else [])
            run_args = check_run(spec, run_argv, reward, seed, run, resume, done)
            if run_args.no_eval and not args.cost:
                raise SystemExit("compare: --no-eval: the table is held-out success, read from "
                                 "the runs' evaluations; leave it out (--cost times the rewards "
                                 "without them)")
            if not done:
                todo.append((run, [sys.executable, "-m", "lab.train", *run_argv]))
    try:
        (out / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"compare: --out {out}: cannot make {out / 'runs'} ({e.strerror})") \
            from None
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
        grpo.write_json(out / "cost.json", result)
        model.write_atomic(out / "cost.md", cost_markdown(result, command))
        print((out / "cost.md").read_text() + f"\nwrote {out / 'cost.md'}, {out / 'cost.json'}",
              flush=True)
        return result
    result = compare_table(out, args.rewards, args.seeds, args.ceiling)
    grpo.write_json(out / "compare.json", result)
    model.write_atomic(out / "compare.md", compare_markdown(result, command))
    model.write_atomic(out / "curves.svg", curves.curves_svg(result))
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
    if reward in baselines.TREE_SEARCH:
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
        ms = [m for seed in seeds
              for m in read_metrics(out / "runs" / run_name(spec, seed), COST_METRICS)]
        row = {"reward": spec, "steps": len(ms)}
        for key in (*train.TIMING, *grpo.COSTS, "mem_kv_mb", "mem_cuda_peak_mb"):
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


def interval95(rows: list[list[float]], base: list[list[float]] | None = None
               ) -> tuple[float, float]:
    """95% interval of the mean success over seeds x episodes (minus `base`'s, seed by seed and
    episode by episode, when given: a paired difference). Seeds are the unit of replication:
    each seed's mean over the episodes is one observation, and the interval is Student's t over
    those S means with S - 1 degrees of freedom, mean +- t(0.975, S - 1) sd / sqrt(S). A seed's
    mean already holds its evaluation pool's noise, so nothing is added for the episodes; adding
    their variance as a second term with Welch's degrees of freedom gave intervals narrower than
    this one in most simulated draws and covered less than 95%
    (tests/test_grpo.py::test_interval95_covers_over_seeds). One seed: the episodes' spread with
    E - 1 degrees of freedom, which holds the evaluation's noise only, not training's. Clipped to
    what a score in [0, 1] allows (a difference: [-1, 1])."""
    x = np.asarray(rows, dtype=np.float64)                             # (seeds, episodes)
    if base is not None:
        x = x - np.asarray(base, dtype=np.float64)
    mean, half = half_width(x)
    low = 0.0 if base is None else -1.0
    return max(low, mean - half), min(1.0, mean + half)


def half_width(x: np.ndarray) -> tuple[float, float]:
    """interval95's mean and half-width, unclipped, of a (seeds, episodes) array."""
    S, E = x.shape
    # one observation a seed; a single seed falls back on its episodes
    units = x.mean(1) if S > 1 else x[0]
    n = len(units)
    if n < 2:
        return float(x.mean()), 0.0
    sd = units.std(ddof=1)
    if sd == 0:
        return float(x.mean()), 0.0
    return float(x.mean()), student_t_quantile(0.975, n - 1) * sd / math.sqrt(n)


SHARE_LIMIT = 10.0      # a share interval reaching past ±10 ceilings is reported unbounded


def share_of_ceiling(rows, ceiling, base) -> dict:
    """The share of the ceiling's gain a reward recovers, (R - O) / (L - O), with R, L and O the
    (seeds, episodes) test scores of the reward, of the ceiling (exact labels) and of the first
    reward (the outcome), paired seed by seed and episode by episode; and its 95% interval,
    Fieller's over the seeds as interval95: the shares theta for which interval95 of
    R - O - theta (L - O) holds zero. None for an end past SHARE_LIMIT (the ceiling's own gain
    is not told from zero there: the share can be anything)."""
    r = np.asarray(rows, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    gain = np.asarray(ceiling, dtype=np.float64) - np.asarray(base, dtype=np.float64)
    if gain.mean() == 0:
        return {"share": None, "ci95": [None, None]}
    share = float(r.mean() / gain.mean())

    def outside(theta):         # interval95 of R - O - theta (L - O) misses zero
        mean, half = half_width(r - theta * gain)
        return abs(mean) > half

    ends = []
    for limit in (-SHARE_LIMIT, SHARE_LIMIT):
        if not outside(limit):
            ends.append(None)
            continue
        inside, out = share, limit          # bisection between the estimate and the limit
        for _ in range(50):
            mid = (inside + out) / 2
            inside, out = (inside, mid) if outside(mid) else (mid, out)
        ends.append(float((inside + out) / 2))
    return {"share": share, "ci95": ends}


@functools.lru_cache(maxsize=None)
def student_t_quantile(p: float, df: float) -> float:
    """The p-quantile (p > 1/2) of Student's t with df > 0 degrees of freedom (any real df):
    bisection on its CDF, the density integrated by Simpson's rule (to 1e-9)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(q):                                         # 1/2 + the integral of the density
        t = np.linspace(0.0, q, 2001)
        f = np.exp(log_c - (df + 1) / 2 * np.log1p(t * t / df))
        return 0.5 + q / 6000 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def compare_table(out: Path, specs: list[str], seeds: list[int],
                  ceiling: str | None = None) -> dict:
    rows, scores = [], {}
    first = out / "runs" / run_name(specs[0], seeds[0])
    habits = habit_tasks(first)
    # test episodes scored -> a file that says so: one number for all, or nothing is paired
    sizes = {1 + max(i for tasks in habits.values() for i in tasks): first / "args.json"} \
        if habits else {}
    for spec in specs:
        played = []
        for seed in seeds:
            run = out / "runs" / run_name(spec, seed)
            played.append(read_run(run))
        row = {"reward": spec, "seeds": seeds, "runs": [str(out / "runs" / run_name(spec, s))
                                                        for s in seeds]}
        for key in ("base", "selected", "final", "best_on_test"):
            vals = [s[key]["success"] for s, _, _ in played]
            # the sample std (n - 1): the seeds are a sample of the training noise
            row[key] = {"mean": float(np.mean(vals)),
                        "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
                        "per_seed": vals}
        # each seed's per-episode test scores at its base, selected and final checkpoints
        test_scores = {key: [ev[s[key]["step"]]["test"]["scores"] for s, _, ev in played]
                       for key in ("base", "selected", "final")}
        for per_seed in test_scores.values():
            for seed, x in zip(seeds, per_seed):
                sizes.setdefault(len(x), out / "runs" / run_name(spec, seed) / "eval.jsonl")
        if len(sizes) > 1:
            (n1, w1), (n2, w2) = list(sizes.items())[:2]
            raise SystemExit(f"compare: the runs were evaluated on different test episodes ({w1}: "
                             f"{n1}, {w2}: {n2}; --eval-episodes changed between commands?); "
                             "delete the runs that differ and run the same command again to "
                             "redo them")
        for key in ("selected", "final"):
            scores[spec, key] = test_scores[key]
            row[key]["ci95"] = interval95(test_scores[key])
        early = [m.get("probe_auroc") for _, ms, _ in played for m in ms[:5]]
        late = [m.get("probe_auroc") for _, ms, _ in played for m in ms[-5:]]
        row["probe_auroc"] = {"first5": _mean([x for x in early if x is not None]),
                              "last5": _mean([x for x in late if x is not None])}
        row["heldout_auroc"] = _mean([s.get("probe_auroc_heldout", {}).get("pair")
                                      for s, _, _ in played])
        # the premise gate is scored on the base policy's held-out turns, the same for every
        # seed: the first seed's
        row["premise_gate"] = next((s["premise_gate"] for s, _, _ in played
                                    if s.get("premise_gate")), None)
        all_m = [m for _, ms, _ in played for m in ms]
        row["frac_zero_std"] = _mean([m["frac_zero_std"] for m in all_m])
        row["kl_final"] = _mean([ms[-1]["kl"] for _, ms, _ in played])
        for key in train.TIMING:
            row[key] = _mean([m.get(key, 0.0) for m in all_m])
        row["minutes"] = _mean([s["seconds"] / 60 for s, _, _ in played])
        # the learning curves: test success at every evaluation, mean reward at every step
        steps = sorted(set.intersection(*(set(ev) for _, _, ev in played)))
        row["curve_success"] = [(k, _mean([ev[k]["test"]["success"] for _, _, ev in played]))
                                for k in steps]
        # and each seed's own, after the base: where seeds disagree, the mean hides how
        row["curve_by_seed"] = {"steps": [k for k in steps if k > 0], "success": [
            [ev[k]["test"]["success"] for k in steps if k > 0] for _, _, ev in played]}
        clocks = [curves.training_seconds(ms) for _, ms, _ in played]
        row["curve_seconds"] = [(_mean([c.get(k) for c in clocks]), y)
                                for k, y in row["curve_success"]]
        n_steps = min(len(ms) for _, ms, _ in played)
        row["curve_reward"] = [(k + 1, _mean([ms[k]["reward_mean"] for _, ms, _ in played]))
                               for k in range(n_steps)]
        if habits is not None:          # mean over seeds of each seed's success on the tasks
            row["by_habit"] = {key: {h: _mean([_mean([seed[i] for i in tasks])
                                               for seed in per_seed])
                                     for h, tasks in habits.items()}
                               for key, per_seed in test_scores.items()}
        rows.append(row)
    ref = specs[0]
    # how soon each reward reaches what the first one ends with: the first evaluation whose
    # mean held-out success (over seeds) is at least the first reward's final mean
    target = rows[0]["final"]["mean"]
    for row in rows:
        reached = [(k, x) for (k, y), (x, _) in zip(row["curve_success"], row["curve_seconds"])
                   if k > 0 and y is not None and y >= target]
        row["to_target"] = {"success": target, "step": reached[0][0] if reached else None,
                            "seconds": reached[0][1] if reached else None}
    for row in rows:          # paired against the first reward (outcome by default): same seeds
        for key in ("selected", "final"):
            d = np.mean(scores[row["reward"], key]) - np.mean(scores[ref, key])
            row[key]["delta_vs_first"] = float(d)
            row[key]["delta_ci95"] = interval95(scores[row["reward"], key], scores[ref, key])
            if ceiling is not None:
                row[key]["share_of_ceiling"] = share_of_ceiling(
                    scores[row["reward"], key], scores[ceiling, key], scores[ref, key])
    return {"rows": rows, "reference": ref, "habits": habits, "decoding": decoding(first),
            "ceiling": ceiling,
            "selection": "checkpoint with the best validation success, reported on test"}


def decoding(run: Path) -> str:
    """How the runs' evaluations decode: greedily, or sampled (lab.train --eval-samples)."""
    args = read_run_json(run / "args.json")
    if not args.get("eval_samples"):
        return "greedy"
    return f"sampled: {args['eval_samples']} rollouts of each episode at T {args['temperature']}"


def habit_tasks(run: Path) -> dict[str, list[int]] | None:
    """On a built-in world, the test tasks (indices in evaluation order) that have each habit of
    its policy (shop.slip_turns), and those with none: which errors a reward taught away, where
    the success rate alone cannot say. None on other environments."""
    args = read_run_json(run / "args.json")
    n = args.get("eval_episodes")
    if not isinstance(args.get("env"), str) or not (n is None or type(n) is int and n >= 0):
        raise damaged(run / "args.json", 'no string "env" or no count "eval_episodes"')
    if args["env"] not in shop.WORLDS or args["env"] in (shop.COPY_WORLD.name,
                                                         stale.STALE_WORLD.name):
        return None             # shop-copy, shop-stale: every task has every kind of decision
    test = envs.ShopEnv("test", world=shop.WORLDS[args["env"]])
    n = min(n or len(test), len(test))
    groups = {h: [] for h in ("none", *shop.LONG_SLIPS)}
    for i in range(n):
        for habit in shop.slip_turns(test.episode(i).task) or ("none",):
            groups[habit].append(i)
    return {h: tasks for h, tasks in groups.items() if tasks}


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

    def reach(r):
        t = r.get("to_target") or {}
        if t.get("step") is None:
            return "—"          # seconds: None when metrics.jsonl has no record of that step
        return f"{t['step']} / " + ("—" if t["seconds"] is None else f"{t['seconds']:.0f} s")

    ref = result["reference"]
    lines = [
        f"Held-out success in % ({result.get('decoding', 'greedy')}, test split), mean ± "
        f"sample std over seeds "
        f"{result['rows'][0]['seeds']} [95% interval: Student's t over the seeds' means, n − 1 "
        f"degrees of freedom, paired seed by seed for Δ (compare.interval95)]. *selected*: the checkpoint "
        f"with the best "
        f"validation success, reported on test; *best on test*: the paper's protocol (chosen on "
        f"test itself). Δ: paired against `{ref}` (same seeds, same episodes).", "",
        f"`{command}`", "",
        f"*reaches*: the first evaluation (step, and seconds of training: rollouts, reward, "
        f"update, probe refits) whose mean test success is at least `{ref}`'s final "
        f"({pct(result['rows'][0]['final']['mean'])}); — when none is.", "",
        "| reward | base | selected | Δ selected | final | Δ final | best on test | reaches "
        "| PAIR AUROC held-out own turns | probe AUROC first → last 5 steps | zero-std "
        "| KL final | s/step rollout / reward / update | min/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        pa = r["probe_auroc"]
        lines.append(
            f"| {r['reward']} | {pct(r['base']['mean'])} | {cell(r, 'selected')} | "
            f"{delta(r, 'selected') if r['reward'] != ref else '—'} | {cell(r, 'final')} | "
            f"{delta(r, 'final') if r['reward'] != ref else '—'} | "
            f"{pct(r['best_on_test']['mean'])} | {reach(r)} | {grpo.num(r['heldout_auroc'])} | "
            + (f"{grpo.num(pa['first5'])} → {grpo.num(pa['last5'])}"
               if pa["first5"] is not None else "—")
            + f" | {r['frac_zero_std']:.2f} | {r['kl_final']:.3f} | {r['t_rollout']:.1f} / "
            f"{r['t_reward']:.2f} / {r['t_update']:.1f} | {r['minutes']:.1f} |")
    rows = result["rows"]
    lines += credit_lines(result, pct)
    if len(rows[0]["seeds"]) > 1:
        steps = rows[0]["curve_by_seed"]["steps"]
        same = all(r["curve_by_seed"]["steps"] == steps for r in rows)
        lines += ["", "Held-out success in % by seed, " + (
            f"at steps {', '.join(map(str, steps))}." if same else "step: success."),
            "", "| reward | " + " | ".join(f"seed {s}" for s in rows[0]["seeds"]) + " |",
            "|---|" + "---|" * len(rows[0]["seeds"])]
        for r in rows:
            by_seed = r["curve_by_seed"]
            lines.append(f"| {r['reward']} | " + " | ".join(
                ", ".join(pct(y) if same else f"{k}: {pct(y)}"
                          for k, y in zip(by_seed["steps"], curve))
                for curve in by_seed["success"]) + " |")
    habits = result.get("habits")
    if habits:
        lines += ["", "Held-out success in % on the test tasks that have each habit of the "
                  "built-in policy (a task with two counts under both; *none*: tasks without "
                  "one), mean over seeds: base → selected → final.", "",
                  "| reward | " + " | ".join(f"{h} ({len(t)} tasks)" for h, t in habits.items())
                  + " |", "|---|" + "---|" * len(habits)]
        for r in result["rows"]:
            b = r["by_habit"]
            lines.append(f"| {r['reward']} | " + " | ".join(
                " → ".join(pct(b[key][h]) for key in ("base", "selected", "final"))
                for h in habits) + " |")
    return "\n".join(lines) + "\n"


def credit_lines(result: dict, pct) -> list[str]:
    """The table of what each reward recovers of the ceiling's gain (with --ceiling) and of its
    premise gate (every run on a built-in world records one): none when neither is there."""
    rows, ceiling = result["rows"], result.get("ceiling")
    if ceiling is None and not any(r.get("premise_gate") for r in rows):
        return []

    def share(r):
        x = r["final"].get("share_of_ceiling")
        if r["reward"] in (result["reference"], ceiling) or x is None or x["share"] is None:
            return "—"
        lo, hi = ("unbounded" if v is None else f"{100 * v:+.0f}" for v in x["ci95"])
        return f"{100 * x['share']:+.0f}% [{lo}, {hi}]"

    def gate(r):
        g = r.get("premise_gate")
        if not g or g.get("auroc") is None:
            return "—", "—"
        return f"{g['auroc']:.3f}{credit.interval_text(g.get('auroc_interval'))}", \
            grpo.num(g.get("reward_auroc"))

    ref = result["reference"]
    lines = ["", (f"*share of the ceiling*: (R − `{ref}`) / (`{ceiling}` − `{ref}`) at the "
                  "final checkpoint, paired, with Fieller's 95% interval over the seeds' "
                  "means as Δ's (compare.share_of_ceiling). " if ceiling else "")
             + "*premise gate*: the advantage's AUROC, right against slip, at the first-error "
             "turns with a clean prefix of held-out base-policy rollouts, with a bootstrap "
             "interval over those turns, beside the reward's own (lab/methods/credit.py; the same "
             "turns for every seed). Under `outcome-turn` the advantage carries the outcome's "
             "term: where any slip fails the episode a high gate is nearly built in.", "",
             "| reward | final | Δ final | share of the ceiling | premise gate "
             "| the reward alone |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        delta = "—" if r["reward"] == result["reference"] else \
            f"{100 * r['final']['delta_vs_first']:+.1f}"
        g, alone = gate(r)
        lines.append(f"| {r['reward']} | {pct(r['final']['mean'])} | {delta} | {share(r)} | "
                     f"{g} | {alone} |")
    return lines


def main(argv=None):
    return compare(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
