"""Probes fitted on a policy's own labelled turns: how grpo.py gets PAIR and the probe rewards for
the built-in policy, on the fly, once per policy and corpus, cached under $PAIR_CACHE.

A probe is only as good as the turns it was fitted on. Fitted on gold shop dialogs and their
rule-based contaminations, PAIR ranks the built-in policy's *own* turns below chance: that
policy's mistakes (a misremembered quantity in a tool call, a ramble) are not the ones the rules
write. So the default corpus is on-policy: rollouts of the base policy (adapter off) on training
episodes, at the training temperature, every turn labelled exactly by the world, its features
read from the generation pass exactly as the reward reads them. A turn that follows an earlier
wrong turn of the same rollout has a naturally contaminated prefix (distance = assistant turns
since the nearest wrong one), so the clean / contaminated split exists on-policy too.
  --probe-corpus on-policy     that corpus (default)
  --probe-corpus contaminated  the released recipe: `make-data` gold + contaminated dialogs,
                               mode mixed (matched clean + contaminated train), teacher-forced
  --probe-corpus both          the two training sets together
Every corpus is scored on the same held-out own turns: rollouts of the base policy on validation
episodes, which neither the probes nor GRPO train on. PAIR is fitted like the paper's (seed 42
balanced subsample, C = 0.01, stage 2 on in-sample s_bc), the baselines on the same records.

    python -m lab.onpolicy --env shop    # rebuild data/shop-policy/probes/, which grpo.py reads
                                         # (the command: lab/onpolicy.py)

grpo.py reads the probes shipped beside a built-in policy; lab/train.py's loop fits probes of
other settings (--probe-corpus, --corpus-*) or of another policy here on the fly (`shop_probes`)
and caches them.

With --probe-retrain-every N the head the reward reads is fitted again during GRPO on the run's
own turns of the last N steps (the last section: refit and the run-directory files it keeps).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import envs
import grpo
import model
import pair
import probes
from lab.infra import runs
from lab.probing import detection, features, traces
from lab.worlds import released, shop, shopdata, stale
from probes import rollout

PROBE_SEED = 42


def probe_settings(args) -> dict:
    """What a policy's fitted probes depend on besides its files (their cache key)."""
    return {"corpus": args.probe_corpus, "own": own_turns_settings(args),
            "contaminated_episodes": args.probe_episodes, "labels": envs.SHOP_SCORING}


def own_turns_settings(args) -> dict:
    """Everything the on-policy turns depend on besides the policy's files: the sampling, and
    where and how it runs (a dtype, a GPU's random stream, the threads' summation order)."""
    return {"corpus_episodes": args.corpus_episodes, "samples": args.corpus_samples,
            "heldout_episodes": args.corpus_heldout, "temperature": args.temperature,
            "top_p": args.top_p, "max_new_tokens": args.max_new_tokens,
            "max_turns": args.max_turns, "max_len": args.max_len, "seed": PROBE_SEED,
            "dtype": args.dtype, "devices": args.devices, "threads": torch.get_num_threads()}


def turn_kind(text: str) -> str:
    """What a turn does: the tool it calls, "Final" or "ParseError"."""
    step = envs.parse_react(text)
    return step.name if isinstance(step, envs.Action) else type(step).__name__


def turn_records(trajs: list) -> detection.Split:
    """One record per assistant turn of shop rollouts (rollout.Trajectory): raw features, the
    world's exact label, whether (and how far back) an earlier turn of the same rollout was
    wrong, the turn's kind (a code per turn_kind, numbered in order of appearance), the mean
    -log pi of its tokens as sampled (nll: the policy's own confidence, for the report) and its
    rollout's task score (for the advantages of grpo's premise gate)."""
    raws, labels, turn_idx, distance, sample, episode_id, kinds = [], [], [], [], [], [], {}
    kind, nll, score = [], [], []
    for k, traj in enumerate(trajs):
        y = traj.episode.labels()
        last_wrong = None
        for t, (step, ok) in enumerate(zip(traj.steps, y)):
            raws.append(detection.raw_with_coe(step.trace))
            kind.append(kinds.setdefault(turn_kind(step.text), len(kinds)))
            nll.append(float("nan") if step.nll is None else step.nll)
            labels.append(int(ok))
            turn_idx.append(t)
            distance.append(-1 if last_wrong is None else t - last_wrong)
            sample.append(k)
            score.append(traj.score)
            episode_id.append(traj.episode.id)
            if not ok:
                last_wrong = t
    raw = probes.stack_raw(raws)
    raw.update(label=torch.tensor(labels), turn_idx=torch.tensor(turn_idx),
               distance=torch.tensor(distance), rollout=torch.tensor(sample),
               kind=torch.tensor(kind), nll=torch.tensor(nll),
               score=torch.tensor(score, dtype=torch.float64))
    return detection.Split("own_turns", raw, raw["label"].long(), episode_id,
                           {"kinds": list(kinds)})


