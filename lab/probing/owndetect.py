"""Detection on a real model's own GTA turns (`python -m lab.ownturns detect`, METHOD.md §14):
every method's AUROC on the labelled turns of one or more extractions, out of fold by episode,
pooled and within prefixes (a prefix's right and wrong samples: the ranking a GRPO group makes),
by kind of turn and with the malformed ones apart, each against the turn's confidence on the same
resamples of the episodes; and, given the released GTA turns' features of the same model, the
same methods fitted on the released turns and scored on the own turns, and the reverse."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import pair
import probes
from lab.probing import detection

FOLDS = 5
FIT_SEEDS = detection.SEEDS
# Fitted on labelled turns: every feature set of the paper's probes (Lookback Lens and Head
# Entropy among them) and PAIR's two stages. Free: read off the turn with no fit.
FITTED = probes.FEATURES + ("pair_s_bc", "pair")
# The free signal every method is compared with: what a confidence reward would read.
CONFIDENCE = "logprob_mean"
FREE = (CONFIDENCE,) + detection.SCORES
# The turns a row is measured on: malformed turns apart, since a parser already catches them;
# "malformed" is every right turn against the malformed ones (how a score ranks what a parser
# catches: a reward scoring them above the right turns would teach the policy to write them).
SUBSETS = ("all", "well_formed", "call", "final", "malformed")
RESAMPLES = 1000


@dataclass
class Corpus:
    """The labelled turns of one or more extractions, concatenated."""
    turns: detection.Split
    episode: list[str]          # "<split>/<episode id>": the unit of folds and of the bootstrap
    prefix: list[str]           # "<split>/<episode id>/<turn>": one prefix's samples, a group
    kind: list[str]             # lab.ownturns.KINDS


def load_corpus(dirs: list[str]) -> Corpus:
    """own_turns.safetensors of each extraction directory (one model, one dtype)."""
    parts = []
    for d in dirs:
        path = Path(d) / "own_turns.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not found; `python -m lab.ownturns extract "
                                    f"--out {d}` writes it when every prefix is sampled")
        parts.append((path, detection.load_split(path, str(d))))
    first_path, first = parts[0]
    for path, split in parts[1:]:
        probes.check_same_source(probes.source(first.meta), first_path,
                                 probes.source(split.meta), path)
    episode, prefix, kind = [], [], []
    for _, split in parts:
        name = split.meta["split"]
        episode += [f"{name}/{e}" for e in split.episode_id]
        prefix += [f"{name}/{e}/{t}" for e, t in zip(split.episode_id,
                                                     split.raw["turn_idx"].tolist())]
        kind += split.meta["kind"]
    return Corpus(detection.concat_splits([s for _, s in parts]), episode, prefix, kind)


def subset(corpus_kind: list[str], name: str, y: torch.Tensor) -> torch.Tensor:
    """The boolean mask of SUBSETS' `name` over the turns (labels `y`)."""
    if name == "all":
        return torch.ones(len(corpus_kind), dtype=torch.bool)
    if name == "malformed":
        return torch.tensor([k == "malformed" for k in corpus_kind]) | (y == 1)
    keep = {"well_formed": {"call", "final"}, "call": {"call"}, "final": {"final"}}[name]
    return torch.tensor([k in keep for k in corpus_kind])


def fit_all(train: detection.Split, seed: int) -> dict:
    """Every FITTED model on the seed's class-balanced subsample of `train` (the study's way)."""
    chosen = train.take(detection.balanced_indices(train.y, seed))
    models = detection.fit_baselines(chosen)
    models["pair"] = pair.fit_pair(chosen.raw, chosen.y, stage1=models["last_token"])
    return models


def fitted_scores(models: dict, raw: dict) -> dict[str, torch.Tensor]:
    """P(right) of every FITTED model for the turns of `raw`."""
    out = {name: detection.predict(m, raw).double() for name, m in models.items()
           if name != "pair"}
    s_bc, s_final = models["pair"].scores(raw)
    out["pair_s_bc"], out["pair"] = s_bc.double(), s_final.double()
    return out


