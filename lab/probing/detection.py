"""The detection protocol (METHOD.md §8), what every command of `python -m lab.study` but
`extract` runs on: features files read as splits, each seed's class-balanced training set, the
probes fitted on it, their scores, and the metrics those scores are measured by.

Each probe is trained with seeds 42, 43, 44; a seed draws a class-balanced subsample of
matched_clean_train (the same records are taken from matched_contaminated_train in mixed mode);
results are mean +- std over seeds on matched_clean_test and matched_contaminated_test.
lab/probing/features.py extracts the features and lab/study.py runs the commands;
lab/probing/report.py builds the paper's tables.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import pair
import probes


SEEDS = (42, 43, 44)
MODES = ("mixed", "clean_only")
TRAIN_SPLITS = {"clean_only": ("matched_clean_train",),
                "mixed": ("matched_clean_train", "matched_contaminated_train")}
TEST_SPLITS = ("matched_clean_test", "matched_contaminated_test")
DIAGNOSTIC_SPLIT = "matched_diagnostic_test"   # python -m lab.shop make-data writes it
# Keys of `raw_with_coe`: the core's raw features and CoE's two scores; a features file stacks
# them over records.
RAW_KEYS = probes.RAW_KEYS + ("coe_r", "coe_c")


def coe_scores(h: torch.Tensor) -> tuple[float, float]:
    """CoE-R = mean M - mean A and CoE-C = |mean M e^{iA}| (Wang et al., ICLR 2025) from the
    span-mean hidden state of every layer, h: (L+1, d), with M, A the relative magnitude and
    angle steps; as the paper's code, higher = more likely correct (no sign inverted)."""
    h = h.double()
    step = h[1:] - h[:-1]                                               # (L, d)
    M = step.norm(dim=-1) / (h[-1] - h[0]).norm()                       # (L,) relative magnitude
    cos = F.cosine_similarity(h[1:], h[:-1], dim=-1).clamp(-1.0, 1.0)    # (L,)
    cos_end = F.cosine_similarity(h[-1], h[0], dim=0).clamp(-1.0, 1.0)
    A = torch.arccos(cos) / torch.arccos(cos_end)                       # (L,) relative angle
    coe_r = M.mean() - A.mean()
    coe_c = torch.hypot((M * torch.cos(A)).mean(), (M * torch.sin(A)).mean())
    return coe_r.item(), coe_c.item()


def raw_with_coe(trace) -> dict[str, torch.Tensor]:
    """probes.raw_features of one TurnTrace, then CoE's two scores (float32) from every layer's
    turn mean, which the core does not keep: a record of a features file, of the on-policy
    corpus, or of the coe reward."""
    raw = probes.raw_features(trace)
    coe_r, coe_c = coe_scores(trace.h_mean)
    raw["coe_r"] = torch.tensor(coe_r, dtype=torch.float32)
    raw["coe_c"] = torch.tensor(coe_c, dtype=torch.float32)
    return raw