def kind_balanced_indices(y: torch.Tensor, kind: torch.Tensor, seed: int) -> torch.Tensor:
    """Indices in which every kind of turn that has both classes has them equally often: the
    minority class of each kind drawn again (with replacement, seeded) up to the majority's
    count. A kind with one class is kept as it is.

    Why: a policy's own turns are not matched pairs. The built-in policy's Lookups are 98% right
    and its Calculator calls mostly wrong, and a probe fitted on them as they come learns those
    base rates: a right Calculator call then scores far below a right Lookup, every turn after
    the first calculation sits below the group's mean, and the process-supervision advantage is
    negative on every kind of turn (the README's results section measures it: GRPO on that
    reward lowered held-out success). The paper's corpus holds each evaluation turn both correct
    and contaminated, so its probe ranks turns within a kind; this gives an on-policy corpus the
    same property."""
    g = torch.Generator().manual_seed(seed)
    keep = []
    for k in kind.unique().tolist():
        idx = (kind == k).nonzero().flatten()
        pos, neg = idx[y[idx] == 1], idx[y[idx] == 0]
        if len(pos) == 0 or len(neg) == 0:
            keep.append(idx)
            continue
        small, big = (pos, neg) if len(pos) < len(neg) else (neg, pos)
        extra = small[torch.randint(len(small), (len(big) - len(small),), generator=g)]
        keep += [big, small, extra]
    return torch.cat(keep)


@torch.no_grad()
def sample_own_turns(policy, tok, env, n_episodes: int, samples: int, args, seed: int,
                     log) -> detection.Split:
    """`samples` rollouts (rollout.rollout) of the base policy on each of the first n_episodes of
    `env`."""
    episodes = [i for i in range(n_episodes) for _ in range(samples)]
    g = torch.Generator(device=policy.model.embed_tokens.weight.device).manual_seed(seed)
    # 16 rows a call: a call decodes until its slowest row is done, so wider calls wait longer
    trajs, rows, t0 = [], 16, time.perf_counter()
    pacer = runs.Pacer(len(episodes), sys.stdout)
    with model.lora_disabled(policy):
        for a in range(0, len(episodes), rows):
            batch = [env.episode(i) for i in episodes[a:a + rows]]
            trajs += rollout(policy, tok, batch, args, generator=g, stats=True)
            if a == 0 and len(trajs) < len(episodes):
                # the first call of a process may have compiled the decoding step (a minute
                # without a line otherwise): said at once, and left out of the ETA
                t1 = time.perf_counter()
                log(f"  {len(trajs)}/{len(episodes)} rollouts of {env.split} episodes, the first "
                    f"{len(trajs)} in {t1 - t0:.0f}s (with compiling, if this process did)",
                    flush=True)
            elif len(trajs) < len(episodes) and pacer.due(len(trajs)):
                rate = (time.perf_counter() - t1) / (len(trajs) - rows)
                log(f"  {len(trajs)}/{len(episodes)} rollouts of {env.split} episodes, ETA "
                    f"{probes.duration(rate * (len(episodes) - len(trajs)))}", flush=True)
    log(f"  {len(trajs)} rollouts of {n_episodes} {env.split} episodes x {samples} in "
        f"{time.perf_counter() - t0:.0f}s", flush=True)
    return turn_records(trajs)


