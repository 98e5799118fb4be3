"""python -m lab.curves RUN [RUN ...]: a run's learning curves, RUN/curves.svg.

Held-out test success against the step and against the seconds of training, and the mean turn
reward against the step, read from the run's eval.jsonl and metrics.jsonl. lab/compare.py draws
every run of a comparison the same way, one line per reward.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import grpo
import model


def nice_ticks(lo: float, hi: float, most: int = 6, integer: bool = False) -> list[float]:
    """Evenly spaced round values (1, 2 or 5 times a power of ten) covering [lo, hi], at most
    `most` of them, never a value twice (integer: whole numbers only, for steps)."""
    span = max(hi - lo, 1e-12)
    for base in (10 ** k for k in range(math.floor(math.log10(span / most)) - 1, 12)):
        for m in (1, 2, 5):
            step = m * base
            if integer and step < 1:
                continue
            first = math.ceil(lo / step - 1e-9) * step
            ticks = [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]
            if 2 <= len(ticks) <= most or (len(ticks) <= most and integer):
                return ticks
    return [lo, hi]


CURVES = (("curve_success", "held-out success (test, greedy)", "step"),
          ("curve_seconds", "held-out success against training time", "seconds of training"),
          ("curve_reward", "mean turn reward (training rollouts)", "step"))


def curves_svg(result: dict) -> str:
    """One panel per curve the rows hold (CURVES: held-out test success against the step and
    against the seconds of training, mean reward against the step), one line per reward; the
    legend below them, as many entries a row as its longest label leaves room for."""
    W, H, pad = 460, 300, 52
    # tab10, then ten darker ones drawn dashed: twenty rows, each a color of its own
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
              "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#843c39", "#637939", "#7b4173",
              "#8c6d31", "#000000", "#3182bd", "#31a354", "#e6550d", "#756bb1"]

    def stroke(c):      # past the ten first colors, dashed (longer each round of ten)
        dash = f' stroke-dasharray="{6 * (c // 10)},3"' if c >= 10 else ""
        return f'stroke="{colors[c % len(colors)]}"{dash}'
    rows = result["rows"]
    panels = [c for c in CURVES if all(c[0] in r for r in rows)]
    width = len(panels) * W
    # 12px sans-serif: about 7px a character at most; a label is never cut
    entry = 26 + 7 * max((len(r["reward"]) for r in rows), default=0) + 20
    per_row = max(1, min(4, (width - 16) // entry))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{H + 22 * (-(-len(rows) // per_row)) + 16}" font-family="sans-serif"'
             ' font-size="12"><rect width="100%" height="100%" fill="white"/>']
    for p, (key, title, xlabel) in enumerate(panels):
        series = [r[key] for r in rows]
        xs = [x for s in series for x, _ in s] or [0, 1]
        ys = [y for s in series for _, y in s if y is not None] or [0, 1]
        x0, x1 = min(xs), max(max(xs), min(xs) + 1)
        yt = nice_ticks(min(ys), max(max(ys), min(ys) + 1e-3))
        step = yt[1] - yt[0]            # one more tick below the lowest point, and above
        yt = [yt[0] - step] * (yt[0] > min(ys) + 1e-12) + yt + \
            [yt[-1] + step] * (yt[-1] < max(ys) - 1e-12)
        y0, y1 = yt[0], yt[-1]
        ox = p * W

        def X(x):
            return ox + pad + (x - x0) / (x1 - x0) * (W - 1.5 * pad)

        def Y(y):
            return H - pad + (y - y0) / (y1 - y0) * -(H - 1.6 * pad)
        parts.append(f'<text x="{ox + W / 2}" y="18" text-anchor="middle">{title}</text>')
        parts.append(f'<line x1="{X(x0)}" y1="{Y(y0)}" x2="{X(x1)}" y2="{Y(y0)}" '
                     'stroke="black"/>'
                     f'<line x1="{X(x0)}" y1="{Y(y0)}" x2="{X(x0)}" y2="{Y(y1)}" stroke="black"/>')
        for yv in yt:
            parts.append(f'<text x="{X(x0) - 4}" y="{Y(yv) + 4}" text-anchor="end">'
                         f'{round(yv, 12):g}</text>')
        for xv in nice_ticks(x0, x1, integer=True):
            parts.append(f'<text x="{X(xv)}" y="{Y(y0) + 16}" text-anchor="middle">{xv:g}</text>')
        parts.append(f'<text x="{ox + W / 2}" y="{H - 8}" text-anchor="middle">{xlabel}</text>')
        for c, s in enumerate(series):
            pts = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in s if y is not None)
            parts.append(f'<polyline points="{pts}" fill="none" {stroke(c)} '
                         'stroke-width="1.6"/>')
    for c, r in enumerate(rows):
        x, y = 16 + (c % per_row) * max(entry, (width - 16) // per_row), H + 22 * (c // per_row) + 8
        parts.append(f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" {stroke(c)}'
                     f' stroke-width="3"/><text x="{x + 26}" y="{y + 4}">{r["reward"]}</text>')
    return "\n".join(parts) + "\n</svg>\n"


def run_curves(out: Path, reward: str) -> str:
    """curves.svg of one run: its held-out test success at every evaluation and its mean
    reward at every step (compare.py draws every run of a comparison the same way)."""
    evals = grpo.read_jsonl(out / "eval.jsonl")
    steps = grpo.read_jsonl(out / "metrics.jsonl")
    clock = training_seconds(steps)
    return curves_svg({"rows": [{
        "reward": reward,
        "curve_success": [(e["step"], e["test"]["success"]) for e in evals],
        "curve_seconds": [(clock[e["step"]], e["test"]["success"]) for e in evals
                          if e["step"] in clock],
        "curve_reward": [(m["step"], m["reward_mean"]) for m in steps]}]})


STEP_SECONDS = ("t_rollout", "t_reward", "t_update", "t_refit")


def training_seconds(metrics: list[dict]) -> dict[int, float]:
    """step -> seconds of training up to the end of that step (rollouts, reward, update and any
    probe refit; evaluations and checkpoints not counted), from metrics.jsonl; 0 -> 0."""
    out, total = {0: 0.0}, 0.0
    for m in metrics:
        total += sum(m.get(k, 0.0) for k in STEP_SECONDS)
        out[m["step"]] = total
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m lab.curves", description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories (grpo.py --out)")
    for run in map(Path, ap.parse_args(argv).runs):
        if not (run / "metrics.jsonl").is_file():
            raise SystemExit(f"{run}: no metrics.jsonl (not a grpo.py run directory)")
        try:
            reward = json.loads((run / "args.json").read_text())["reward"]
        except (OSError, ValueError, KeyError, TypeError):
            reward = run.name           # the legend's label only
        model.write_atomic(run / "curves.svg", run_curves(run, reward))
        print(run / "curves.svg")


if __name__ == "__main__":
    main()
