"""python -m lab.train: the lab's training loop, grpo.py's flags and more.

    python -m lab.train --reward igpo                    # the paper's other rewards
    python -m lab.train --reward tree_grpo               # the tree searches (at2po too)
    python -m lab.train --env shop-long --reward labels --advantage outcome-turn
    python -m lab.train --probe-reads base --probe-retrain-every 5
    torchrun --nproc_per_node 2 -m lab.train ...

This is grpo.train's loop, written out again with what only the lab's methods need, each where
it runs, built from grpo.py's functions (setup's pieces: check_before_loading, load_policy,
environments, adapter_optimizer, log_start; a step's: start_step, play_rollouts, score_group,
update_policy, step_metrics; the loop's: set_lr, record_step, checkpoint_due, save_and_log,
evaluate_and_log, finish):
  * its tables are the core's with the lab's rows: the rewards of lab/methods/baselines.py (CoE, the
    LLM judge, IGPO, TIPS, the tree searches) and lab/methods/credit.py (the exact labels), the
    advantage forms of lab/methods/credit.py, the worlds of lab/worlds/shop.py, ToolBench's
    replay (lab/worlds/toolbench.py);
  * setup: several processes under torchrun (lab/infra/torchrun.py), the probes of a
    `lab.study train` directory (lab/probing/features.py) or fitted on the fly for these
    settings (lab/methods/onpolicy.py), the run lock that nests and waits (lab/infra/runs.py), the judge's client, the premise gate;
  * a step: TIPS' lagged teacher refreshed, DAPO's oversampling (--oversample), the tree
    searches' plays, the statistics read from the frozen base (--probe-reads base), AT²PO's
    turn-level loss, the refits of the probe (--probe-retrain-every);
  * around the steps: the base model's evaluation kept for later runs, the lagged teacher kept
    in the checkpoints, the premise gate in summary.json.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file

import grpo
import pair
from lab.infra import runs, torchrun
from lab.methods import baselines, credit, onpolicy
from lab.probing import features
from lab.worlds import shop, toolbench

PROG = "python -m lab.train"

# The core's tables with the lab's rows
REWARDS = {**pair.REWARDS, **baselines.REWARDS, **credit.REWARDS}
FORM_NAMES = (*pair.ADVANTAGES, *credit.FORM_NAMES)
WORLDS = shop.WORLDS                    # shop and shop-long
REPLAYS = toolbench.REPLAYS             # gta and toolbench
TIMING = (*grpo.TIMING, "t_base_read")  # the extra forward of --probe-reads base
# the flags a resumed run must keep, their ranges, and the value of a flag an older run lacks
RESUME_KEYS = (*grpo.RESUME_KEYS, *baselines.RESUME_KEYS, *credit.RESUME_KEYS,
               *onpolicy.RESUME_KEYS)
RESUME_DEFAULTS = {**grpo.RESUME_DEFAULTS, **credit.RESUME_DEFAULTS, **onpolicy.RESUME_DEFAULTS}
RANGES = {**grpo.FLAG_RANGES, **baselines.RANGES, **credit.RANGES, **onpolicy.RANGES}


def forms(args) -> dict[str, pair.Objective]:
    """The advantage forms, the core's and lab/methods/credit.py's (outcome-turn with --turn-weight)."""
    return {**pair.ADVANTAGES, **credit.forms(args.turn_weight)}


def parser():
    """grpo.py's flags over the lab's tables, then the lab's own flags."""
    ap = grpo.train_parser(REWARDS, FORM_NAMES, WORLDS, REPLAYS, prog=PROG)
    baselines.add_flags(ap)
    credit.add_flags(ap)
    onpolicy.add_flags(ap)
    return ap


def parse_args(argv, recorded: bool = True) -> object:
    """The lab's command line, checked: every flag's range, then the rules between them
    (`recorded`: as grpo.parse_args's)."""
    args = grpo.parse_args(argv, parser(), RANGES, WORLDS, RESUME_KEYS, recorded)
    credit.check(args, WORLDS)
    onpolicy.check(args, REWARDS[args.reward])
    return args


# --- setup ------------------------------------------------------------------------------------

@dataclass
class LabTraining(grpo.Training):
    summary: dict = field(default_factory=dict)     # what the lab adds to summary.json