def contaminated_corpus(policy, tok, episodes: int, log) -> detection.Split:
    """The released recipe's training set for this policy: of `make-data`'s matched clean and
    contaminated train records, the ones pair.training_set keeps (mode mixed, seed 42),
    teacher-forced with the base policy. The choice reads labels only, so it is made first and
    only the kept records (about half) are traced."""
    t0 = time.perf_counter()
    log(f"  contaminated corpus: `python -m lab.shop make-data --episodes {episodes}`, its kept "
        "turns teacher-forced ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        shopdata.make_shop_data(tmp, episodes=episodes, seed=PROBE_SEED)
        loaded = [released.load_matched(Path(tmp) / f"{name}.json")
                  for name in detection.TRAIN_SPLITS["mixed"]]
    # feature-less splits whose "raw" says where each row came from: (split, record) indices
    index = {}
    for s, (name, recs) in enumerate(zip(detection.TRAIN_SPLITS["mixed"], loaded)):
        where = {"turn_idx": torch.tensor([int(r["turn_idx"]) for r in recs]),
                 "split": torch.full((len(recs),), s), "record": torch.arange(len(recs))}
        index[name] = detection.Split(name, where, torch.tensor([int(r["label"]) for r in recs]),
                                      [str(r["episode_id"]) for r in recs], {})
    kept = detection.training_set(index, "mixed", PROBE_SEED)
    records = [loaded[s][r] for s, r in zip(kept.raw["split"].tolist(),
                                            kept.raw["record"].tolist())]
    rendered = [features.render_record(r, tok) for r in records]
    with model.lora_disabled(policy):
        traced = traces.trace_batch(policy, [ids for ids, _, _ in rendered],
                                    [span for _, span, _ in rendered])
    raw = probes.stack_raw([detection.raw_with_coe(tr) for tr in traced])
    raw["turn_idx"] = kept.raw["turn_idx"]
    log(f"  contaminated corpus: {len(kept.y)} teacher-forced turns of `python -m lab.shop "
        f"make-data --episodes {episodes}` (mode mixed; the shop world's, also for shop-long, "
        f"which has no make-data) in {time.perf_counter() - t0:.0f}s", flush=True)
    return detection.Split(kept.name, raw, kept.y, kept.episode_id, {})


def fit_probes(train: detection.Split, info: dict) -> dict:
    """PAIR and every baseline probe on one training set (balanced subsample, seed 42)."""
    fitted = detection.fit_baselines(train, info=info)
    fitted["pair"] = pair.fit_pair(train.raw, train.y, info=info,
                                   stage1=fitted["last_token"])
    return fitted


def heldout_auroc(fitted: dict, heldout: detection.Split) -> dict:
    """AUROC of every fitted method on the held-out own turns: all, clean prefix, contaminated
    prefix, by distance to the nearest earlier wrong turn, by kind of turn (turn_kind), and at
    each habit's own turn (shop.slip_turns; shop-copy: each kind of decision) with a clean
    prefix: the slip made against the same decision made right.

    Why the last: a turn after a wrong one is wrong by its label and easy to tell, and kinds and
    positions differ in how often they are right, so the pooled AUROC can be high while the probe
    cannot tell a slip from the same call made right, which is the decision a per-turn reward has
    to credit."""
    d, kind = heldout.raw["distance"], heldout.raw["kind"]
    groups = {"all": torch.ones_like(d, dtype=torch.bool), "clean_prefix": d < 0,
              "contaminated_prefix": d > 0,
              **{f"d={k}": d == k for k in (1, 2)}, "d>=3": d >= 3,
              **{f"kind={name}": kind == code
                 for code, name in enumerate(heldout.meta.get("kinds", ()))}}
    at = [None if a is None else shop.slip_kind(a) for a in habit_at(heldout)]
    for slip in (*shop.LONG_SLIPS, *shop.COPY_DECISIONS, *stale.STALE_DECISIONS):
        here = torch.tensor([a == slip for a in at], dtype=torch.bool)
        if here.any():
            groups[f"slip={slip}"] = here & (d < 0)
    scores = {name: detection.predict(m, heldout.raw) for name, m in fitted.items()}
    if "nll" in heldout.raw:        # unsupervised: the turn's own confidence, no probe at all
        scores["confidence"] = -heldout.raw["nll"].double()
    out = {}
    for name, p in scores.items():
        out[name] = {}
        for g, sel in groups.items():
            y = heldout.y[sel]
            out[name][g] = probes.auroc(y, p[sel]) if 0 < int(y.sum()) < len(y) else None
    out["n"] = {g: int(sel.sum()) for g, sel in groups.items()}
    out["n_correct"] = {g: int(heldout.y[sel].sum()) for g, sel in groups.items()}
    return out


def habit_at(turns: detection.Split) -> list[str | None]:
    """For each turn, the habit (shop.slip_turns) whose decision is made at its turn index in its
    episode, or None: with a clean prefix, the turn where a rollout first goes wrong by that
    habit (label 0) or makes the same decision right (label 1)."""
    slip_at = {eid: {t: s for s, t in shop.slip_turns(shop.shop_task_from_id(eid)).items()}
               for eid in set(turns.episode_id)}        # episode -> {turn: the slip made there}
    return [slip_at[eid].get(t)
            for eid, t in zip(turns.episode_id, turns.raw["turn_idx"].tolist())]


def shop_probes(args, policy, tok, procs, log) -> tuple[Path, dict]:
    """The directory of probes fitted for this policy on `--probe-corpus` (fitting them once),
    and its report: AUROC on held-out own turns, next to the contaminated corpus's PAIR.
    grpo.py calls it with its args and its processes (pair.Processes)."""
    settings = probe_settings(args)
    root = model.cache_root() / "grpo-probes" / f"{args.env}-{runs.policy_hash(args.model)}"
    out = root / f"{args.probe_corpus}-{runs.settings_hash(settings)}"
    done = out / "probes.json"
    fitted_by = "an earlier run" if done.is_file() else None
    if procs.main and not done.is_file():
        # two runs starting on one fresh cache (compare --jobs 2): the second waits, then reads
        runs.claim(root, wait=log)
        fitted_by = "another run, which this one waited for" if done.is_file() else None
    if procs.main and not done.is_file():
        t0 = time.perf_counter()
        log(f"fitting the probes of this policy once, {args.probe_corpus} corpus (minutes: "
            f"later runs read them from the cache, {out}):", flush=True)
        train_env = envs.ShopEnv("train", world=shop.WORLDS[args.env])
        heldout = sample_own_turns(policy, tok, envs.ShopEnv("val", world=shop.WORLDS[args.env]),
                                   args.corpus_heldout,
                                   args.corpus_samples, args, PROBE_SEED + 1, log)
        save_heldout(heldout, heldout_path(args))     # grpo's premise gate reads them again
        corpora = {}
        if args.probe_corpus in ("on-policy", "both"):
            own = sample_own_turns(policy, tok, train_env, args.corpus_episodes,
                                   args.corpus_samples, args, PROBE_SEED, log)
            if len(set(own.y.tolist())) < 2:
                raise probes.FormatError(
                    f"--probe-corpus {args.probe_corpus}: all {len(own.y)} turns of the "
                    f"policy's own rollouts ({args.corpus_episodes} episodes x "
                    f"{args.corpus_samples}) are {'right' if own.y[0] else 'wrong'}, and a probe "
                    "needs both (more --corpus-episodes or --max-new-tokens, or "
                    "--probe-corpus contaminated)")
            own = own.take(kind_balanced_indices(own.y, own.raw["kind"], PROBE_SEED))
            corpora["on-policy"] = own.take(detection.balanced_indices(own.y, PROBE_SEED))
        # the released recipe is always fitted: it is the yardstick the startup line prints
        corpora["contaminated"] = contaminated_corpus(policy, tok, args.probe_episodes, log)
        if args.probe_corpus == "both":
            corpora["both"] = detection.concat_splits([corpora["on-policy"],
                                                       corpora["contaminated"]])
        info = {"seed": PROBE_SEED, "corpus": args.probe_corpus}
        fitted = fit_probes(corpora[args.probe_corpus], info)
        reference = fitted if args.probe_corpus == "contaminated" else \
            {"pair": pair.fit_pair(corpora["contaminated"].raw, corpora["contaminated"].y,
                                   info=info)}
        tmp = root / f".{out.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for name, m in fitted.items():        # pair/ is a directory, each probe one file
            m.save(tmp / ("pair" if name == "pair" else f"{name}.safetensors"))
        report = {"format": runs.PROBES_FORMAT, "settings": settings,
                  "n_train": len(corpora[args.probe_corpus].y),
                  "n_train_correct": int(corpora[args.probe_corpus].y.sum()),
                  "heldout": heldout_auroc(fitted, heldout),
                  "contaminated_corpus_pair": heldout_auroc(reference, heldout)["pair"],
                  "seconds": round(time.perf_counter() - t0, 1)}
        grpo.write_json(tmp / "probes.json", report)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)                # the directory appears complete or not at all
    if procs.main:
        runs.release(root)
    if procs.size > 1:                      # the other processes read what the main one wrote
        torch.distributed.barrier()
    try:
        report = json.loads(done.read_text())
        h = report["heldout"]
        h["pair"]["all"], h["n"]["all"], report["n_train"]
        report["contaminated_corpus_pair"]["all"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise SystemExit(f"{done}: a damaged probe cache ({type(e).__name__}: {e}); delete {out} "
                         "and the next run fits these probes again") from None
    log(f"probes: {out} ({args.probe_corpus} corpus, {report['n_train']} turns"
        f"{'; fitted by ' + fitted_by if fitted_by else ''})", flush=True)
    log_report(report, args.reward, log)
    return out, report


HELDOUT_FORMAT = "heldout-turns/1"


def heldout_path(args) -> Path:
    """Where the held-out own turns of this policy are kept: beside its probes, keyed on what
    they depend on (the sampling, the labelling rules)."""
    key = runs.settings_hash({"format": HELDOUT_FORMAT, "own": own_turns_settings(args),
                              "labels": envs.SHOP_SCORING})
    return (model.cache_root() / "grpo-probes" / f"{args.env}-{runs.policy_hash(args.model)}" /
            f"heldout-{key}.safetensors")


def save_heldout(turns: detection.Split, path: Path) -> None:
    meta = {"heldout_turns": json.dumps({"kinds": turns.meta["kinds"],
                                         "episode_id": turns.episode_id})}
    path.parent.mkdir(parents=True, exist_ok=True)
    probes.save_safetensors(turns.raw, path, meta)


def heldout_turns(args, policy, tok, procs, log) -> detection.Split:
    """The held-out own turns that score the fitted probes (shop_probes): --corpus-samples
    rollouts of the base policy on each of the first --corpus-heldout validation episodes, at
    the training sampling, labelled, with their features and task scores. Written when the
    probes are fitted; a cache fitted before they were kept, or a run whose reward fits no probe,
    samples them once (half a minute for the built-in policy)."""
    path = heldout_path(args)
    if procs.main and not path.is_file():
        runs.claim(path.parent, wait=log)
        if not path.is_file():
            log(f"sampling the held-out own turns once ({path}):", flush=True)
            val = envs.ShopEnv("val", world=shop.WORLDS[args.env])
            save_heldout(sample_own_turns(policy, tok, val,
                                          args.corpus_heldout, args.corpus_samples, args,
                                          PROBE_SEED + 1, log), path)
        runs.release(path.parent)
    if procs.size > 1:                      # the other processes read what the main one wrote
        torch.distributed.barrier()
    tensors, meta = probes.read_safetensors(path, "held-out turns")
    try:
        meta = json.loads(meta["heldout_turns"])
        return detection.Split("heldout_turns", tensors, tensors["label"].long(),
                               list(meta["episode_id"]), {"kinds": list(meta["kinds"])})
    except (KeyError, ValueError, TypeError) as e:
        raise SystemExit(f"{path}: a damaged cache of held-out turns ({type(e).__name__}: "
                         f"{e}); delete it and the next run samples them again") from None


def log_report(report: dict, reward: str, log) -> None:
    """The held-out report of shop_probes, as `grpo.py` prints it at start, with a warning
    wherever the probe the reward reads ranks wrong turns above right ones."""
    h, ref = report["heldout"], report["contaminated_corpus_pair"]
    log(f"  PAIR AUROC on {h['n']['all']} held-out own turns (validation episodes): "
        f"{grpo.num(h['pair']['all'])} (clean prefix {grpo.num(h['pair']['clean_prefix'])}, "
        f"after a wrong turn {grpo.num(h['pair']['contaminated_prefix'])}); the "
        f"contaminated-corpus PAIR on the same turns: {grpo.num(ref['all'])}", flush=True)
    kinds = [g for g in h["n"] if g.startswith("kind=")]
    if kinds:                   # caches fitted before the per-kind report have none
        log("  by kind of turn: " + ", ".join(
            f"{g[5:]} {grpo.num(h['pair'].get(g))} ({h['n'][g]} turns, {h['n_correct'][g]} "
            "right)" for g in kinds), flush=True)
    # the probe this run's reward reads
    name = reward if reward in h else "pair"
    what = "PAIR" if name == "pair" else f"the {name} probe"
    slips = [g for g in h["n"] if g.startswith("slip=")]
    if slips:
        log(f"  {what} at the habits' own turns, clean prefix (the slip against the same turn "
            "made right): " + ", ".join(
                f"{g[5:]} {grpo.num(h[name].get(g))} ({h['n'][g]} turns, "
                f"{h['n'][g] - h['n_correct'][g]} wrong)" for g in slips), flush=True)
        if "confidence" in h:
            log("  there, the turn's own confidence (-mean NLL of its tokens, no probe; below "
                "0.5 where the slip is the more confident turn): " +
                ", ".join(f"{g[5:]} {grpo.num(h['confidence'].get(g))}" for g in slips),
                flush=True)
    mine = h[name]["all"]
    if mine is not None and mine < 0.5:
        log(f"  warning: {what} ranks this policy's own held-out turns below chance "
            f"({mine:.3f}): as a reward it favours wrong turns (`--probe-corpus on-policy` fits "
            "it on the policy's own rollouts)", flush=True)
    for g in slips:
        a = h[name].get(g)
        if a is not None and a < 0.5:
            log(f"  warning: {what} ranks the {g[5:]} slip above the same turn made right "
                f"({a:.3f} on {h['n'][g]} held-out turns): as a reward it favours that habit, "
                "which GRPO would otherwise unlearn", flush=True)


# ---------------------------------------------------------------------------------------------
# Re-fitting during GRPO (--probe-retrain-every N; the paper's probe_retrain_every, which it
# tried and disabled): every N steps, the head the reward reads is fitted again on the policy's
# own turns of the last N steps, labelled exactly by the world. PAIR keeps its stage 1 (s_bc is
# read by the frozen one) and refits stage 2; a probe reward refits its probe. The turns of every
# step and every refitted head are files of the run directory, so a resumed run refits on the
# same turns as an uninterrupted one and reads the same head.
# ---------------------------------------------------------------------------------------------

REFIT_DIR = "refit"


def turns_path(out: Path, step: int, rank: int) -> Path:
    return Path(out) / REFIT_DIR / f"turns-{step:06d}-r{rank}.safetensors"


def head_dir(out: Path, step: int) -> Path:
    return Path(out) / REFIT_DIR / f"head-{step:06d}"


def save_step_turns(out: Path, step: int, rank: int, trajs: list) -> None:
    """One process's labelled turns of step `step` (1-based: written after the step), with the
    features the reward read. A turn's kind is stored by name: codes are per file."""
    path = turns_path(out, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    played = [t for t in trajs if t.steps]
    if not played:                      # written all the same: a missing file is an error
        model.write_atomic(path.with_suffix(".none"), "no turn\n")
        path.unlink(missing_ok=True)
        return
    path.with_suffix(".none").unlink(missing_ok=True)
    split = turn_records(played)
    meta = {"pair_refit_turns": json.dumps({"kinds": split.meta["kinds"],
                                            "episode_id": split.episode_id})}
    probes.save_safetensors(split.raw, path, meta)


def load_window(out: Path, steps: range, processes: int) -> detection.Split | None:
    """The turns of `steps`, every process's, kinds recoded by name across files (None: no
    turn at all). A file that is gone is an error, never a smaller window."""
    parts, codes = [], {}
    for step in steps:
        for rank in range(processes):
            path = turns_path(out, step, rank)
            if path.with_suffix(".none").is_file():
                continue
            if not path.is_file():
                raise SystemExit(f"{path} is gone: the turns of step {step} were removed at a "
                                 "later checkpoint, so a run resumed from an earlier one cannot "
                                 "refit as it did; resume from the newest checkpoint")
            tensors, meta = probes.read_safetensors(path, "refit turns")
            meta = json.loads(meta["pair_refit_turns"])
            recode = torch.tensor([codes.setdefault(k, len(codes)) for k in meta["kinds"]])
            tensors["kind"] = recode[tensors["kind"]]
            parts.append(detection.Split(path.stem, tensors, tensors["label"].long(),
                                         meta["episode_id"], {}))
    return detection.concat_splits(parts) if parts else None


def refit(head, window: detection.Split, seed: int):
    """`head` (a pair.Pair or a probes.Probe) fitted again on `window`, balanced as the on-policy
    corpus is (within each kind of turn, then the two classes), and what it did: turns, correct,
    AUROC on the window before and after. None for the head when the window holds one class."""
    y = window.y if window is not None else torch.zeros(0)
    report = {"turns": len(y), "correct": int(y.sum())}
    if not 0 < report["correct"] < len(y):
        return None, report
    train = window.take(kind_balanced_indices(y, window.raw["kind"], seed))
    train = train.take(detection.balanced_indices(train.y, seed))
    if isinstance(head, pair.Pair):     # stage 1 stays: stage 2 reads the frozen s_bc
        new = pair.fit_pair(train.raw, train.y, C=head.stage2.info.get("C", 0.01),
                            stats=head.stats, info=head.info, stage1=head.stage1)
    else:
        name = head.info["feature"]
        new = probes.Probe(info=head.info).fit(pair.feature(name, train.raw), train.y,
                                               C=head.info.get("C", 0.01))
    report["auroc_before"] = probes.auroc(y, detection.predict(head, window.raw))
    report["auroc_after"] = probes.auroc(y, detection.predict(new, window.raw))
    return new, report


def save_head(head, where: Path) -> None:
    if isinstance(head, pair.Pair):
        head.save(where)                # pair.json last: a directory holding it is complete
    else:
        head.save(where / "probe.safetensors")


def latest_head(out: Path, step: int):
    """The newest refitted head of a run at or before `step` (pair.Pair or probes.Probe), and
    its step; (None, 0) when none was fitted yet."""
    found = sorted(p for p in Path(out, REFIT_DIR).glob("head-*")
                   if p.name[5:].isdigit() and int(p.name[5:]) <= step)
    for d in reversed(found):
        if (d / "pair.json").is_file():
            return pair.Pair.load(d), int(d.name[5:])
        if (d / "probe.safetensors").is_file():
            return probes.Probe.load(d / "probe.safetensors"), int(d.name[5:])
    return None, 0


def _step_of(path: Path) -> int | None:
    k = path.name.split("-")[1].split(".")[0] if "-" in path.name else ""
    return int(k) if k.isdigit() else None


def forget_after(out: Path, step: int) -> None:
    """A resumed run redoes what followed its checkpoint: drop the turns and heads after it."""
    for p in Path(out, REFIT_DIR).glob("*-*"):
        if (k := _step_of(p)) is not None and k > step:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def forget_turns(out: Path, step: int, every: int) -> None:
    """At a checkpoint at `step`: the turns no resume can need any more, those before the
    current window (a resume redoes the steps after the checkpoint, and refits on the window's
    earlier steps from their files)."""
    for p in Path(out, REFIT_DIR).glob("turns-*"):
        if (k := _step_of(p)) is not None and k <= step - step % every:
            p.unlink()          # a resume from an older checkpoint then stops (load_window)


def refit_head(run: grpo.Training, step: int) -> dict:
    """--probe-retrain-every N, after step `step`: the head the reward reads fitted again on the
    policy's own turns of the last N steps (refit), saved in the run directory; what
    it did, for metrics.jsonl. Every process fits the same head from the same files."""
    args, ctx, procs = run.args, run.ctx, run.procs
    t0, every = time.perf_counter(), args.probe_retrain_every
    procs.barrier()                 # every process's turns of this step are written
    window = load_window(run.out, range(step - every + 1, step + 1), procs.size)
    head = ctx.pair if ctx.pair is not None else ctx.probe
    new, rep = refit(head, window, PROBE_SEED + step)
    what = "PAIR's stage 2" if ctx.pair is not None else f"the {args.reward} probe"
    if new is None:
        why = "no turn was played" if not rep["turns"] else \
            f"their {rep['turns']} turns are all {'right' if rep['correct'] else 'wrong'}"
        run.log(f"refit: {what} kept, steps {step - every + 1}-{step}: {why}", flush=True)
    else:
        if procs.main:
            save_head(new, head_dir(run.out, step))
        use_head(ctx, new)
        run.log(f"refit: {what} fitted again on the {rep['turns']} own turns of steps "
                f"{step - every + 1}-{step} ({rep['correct']} right), AUROC on them "
                f"{rep['auroc_before']:.3f} -> {rep['auroc_after']:.3f}", flush=True)
    procs.barrier()
    return {**{f"refit_{k}": v for k, v in rep.items()}, "t_refit": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------
# What lab/train.py's loop calls: probes fitted on the fly, the statistics read from the base,
# the refits during a run, the base model's evaluation kept for later runs; with their flags
# ---------------------------------------------------------------------------------------------

def fit_on_the_fly(args, policy, tok, procs, log) -> tuple[Path, dict] | None:
    """The probes of a built-in world's policy fitted for these settings (shop_probes): their
    directory and report; None when the ones shipped beside the built-in policy are those (the
    run reads them, as grpo.py does)."""
    shipped = Path(args.model) / "probes" / "probes.json"
    if grpo.is_builtin(args, shop.WORLDS) and shipped.is_file() and \
            json.loads(shipped.read_text()).get("settings") == probe_settings(args):
        return None
    return shop_probes(args, policy, tok, procs, log)


def check(args, reward: pair.Reward) -> None:
    """The rules between this module's flags and the run's reward and world."""
    if args.probe_retrain_every and not reward.reads_probe:
        sys.exit(f"--probe-retrain-every: --reward {args.reward} reads no probe to refit (pair or "
                 f"a probe reward: {', '.join(sorted(pair.PROBE_REWARDS))})")
    if args.probe_retrain_every and args.env not in shop.WORLDS:
        sys.exit(f"--probe-retrain-every refits on the exact labels of the policy's own turns, "
                 f"which only the built-in world has (its tool calls re-executed); {args.env}'s "
                 "replayed tools label only the final answer")


def after_step(run, step: int, trajs) -> dict | None:
    """--probe-retrain-every N: keep the step's turns (until no resume needs them), and after
    every N-th step fit the head again (refit_head); its report joins the step's metrics."""
    every = run.args.probe_retrain_every
    if not every:
        return None
    save_step_turns(run.out, step + 1, run.procs.rank, trajs)
    if (step + 1) % every == 0:
        return refit_head(run, step + 1)
    return None


def use_head(ctx, head) -> None:
    """Reward with a refitted head: a pair.Pair or a probes.Probe."""
    if isinstance(head, pair.Pair):
        ctx.pair = head
    else:
        ctx.probe = head


def on_resume(run, start: int) -> None:
    """Turns and heads of the steps to be redone are not this run's; the head read at the
    checkpoint is read again."""
    if run.procs.main:
        forget_after(run.out, start)
    run.procs.barrier()
    if run.args.probe_retrain_every and start:
        head, k = latest_head(run.out, start)
        if head is not None:
            use_head(run.ctx, head)
            run.log(f"reading the head refitted after step {k} ({head_dir(run.out, k)})",
                    flush=True)


def at_checkpoint(run, step: int) -> None:
    if run.args.probe_retrain_every and run.procs.main:
        forget_turns(run.out, step, run.args.probe_retrain_every)


# What the probes of the built-in policy are fitted on (--probe-corpus; onpolicy.py fits them)
PROBE_CORPORA = ("on-policy", "contaminated", "both")


def add_flags(ap) -> None:
    """This module's flags, on the lab's parser."""
    a = ap.add_argument
    a("--probe-corpus", default="on-policy", choices=PROBE_CORPORA,
      help="shop, probes fitted on the fly: on-policy = rollouts of the base policy on training "
           "episodes, labelled by the world; contaminated = `python -m lab.shop make-data` gold "
           "dialogs and their rule-based contaminations (the released recipe); both = the two "
           "together")
    a("--probe-retrain-every", type=int, default=0,
      help="shop: every N steps, fit the head the reward reads again (PAIR's stage 2, or the "
           "probe) on the policy's own turns of the last N steps, labelled by the world "
           "(0: never; the paper tried it and kept it off)")
    a("--corpus-episodes", type=int, default=100,
      help="on-policy corpus: training episodes sampled")
    a("--corpus-samples", type=int, default=4,
      help="on-policy corpus: rollouts per episode (also for the held-out own turns)")
    a("--corpus-heldout", type=int, default=50,
      help="validation episodes whose rollouts score the fitted probes (held-out own turns)")
    a("--probe-episodes", type=int, default=200,
      help="contaminated corpus: episodes of `python -m lab.shop make-data` (80%% of them train)")
    a("--probe-reads", default="policy", choices=("policy", "base"),
      help="where PAIR and the probes read a turn's statistics: policy = the generation pass "
           "(the paper); base = the same tokens teacher-forced through the frozen base model "
           "(one extra forward per step; a drifting policy cannot move what the probe reads)")


RANGES = {**{k: grpo.at_least(1) for k in ("corpus_episodes", "corpus_samples", "corpus_heldout")},
          "probe_retrain_every": grpo.at_least(0), "probe_episodes": grpo.at_least(2)}
RESUME_KEYS = ("probe_corpus", "corpus_episodes", "corpus_samples", "corpus_heldout",
               "probe_episodes", "probe_retrain_every", "probe_reads")
RESUME_DEFAULTS = {"probe_retrain_every": 0, "probe_reads": "policy"}


def read_from_base(policy, trajs: list, rows_per_forward: int, cost=None) -> None:
    """--probe-reads base: every turn's statistics from its tokens teacher-forced through the
    frozen base (adapter off) instead of the generation pass, so that the probe reads the
    representation it was fitted on: a policy cannot move its own hidden states to please it."""
    seqs, spans, steps = [], [], []
    for traj in trajs:
        for step in traj.steps:
            seqs.append(traj.segments[step.segment][:step.span[1]])
            spans.append(step.span)
            steps.append(step)
    if cost is not None:
        cost.update(tf_rows=len(seqs), tf_tokens=sum(map(len, seqs)))
    with model.lora_disabled(policy):
        traced = traces.trace_batch(policy, seqs, spans, rows_per_forward=rows_per_forward)
    for step, trace in zip(steps, traced):
        step.trace = trace


def reads_base(args, reward: pair.Reward) -> bool:
    """--probe-reads base, for a reward that reads the statistics."""
    return reward.needs_stats and args.probe_reads == "base"


def base_eval_cache(policy, args, procs) -> Path | None:
    """Where the base model's evaluation is kept for later runs (greedy decoding of a fixed pool,
    or --eval-samples' seeded draws, are the same in every run of one policy and settings), keyed
    on all the rollouts depend on,
    threads and batch included (float summation order). Built-in worlds only."""
    if args.env not in shop.WORLDS or procs.size > 1:
        return None
    settings = {"val": args.val_episodes, "test": args.eval_episodes, "batch": args.eval_batch,
                "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens,
                "max_len": args.max_len, "dtype": args.dtype, "devices": args.devices,
                "threads": torch.get_num_threads(), "scoring": envs.SHOP_SCORING}
    if args.eval_samples:       # sampled: the draws depend on the sampling too
        settings.update(samples=args.eval_samples, temperature=args.temperature, top_p=args.top_p)
    key = f"{runs.policy_hash(policy.checkpoint_dir)}-{runs.settings_hash(settings)}"
    return model.cache_root() / "grpo-base-eval" / f"{args.env}-{key}.json"


def cached_base_eval(run) -> dict | None:
    """The base model's evaluation by an earlier run of this policy and settings, if any."""
    cache = base_eval_cache(run.policy, run.args, run.procs)
    if cache is None or not cache.is_file():
        return None
    run.log(f"base model: evaluated by an earlier run of this policy with these evaluation "
            f"settings ({cache})", flush=True)
    return json.loads(cache.read_text())


def keep_base_eval(run, ev: dict) -> None:
    """Keep the base model's evaluation for later runs."""
    cache = base_eval_cache(run.policy, run.args, run.procs)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        grpo.write_json(cache, ev)