def free_scores(raw: dict) -> dict[str, torch.Tensor]:
    """Each FREE score, higher = more likely right: the turn's mean token log-probability
    (where the turns were sampled), the attention's -entropy, CoE's two."""
    out = {}
    if CONFIDENCE in raw:           # own turns; a teacher-forced features file has none
        out[CONFIDENCE] = raw[CONFIDENCE].double()
    out.update({name: detection.unsupervised_score(name, raw) for name in detection.SCORES})
    return out


def seed_mean(runs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.stack([r[name] for r in runs]).mean(0) for name in runs[0]}


def out_of_fold(corpus: Corpus, folds: int = FOLDS, seeds=FIT_SEEDS) -> dict[str, torch.Tensor]:
    """Each turn's score from the FITTED models fitted on the other folds (folds of episodes,
    the same for every method), averaged over the seeds' balanced subsamples; FREE as read."""
    n = len(corpus.turns.y)
    fold = pair.episode_folds(corpus.episode, folds, 0)
    scores = {name: torch.full((n,), math.nan, dtype=torch.float64) for name in FITTED}
    for k in range(folds):
        held = (fold == k).nonzero().flatten()
        fit = corpus.turns.take((fold != k).nonzero().flatten())
        held_raw = corpus.turns.take(held).raw
        mean = fit_over_seeds(fit, held_raw, seeds)
        for name in FITTED:
            scores[name][held] = mean[name]
    return {**scores, **free_scores(corpus.turns.raw)}


def weighted_auroc(y: torch.Tensor, s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """AUROC(y, s) with each turn counted w times, for R weightings at once: w (R, N) -> (R,)
    (ties 1/2; NaN where a weighting leaves a class empty). Integer weights give the AUROC of
    the turns repeated that often."""
    _, tie = torch.unique(s, return_inverse=True)                      # sorted distinct values
    G = int(tie.max()) + 1
    w = w.double()
    pos = torch.zeros(w.shape[0], G, dtype=torch.float64).index_add_(1, tie, w * (y == 1))
    neg = torch.zeros(w.shape[0], G, dtype=torch.float64).index_add_(1, tie, w * (y == 0))
    below = neg.cumsum(1) - neg                                        # negatives scored lower
    wins = (pos * (below + 0.5 * neg)).sum(1)
    return wins / (pos.sum(1) * neg.sum(1))


def episode_draws(episodes: list[str], resamples: int = RESAMPLES, seed: int = 0):
    """How often each episode is drawn in each of `resamples` resamples of the episodes with
    replacement, (R, E), and each turn's episode index, (N,). Seeded: every method measured on
    the same turns sees the same resamples, so their differences pair."""
    names = sorted(set(episodes))
    index = {e: i for i, e in enumerate(names)}
    of = torch.tensor([index[e] for e in episodes])
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(names), (resamples, len(names)), generator=g)
    counts = torch.zeros(resamples, len(names), dtype=torch.float64)
    return counts.scatter_add_(1, draws, torch.ones(draws.shape, dtype=torch.float64)), of


def percentiles(values: torch.Tensor) -> list[float] | None:
    """The 2.5th and 97.5th percentiles of a bootstrap's values, NaNs (empty draws) left out."""
    values = values[~values.isnan()].sort().values.tolist()
    if not values:
        return None
    return [values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]]


def pooled_auroc(y: torch.Tensor, s: torch.Tensor, counts: torch.Tensor, of: torch.Tensor):
    """AUROC(y, s) and its value in each resample of episode_draws (NaN where a class is
    empty); (None, None) when the turns hold one class."""
    if not 0 < int(y.sum()) < len(y):
        return None, None
    return probes.auroc(y, s), weighted_auroc(y, s, counts[:, of])