def setup(args) -> LabTraining:
    """grpo.setup's steps over the lab's tables, with the lab's processes, probes and lock."""
    procs = torchrun.start(args) if int(os.environ.get("WORLD_SIZE", "1")) > 1 \
        else pair.Processes()
    given = grpo.resolve_preset(args, procs, WORLDS)
    baselines.preset(args, given)       # the trees' budget
    grpo.check_before_loading(args, procs, RESUME_KEYS, RESUME_DEFAULTS)
    log = procs.log
    policy, tok = grpo.load_policy(args, procs, WORLDS)
    env, pool, held = grpo.environments(args, tok, WORLDS, REPLAYS)
    reward = REWARDS[args.reward]
    ctx = baselines.LabContext(policy, tok, env, alpha=args.alpha, args=args)
    # Probes fitted on the fly take minutes: they (and the shipped ones of a built-in world) are
    # read once OUT is claimed. Given ones are checked before.
    later = reward.reads_probe and args.env in WORLDS and not args.probes
    report = None
    if reward.reads_probe and not later:
        report = read_probes(ctx, args, policy, tok, procs, log)
    out = prepare_out(args, procs)
    if later:
        report = read_probes(ctx, args, policy, tok, procs, log)
    if args.reward == baselines.AT2PO:
        objective = baselines.at2po_form(args)
    else:
        objective = forms(args)[args.advantage]
    baselines.start(args, ctx, log)
    summary = {}
    if args.env in WORLDS:
        gate = credit.gate_at_setup(args, policy, tok, procs, log, ctx, objective)
        if gate is not None:
            summary["premise_gate"] = gate
    run = LabTraining(policy, tok, env, pool, held, reward, objective, ctx,
                      grpo.adapter_optimizer(policy, args), args, procs, out, log, report,
                      summary)
    grpo.log_start(run)
    return run


def read_probes(ctx, args, policy, tok, procs, log) -> dict | None:
    """The probe the reward reads, into ctx: from --probes (a `lab.study train` directory, or
    what grpo.py reads), fitted on the fly for a built-in world's policy and these settings, or
    shipped beside the built-in policy. Returns the probes' report when there is one."""
    where, report = None, None
    if args.probes:
        where = features.study_probes(args, log)
    elif args.env in WORLDS:
        fitted = onpolicy.fit_on_the_fly(args, policy, tok, procs, log)
        if fitted is not None:
            where, report = fitted
    if where is None:
        where, report = grpo.probes_to_read(args, log, WORLDS)
    grpo.read_probes(ctx, args, policy, where)
    return report


def prepare_out(args, procs) -> Path:
    """grpo.prepare_out with the lab's lock, which nests (a lab command may hold OUT already)
    and waits where the core's refuses."""
    out = Path(args.out)
    if procs.main:
        out.mkdir(parents=True, exist_ok=True)
        runs.claim_out(out)
        grpo.check_out(args, RESUME_KEYS, RESUME_DEFAULTS)
        grpo.write_json(out / "args.json", vars(args))
    procs.barrier()
    return out


# --- a step -------------------------------------------------------------------------------------

def play_group(g: int, run: LabTraining, t: dict) -> grpo.Group:
    """grpo.play_group, or a tree search's play; under --probe-reads base the statistics the
    reward reads come from the frozen base (t_base_read, part of t_reward)."""
    if run.args.reward in baselines.TREE_SEARCH:
        return baselines.play_trees(g, run, t)
    base = onpolicy.reads_base(run.args, run.reward)
    t0 = time.perf_counter()
    trajs, kv_bytes = grpo.play_rollouts(g, run, stats=run.reward.needs_stats and not base)
    t1 = time.perf_counter()
    t["t_rollout"] += t1 - t0
    if base:
        onpolicy.read_from_base(run.policy, trajs, run.args.micro_batch, run.ctx.cost)
    t["t_base_read"] += time.perf_counter() - t1
    t["t_reward"] += time.perf_counter() - t1
    return grpo.score_group(trajs, run, t, kv_bytes)


def train_step(step: int, run: LabTraining) -> dict:
    """grpo.train_step, with --oversample's groups set aside, AT²PO's batch, and the probe's
    refit (--probe-retrain-every), whose report joins the step's metrics."""
    args, procs = run.args, run.procs
    t = grpo.start_step(run, TIMING)
    if args.oversample > 1:
        kept, played = credit.oversample(step, run, t, play_group)
    else:
        played = [play_group(step * args.batch + j, run, t)
                  for j in range(procs.rank, args.batch, procs.size)]
        kept = played
    stats = learn(kept, run, t)
    refit = onpolicy.after_step(run, step, [traj for g in kept for traj in g.trajs])
    rec = grpo.step_metrics(step, kept, played, stats, t, run)
    rec.update(refit or {})
    return rec