def load_features(path) -> tuple[dict[str, torch.Tensor], dict]:
    """A features file -> (tensors stacked over records, JSON metadata)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"features file not found: {path}")
    tensors, meta = probes.read_safetensors(path, "features")
    meta = probes.json_entry(meta, "pair_features", path)
    missing = [k for k in RAW_KEYS + ("label",) if k not in tensors]
    if not isinstance(meta, dict) or missing:
        raise probes.FormatError(f"{path}: not a features file written by "
                                 f"`python -m lab.study extract` "
                                 f"(missing {missing or 'metadata'})")
    if not isinstance(meta.get("episode_id", []), list):
        raise probes.FormatError(f"{path}: its metadata's episode_id must be a list (one per "
                                 "record)")
    n = {len(v) for v in tensors.values() if v.dim() > 0}
    if len(n) != 1 or len(meta.get("episode_id", ())) not in n:
        raise probes.FormatError(f"{path}: columns of different lengths (records {sorted(n)}, "
                                 f"episode ids {len(meta.get('episode_id', ()))})")
    if tensors["h_mean"].dim() != 2 or tensors["attn_max"].dim() != 3:
        raise probes.FormatError(f"{path}: h_mean must be (records, d) and attn_max "
                                 "(records, L, H)")
    probes.check_finite(tensors, path)
    labels = set(tensors["label"].unique().tolist())
    if not labels <= {0, 1}:
        raise probes.FormatError(f"{path}: labels must be 0 (wrong) or 1 (right), got "
                                 f"{sorted(labels)[:5]}")
    meta["dims"] = features_dims(tensors)     # what the tensors hold, whatever was recorded
    return tensors, meta


def features_dims(tensors: dict) -> dict:
    L, H = tensors["attn_max"].shape[1:]
    return {"d": int(tensors["h_mean"].shape[1]), "L": int(L), "H": int(H)}


@dataclass
class Split:
    """One features file: raw tensors stacked over records, labels and string columns."""
    name: str
    raw: dict
    y: torch.Tensor
    episode_id: list[str]
    meta: dict

    def keys(self) -> list[tuple[str, int]]:
        return list(zip(self.episode_id, self.raw["turn_idx"].tolist()))

    def take(self, idx) -> "Split":
        idx = torch.as_tensor(idx, dtype=torch.long)
        return Split(self.name, {k: v[idx] for k, v in self.raw.items()}, self.y[idx],
                     [self.episode_id[i] for i in idx.tolist()], self.meta)


def load_split(path, name=None) -> Split:
    raw, meta = load_features(path)
    return Split(name or Path(path).stem, raw, raw["label"].long(), list(meta["episode_id"]),
                 meta)


def load_splits(features_dir, names) -> dict[str, Split]:
    """The named features files of a directory (<name>.safetensors); absent ones are skipped."""
    features_dir = Path(features_dir)
    if not features_dir.is_dir():
        raise FileNotFoundError(f"features directory not found: {features_dir}")
    splits = {n: load_split(features_dir / f"{n}.safetensors", n) for n in names
              if (features_dir / f"{n}.safetensors").is_file()}
    path = {n: features_dir / f"{n}.safetensors" for n in splits}
    first, *rest = splits.values() if splits else [None]
    for split in rest:                  # all from one model, or the probes learn a mixture
        probes.check_same_source(probes.source(first.meta), path[first.name],
                                 probes.source(split.meta), path[split.name])
    return splits


def concat_splits(splits: list[Split]) -> Split:
    common = set.intersection(*(set(s.raw) for s in splits))
    raw = {k: torch.cat([s.raw[k] for s in splits]) for k in common}
    return Split("+".join(s.name for s in splits), raw, torch.cat([s.y for s in splits]),
                 sum((s.episode_id for s in splits), []), splits[0].meta)


def balanced_indices(y: torch.Tensor, seed: int) -> torch.Tensor:
    """A class-balanced subsample: every record of the minority class and as many of the
    majority class, drawn with `seed`."""
    g = torch.Generator().manual_seed(seed)
    pos, neg = (y == 1).nonzero().flatten(), (y == 0).nonzero().flatten()
    m = min(len(pos), len(neg))
    if m == 0:
        raise probes.FormatError("the training split holds a single class")
    pick = [c[torch.randperm(len(c), generator=g)[:m]] for c in (pos, neg)]
    return torch.cat(pick).sort().values


def training_set(splits: dict[str, Split], mode: str, seed: int) -> Split:
    """The seed's balanced subsample of matched_clean_train, plus (mixed) the same records of
    matched_contaminated_train: its evaluation turns are identical, only the prefix differs."""
    need = TRAIN_SPLITS[mode]
    missing = [n for n in need if n not in splits]
    if missing:
        raise FileNotFoundError(f"mode {mode!r} needs the features of {missing} "
                                f"(<name>.safetensors in the features directory)")
    clean = splits["matched_clean_train"]
    chosen = clean.take(balanced_indices(clean.y, seed))
    if mode == "clean_only":
        return chosen
    contam = splits["matched_contaminated_train"]
    row = {k: i for i, k in enumerate(contam.keys())}
    twins = [row[k] for k in chosen.keys() if k in row]
    if len(twins) < len(chosen.y):
        print(f"warning: {len(chosen.y) - len(twins)} records of the clean subsample have no "
              "matched_contaminated_train twin (failed extraction?)", file=sys.stderr)
    return concat_splits([chosen, contam.take(twins)])


def fit_baselines(train: Split, C=0.01, info=None) -> dict[str, probes.Probe]:
    """Every supervised baseline probe (METHOD.md §5) on one training set."""
    return {name: probes.Probe(info={"feature": name, **(info or {})})
            .fit(probes.feature(name, train.raw), train.y, C) for name in probes.FEATURES}


def predict(model, raw) -> torch.Tensor:
    """P(correct) of a Probe or a Pair."""
    if isinstance(model, pair.Pair):
        return model.scores(raw)[1]
    return model.predict_proba(probes.feature(model.info["feature"], raw))


# Unsupervised scores (no training): higher = more likely correct.
SCORES = ("neg_entropy", "coe_r", "coe_c")


def unsupervised_score(name: str, raw: dict[str, torch.Tensor]) -> torch.Tensor:
    """An unsupervised correctness score -> (N,) float64; higher = more likely correct."""
    if name == "neg_entropy":
        # a sharper attention (lower Renyi-2 entropy) reads as a more confident turn
        return -raw["attn_entropy"].double().flatten(1).mean(dim=1)
    if name in ("coe_r", "coe_c"):
        return raw[name].double()
    raise ValueError(f"unknown score {name!r}; expected one of {SCORES}")


def auprc(y, s) -> float:
    """Average precision: sum over distinct thresholds (descending) of (R_k - R_{k-1}) P_k, as
    scikit-learn's average_precision_score. NaN without positives."""
    y, s = probes.labels_scores(y, s)
    n_pos = y.sum()
    if n_pos == 0:
        return float("nan")
    values, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    pos = torch.zeros_like(values).index_add_(0, inverse, y)            # positives per value
    tp = pos.flip(0).cumsum(0)                                          # score >= threshold
    predicted = counts.flip(0).double().cumsum(0)
    precision, recall = tp / predicted, tp / n_pos
    delta_recall = torch.diff(recall, prepend=recall.new_zeros(1))
    return (delta_recall * precision).sum().item()