def within_prefixes(y: torch.Tensor, s: torch.Tensor, prefix: list[str], counts: torch.Tensor,
                    of: torch.Tensor):
    """The AUROC a GRPO group's ranking sees: over every pair of a right and a wrong turn of the
    same prefix, the share where the right one scores higher (ties 1/2); its value in each
    resample of episode_draws; and the prefixes and pairs it stands on. None where no prefix
    holds both classes."""
    by_prefix = detection.group_wins(y, s, prefix)
    if not by_prefix:
        return None
    # a prefix lies in one episode: its episode's index, from any of its turns
    episode_of = {key: int(e) for key, e in zip(prefix, of.tolist())}
    wins = torch.zeros(counts.shape[1], dtype=torch.float64)
    pairs = torch.zeros(counts.shape[1], dtype=torch.float64)
    for key, (w, p) in by_prefix.items():
        wins[episode_of[key]] += w
        pairs[episode_of[key]] += p
    return {"auroc": (wins.sum() / pairs.sum()).item(), "prefixes": len(by_prefix),
            "pairs": int(pairs.sum()), "values": (counts @ wins) / (counts @ pairs)}


def measure(y, scores: dict[str, torch.Tensor], episodes: list[str], prefix: list[str] | None,
            kinds: list[str] | None) -> dict:
    """Per method and SUBSETS (only "all" where `kinds` is None): turns, right, AUROC pooled
    and (when `prefix` is given) within prefixes, each with a 95% interval over resampled
    episodes; and where the turn's confidence (CONFIDENCE) is among the scores, each method's
    difference from it with the interval of the same resamples, paired."""
    out = {name: {} for name in scores}
    for sub in SUBSETS if kinds is not None else ("all",):
        m = subset(kinds, sub, y) if kinds is not None else torch.ones(len(y), dtype=torch.bool)
        if not m.any():
            continue
        idx = m.nonzero().flatten().tolist()
        ys, es = y[m], [episodes[i] for i in idx]
        counts, of = episode_draws(es)
        read = {}
        for name, s in scores.items():
            auroc, values = pooled_auroc(ys, s[m], counts, of)
            within = (within_prefixes(ys, s[m], [prefix[i] for i in idx], counts, of)
                      if prefix is not None else None)
            read[name] = (auroc, values, within)
        for name, (auroc, values, within) in read.items():
            row = {"turns": int(m.sum()), "right": int(ys.sum()), "auroc": auroc,
                   "interval95": percentiles(values) if values is not None else None}
            if prefix is not None:
                row["within"] = within and {**{k: v for k, v in within.items() if k != "values"},
                                            "interval95": percentiles(within["values"])}
            if CONFIDENCE in read and name != CONFIDENCE and auroc is not None:
                ref_auroc, ref_values, ref_within = read[CONFIDENCE]
                row["minus_confidence"] = {"pooled": auroc - ref_auroc,
                                           "interval95": percentiles(values - ref_values)}
                if within and ref_within:
                    row["minus_confidence"]["within"] = within["auroc"] - ref_within["auroc"]
                    row["minus_confidence"]["within_interval95"] = percentiles(
                        within["values"] - ref_within["values"])
            out[name][sub] = row
    return out


def fit_over_seeds(train: detection.Split, raw: dict, seeds=FIT_SEEDS) -> dict:
    return seed_mean([fitted_scores(fit_all(train, seed), raw) for seed in seeds])


def released_splits(features_dir) -> tuple[detection.Split, dict[str, detection.Split]]:
    """The released GTA turns' features (`lab.study extract`): the training set (clean, with
    the contaminated twins where extracted) and the test splits present."""
    splits = detection.load_splits(features_dir, detection.TRAIN_SPLITS["mixed"]
                                   + detection.TEST_SPLITS)
    if "matched_clean_train" not in splits:
        raise FileNotFoundError(f"{features_dir}: no matched_clean_train.safetensors")
    train = [splits["matched_clean_train"]] + [splits[n] for n in ("matched_contaminated_train",)
                                                if n in splits]
    tests = {n: splits[n] for n in detection.TEST_SPLITS if n in splits}
    if not tests:
        raise FileNotFoundError(f"{features_dir}: no {' or '.join(detection.TEST_SPLITS)}")
    return detection.concat_splits(train), tests