def learn(groups: list[grpo.Group], run: LabTraining, t: dict) -> dict:
    """grpo.learn; AT²PO's update reads each token's turn and weight (baselines.turn_batch)."""
    t0 = time.perf_counter()
    trajs = [traj for group in groups for traj in group.trajs]
    advantages = [a for group in groups for a in group.advantages]
    if run.args.reward == baselines.AT2PO:
        batch = baselines.turn_batch(trajs, advantages, run.tok.pad_id)
    else:
        batch = pair.make_batch(trajs, advantages, run.tok.pad_id)
    stats = grpo.update_policy(run, batch)
    t["t_update"] = time.perf_counter() - t0
    return stats


# --- the loop -----------------------------------------------------------------------------------

def train(args) -> dict:
    """grpo.train's loop: setup, the base model's evaluation, --steps steps with a checkpoint and
    an evaluation every --save-every steps and at the end, the summary."""
    started = time.perf_counter()
    run = setup(args)
    start = resume(run)
    if run.procs.main:
        # the record names the code each segment ran: a run resumed on other code says so
        runs.record_code(run.out, start, Path(__file__).resolve().parent.parent)
    done = {e["step"] for e in grpo.read_jsonl(run.out / "eval.jsonl")}     # not evaluated again
    evaluate_and_log(run, start, done)
    progress = grpo.Progress()
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        grpo.set_lr(run, step)
        baselines.refresh_teacher(args, run.ctx, run.policy, step)
        rec = train_step(step, run)
        grpo.record_step(run, rec, progress, t0)
        if grpo.checkpoint_due(step + 1, args):
            grpo.save_and_log(run, step + 1, lagged_files(run.ctx))
            onpolicy.at_checkpoint(run, step + 1)
            evaluate_and_log(run, step + 1, done)
    summary = grpo.finish(run, time.perf_counter() - started, run.summary)
    if run.procs.main:
        runs.release(run.out)
    return summary


LAGGED = "lagged.safetensors"       # TIPS' lagged teacher, kept with each checkpoint


def lagged_files(ctx) -> dict:
    if ctx.lagged is None:
        return {}
    return {LAGGED: ctx.lagged}


def resume(run: LabTraining) -> int:
    """grpo.resume, the lagged teacher of the checkpoint, and the refit's files and head."""
    start = grpo.resume(run)
    lagged = run.out / f"checkpoint-{start:06d}" / LAGGED      # the checkpoint resumed from
    if start and lagged.exists():
        run.ctx.lagged = load_file(lagged)
    onpolicy.on_resume(run, start)
    return start


def evaluate_and_log(run: LabTraining, step: int, done: set) -> None:
    """grpo.evaluate_and_log, sampled under --eval-samples; the base model's evaluation is kept
    for later runs of the same policy and settings, and read from there."""
    if run.args.no_eval or step in done:
        return
    ev = None
    if step == 0:
        ev = onpolicy.cached_base_eval(run)
    cached = ev is not None
    if ev is None and run.args.eval_samples:
        ev = credit.evaluate_sampled(step, run.policy, run.tok, run.held, run.args, run.procs)
    ev = grpo.evaluate_and_log(run, step, done, ev)
    if step == 0 and not cached:
        onpolicy.keep_base_eval(run, ev)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, grpo.stop)
    try:
        return train(args)
    except (*grpo.INPUT_ERRORS, toolbench.LLMError) as e:      # the judge's endpoint too
        let_go(args)
        sys.exit(f"error: {e}")
    except SystemExit:
        let_go(args)
        raise
    except KeyboardInterrupt as e:      # Ctrl-C, or SIGTERM (grpo.Stopped)
        runs.release(Path(args.out))
        sys.exit(grpo.interrupted(args, argv, PROG, e))
    finally:
        signal.signal(signal.SIGTERM, previous)


def let_go(args) -> None:
    """A run that failed before logging anything leaves nothing behind (runs.forget_failed); any
    other leaves its files and no lock."""
    runs.forget_failed(args)
    runs.release(Path(args.out))


if __name__ == "__main__":
    main()