def ece(y, p, n_bins: int = 15) -> float:
    """Expected calibration error: bins (lo, hi] of equal width over P(correct), p = 0 in the
    first bin; sum_b (n_b / N) |mean label - mean p| over the bin."""
    y, p = probes.labels_scores(y, p)
    edges = torch.arange(n_bins + 1, dtype=torch.float64) / n_bins
    # searchsorted (left) gives i with edges[i-1] < p <= edges[i]: bin i-1
    bins = (torch.searchsorted(edges, p, right=False) - 1).clamp(0, n_bins - 1)
    sum_y = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bins, y)
    sum_p = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, bins, p)
    # (n_b / N) |mean_b y - mean_b p| = |sum_b y - sum_b p| / N
    return ((sum_y - sum_p).abs().sum() / p.numel()).item()


def brier(y, p) -> float:
    y, p = probes.labels_scores(y, p)
    return ((p - y) ** 2).mean().item()


def group_wins(y, s, groups) -> dict:
    """For each group holding a (correct, incorrect) pair of turns: (wins, pairs), wins the
    pairs where the correct turn scores higher (ties 1/2), in the order groups first appear."""
    y, s = probes.labels_scores(y, s)
    groups = list(groups)
    if len(groups) != y.numel():
        raise ValueError(f"{y.numel()} labels but {len(groups)} group ids")
    by_group: dict = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    out = {}
    for g, idx in by_group.items():
        idx = torch.tensor(idx)
        pos, neg = s[idx][y[idx] == 1], s[idx][y[idx] == 0]
        diff = pos[:, None] - neg[None, :]                              # (P, Q)
        if diff.numel():
            out[g] = ((diff > 0).sum().item() + 0.5 * (diff == 0).sum().item(), diff.numel())
    return out


def pairwise_accuracy(y, s, groups) -> float:
    """Within-episode ranking: over every (correct, incorrect) pair of turns of the same episode,
    the fraction where the correct turn scores higher (ties 1/2). NaN when there is no pair."""
    counts = group_wins(y, s, groups).values()
    pairs = sum(p for _, p in counts)
    return sum(w for w, _ in counts) / pairs if pairs else float("nan")


def accuracy(y, p, threshold: float = 0.5) -> float:
    y, p = probes.labels_scores(y, p)
    return ((p > threshold).double() == y).double().mean().item()


def metrics(y, p, groups=None, probability=True) -> dict[str, float]:
    """All metrics of METHOD.md §8 for one set of P(correct); an unsupervised score
    (probability=False: -entropy, CoE) has a ranking but no scale, and is reported by AUROC only."""
    if not probability:
        return {"auroc": probes.auroc(y, p)}
    out = {"auroc": probes.auroc(y, p), "auprc": auprc(y, p), "ece": ece(y, p),
           "brier": brier(y, p), "accuracy": accuracy(y, p)}
    if groups is not None:
        out["pairwise"] = pairwise_accuracy(y, p, groups)
    return out


def mean_std(values: list[float]) -> dict:
    """Mean and sample std (ddof 1) over seeds, ignoring NaN (a metric undefined on a split)."""
    v = [x for x in values if x == x]
    if not v:
        return {"mean": None, "std": None, "values": values}
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return {"mean": m, "std": s, "values": values}