def prefixes_both(y: torch.Tensor, prefix: list[str], keep: torch.Tensor) -> int:
    """How many prefixes hold a right and a wrong turn among the turns `keep` marks."""
    seen: dict[str, set] = {}
    for label, key, k in zip(y.tolist(), prefix, keep.tolist()):
        if k:
            seen.setdefault(key, set()).add(label)
    return sum(len(labels) == 2 for labels in seen.values())


def detect(corpus: Corpus, released_dir=None, folds: int = FOLDS) -> dict:
    """The whole table: own turns out of fold; with the released features, the same methods
    fitted on the released training turns and scored on their test splits and on the own turns,
    and fitted on every own turn and scored on the released test splits."""
    y, kinds = corpus.turns.y, corpus.kind
    t0 = time.perf_counter()
    every, sampled = torch.ones(len(y), dtype=torch.bool), corpus.turns.raw["greedy"] == 0
    out = {"turns": len(y), "right": int(y.sum()), "episodes": len(set(corpus.episode)),
           "prefixes": len(set(corpus.prefix)),
           "prefixes_both": prefixes_both(y, corpus.prefix, every),
           "prefixes_both_sampled": prefixes_both(y, corpus.prefix, sampled),
           "folds": folds, "seeds": list(FIT_SEEDS),
           "own": measure(y, out_of_fold(corpus, folds), corpus.episode, corpus.prefix, kinds)}
    if released_dir is not None:
        train, tests = released_splits(released_dir)
        for name, split in tests.items():
            probes.check_same_source(probes.source(split.meta), f"{released_dir}/{name}",
                                     probes.source(corpus.turns.meta), "the own turns")
        released_here = {}
        for name, split in tests.items():
            scores = {**fit_over_seeds(train, split.raw), **free_scores(split.raw)}
            released_here[name] = measure(split.y, scores, split.episode_id, None, None)
        out["released"] = released_here
        scores = {**fit_over_seeds(train, corpus.turns.raw), **free_scores(corpus.turns.raw)}
        out["released_to_own"] = measure(y, scores, corpus.episode, corpus.prefix, kinds)
        own_to = {}
        for name, split in tests.items():
            scores = fit_over_seeds(corpus.turns, split.raw)
            own_to[name] = measure(split.y, scores, split.episode_id, None, None)
        out["own_to_released"] = own_to
    out["seconds"] = time.perf_counter() - t0
    return out


def cell(row: dict | None, within: bool = False) -> str:
    """"0.812 [0.75, 0.87]" of a measure() row (its within-prefix reading with `within`)."""
    if row is None:
        return "—"
    if within:
        row = row.get("within")
        if row is None:
            return "—"
    if row["auroc"] is None:
        return "—"
    lo_hi = row.get("interval95")
    return f"{row['auroc']:.3f}" + (f" [{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]" if lo_hi else "")


def render(r: dict) -> str:
    """detection.md: the own turns' table, then the transfer table where it was measured."""
    methods = list(r["own"])
    first = r["own"][methods[0]]
    count = {sub: f"{first[sub]['turns']} turns, {first[sub]['right']} right"
             for sub in SUBSETS if sub in first}
    lines = ["# Detection on the model's own GTA turns\n",
             f"{r['turns']} labelled turns ({r['right']} right) of {r['episodes']} episodes and "
             f"{r['prefixes']} prefixes, {r['prefixes_both']} of them holding both classes "
             f"({r['prefixes_both_sampled']} among the turns sampled at temperature 1, the "
             f"greedy ones aside); fitted methods scored out of fold ({r['folds']} folds "
             f"of episodes, the same for every method), each fold's fit the mean of seeds "
             f"{', '.join(map(str, r['seeds']))} (a class-balanced subsample each). AUROC, right "
             f"against wrong, [95% interval over resampled episodes]; within prefixes: the "
             f"right and wrong samples of the same gold prefix, as a GRPO group ranks them.\n",
             "| Method | all: pooled | all: within prefixes | well-formed: pooled | "
             "well-formed: within | calls | final answers | right against malformed |",
             "|---|---|---|---|---|---|---|---|"]
    for name in methods:
        row = r["own"][name]
        lines.append(f"| {name} | {cell(row.get('all'))} | {cell(row.get('all'), True)} | "
                     f"{cell(row.get('well_formed'))} | {cell(row.get('well_formed'), True)} | "
                     f"{cell(row.get('call'))} | {cell(row.get('final'))} | "
                     f"{cell(row.get('malformed'))} |")
    lines.append("\nTurns: " + "; ".join(f"{sub} {c}" for sub, c in count.items()) + ".")
    pairs = {sub: first[sub]["within"] for sub in ("all", "well_formed")
             if sub in first and first[sub].get("within")}
    lines.append("Within prefixes: " + "; ".join(
        f"{sub} {w['prefixes']} prefixes holding both classes, {w['pairs']} pairs"
        for sub, w in pairs.items()) + ".")
    if any("minus_confidence" in row.get("all", {}) for row in r["own"].values()):
        lines += [f"\n## Against the turn's confidence ({CONFIDENCE}), paired\n",
                  "Each method's AUROC minus the confidence's, on the same resamples of the "
                  "episodes [95% interval].\n",
                  "| Method | all: pooled | all: within prefixes | well-formed: pooled | "
                  "well-formed: within |", "|---|---|---|---|---|"]
        for name in methods:
            cells = []
            for sub in ("all", "well_formed"):
                d = r["own"][name].get(sub, {}).get("minus_confidence")
                for key in ("pooled", "within"):
                    lo_hi = d and d.get("interval95" if key == "pooled" else "within_interval95")
                    cells.append(f"{d[key]:+.3f} [{lo_hi[0]:+.2f}, {lo_hi[1]:+.2f}]"
                                 if d and key in d and lo_hi else "—")
            if name != CONFIDENCE:
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if "released" in r:
        tests = list(r["released"])
        lines += ["\n## Beside the released turns, and across\n",
                  "Fitted on the released training turns: scored on their test splits and on "
                  "the own turns; fitted on every own turn: scored on the released test "
                  "splits.\n",
                  "| Method | " + " | ".join(f"released → {t}" for t in tests)
                  + " | released → own: pooled | released → own: within prefixes | "
                  + " | ".join(f"own → {t}" for t in tests) + " | own, out of fold |",
                  "|---|" + "---|" * (2 * len(tests) + 3)]
        for name in methods:
            across = r["released_to_own"][name].get("all")
            lines.append(f"| {name} | "
                         + " | ".join(cell(r["released"][t].get(name, {}).get("all"))
                                      for t in tests)
                         + f" | {cell(across)} | {cell(across, True)} | "
                         + " | ".join(cell(r["own_to_released"][t].get(name, {}).get("all"))
                                      for t in tests)
                         + f" | {cell(r['own'][name].get('all'))} |")
        # The released turns are all well-formed: what their probes make of a malformed own
        # turn apart from what they make of the slips a parser does not catch.
        subsets = ("all", "well_formed", "malformed")
        lines += ["\nThe probes fitted on the released turns against the same methods fitted "
                  "on the own turns (out of fold), on all own turns, on the well-formed ones "
                  "and on the right ones against the malformed (pooled / within prefixes).\n",
                  "| Method | " + " | ".join(f"released → own, {s} | own, {s}" for s in subsets)
                  + " |",
                  "|---|" + "---|" * (2 * len(subsets))]
        for name in methods:
            cells = []
            for sub in subsets:
                for fitted in (r["released_to_own"], r["own"]):
                    m = fitted[name].get(sub)
                    cells.append(f"{cell(m)} / {cell(m, True)}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
