"""The paper's tables (a)-(e) from the features of the matched splits (METHOD.md §8), what
`python -m lab.study report` computes and writes as Markdown and JSON; the helpers that format a
mean ± std and a Markdown table are also `eval`'s.

Contamination analyses. (b) is also measured on the matched pairs whose two model inputs
differ (by an input digest recorded at extraction): in the released GTA test splits 104 of 177
pairs are the same dialog twice, which can only dilute a drop. There, per method: AUROC clean and
contaminated, the drop with a paired bootstrap 95% interval (1,000 resamples of the pairs, seed
0), and how far the evaluation turn's logit moved between its two prefixes (report.json
`drop_differing`). (c) buckets matched_contaminated_test by contamination distance
(lab/probing/features.py says how it is counted). (e) reads matched_diagnostic_test (shop: `python -m lab.shop make-data`;
GTA: `python -m lab.data make-diagnostic gta`), overall and per rule of its negatives
(report.json `diagnostic`).
"""
from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import torch

import pair
import probes
from lab.probing.detection import (DIAGNOSTIC_SPLIT, SCORES, SEEDS, TEST_SPLITS, TRAIN_SPLITS, Split,
                           concat_splits, fit_baselines, load_splits, mean_std, metrics, predict,
                           training_set, unsupervised_score)


DISTANCE_BUCKETS = ("1", "2", "3", "4", "5", "6", "7+")


METHODS = {   # name -> (label in the tables, P(correct)?)
    "last_token": ("Last-token", True), "mean_pooled": ("Mean-Pooled", True),
    "multi_layer": ("Multi-layer", True), "attention": ("Attention", True),
    "hidden_attn": ("Hidden + Attn", True), "multi_attn": ("Multi-Attn", True),
    "lookback": ("Lookback Lens", True), "head_entropy": ("Head Entropy", True),
    "neg_entropy": ("-Entropy (unsup.)", False), "coe_r": ("CoE-R (unsup.)", False),
    "coe_c": ("CoE-C (unsup.)", False), "pair": ("PAIR", True),
    "pair_clean_only": ("PAIR (clean_only)", True),
}


# Paper Table result_pair (Qwen2.5-7B-Instruct): AUROC, its std, ECE, its std (None: not given).
PAPER_DETECTION = {
    "gta": {"last_token": (0.8967, 0.012, 0.1294, 0.018),
            "mean_pooled": (0.8851, 0.014, 0.1521, 0.020),
            "multi_layer": (0.9082, 0.010, 0.1342, 0.017),
            "attention": (0.8709, 0.015, 0.0954, 0.014),
            "hidden_attn": (0.8978, 0.013, 0.1378, 0.018),
            "multi_attn": (0.9034, 0.011, 0.1356, 0.018),
            "lookback": (0.8745, 0.014, 0.1182, 0.015),
            "head_entropy": (0.8821, 0.013, 0.1432, 0.019),
            "coe_c": (0.7491, 0.022, None, None),
            "pair": (0.9217, 0.009, 0.1198, 0.014)},
    "toolbench": {"last_token": (0.7654, 0.008, 0.2562, 0.014),
                  "mean_pooled": (0.7372, 0.009, 0.2871, 0.016),
                  "multi_layer": (0.7821, 0.007, 0.2476, 0.013),
                  "attention": (0.6847, 0.011, 0.1998, 0.011),
                  "hidden_attn": (0.7598, 0.008, 0.2683, 0.015),
                  "multi_attn": (0.7765, 0.007, 0.1961, 0.011),
                  "lookback": (0.7295, 0.010, 0.1685, 0.010),
                  "head_entropy": (0.7561, 0.009, 0.2329, 0.013),
                  "coe_c": (0.5953, 0.013, None, None),
                  "pair": (0.8129, 0.006, 0.2236, 0.012)},
}


HIDDEN_PROBES = ("last_token", "mean_pooled", "multi_layer")


ATTENTION_PROBES = ("attention", "multi_attn", "lookback", "head_entropy")


BOOTSTRAP_DRAWS, BOOTSTRAP_SEED = 1000, 0


def differing_pairs(clean: Split, contaminated: Split) -> tuple[list[int], list[int]] | None:
    """Rows (in clean, in contaminated) of the matched pairs whose model inputs differ; None
    when the features carry no input digests. In the released GTA test splits 104 of 177 pairs
    are the same dialog twice (no earlier turn was contaminated): they can only dilute a drop."""
    if "input_digest" not in clean.raw or "input_digest" not in contaminated.raw:
        return None
    row = {k: j for j, k in enumerate(contaminated.keys())}
    a, b = [], []
    for i, k in enumerate(clean.keys()):
        j = row.get(k)
        if j is not None and not torch.equal(clean.raw["input_digest"][i],
                                             contaminated.raw["input_digest"][j]):
            a.append(i)
            b.append(j)
    return a, b


def paired_bootstrap_drop(y_a, s_a: list, y_b, s_b: list, draws=BOOTSTRAP_DRAWS,
                          seed=BOOTSTRAP_SEED) -> dict:
    """AUROC(a) - AUROC(b) on n pairs (row i of a and of b are one pair), averaged over the
    probe seeds (s_a, s_b: one (n,) score tensor per seed), and its 95% percentile interval
    from `draws` resamples of the pairs with replacement. A given seed draws the same pairs for
    every method. Draws whose resample holds one class (AUROC undefined) are dropped and
    counted."""
    y_a, y_b = torch.as_tensor(y_a), torch.as_tensor(y_b)
    n = len(y_a)

    def drop(idx):
        d = [probes.auroc(y_a[idx], a[idx]) - probes.auroc(y_b[idx], b[idx])
             for a, b in zip(s_a, s_b)]
        d = [x for x in d if x == x]
        return sum(d) / len(d) if d else float("nan")

    point = drop(torch.arange(n))
    if point != point:
        return {"drop": None, "ci95": None, "draws": 0, "undefined_draws": draws}
    g = torch.Generator().manual_seed(seed)
    boot = [drop(torch.randint(n, (n,), generator=g)) for _ in range(draws)]
    kept = torch.tensor([x for x in boot if x == x], dtype=torch.float64)
    lo, hi = torch.quantile(kept, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"drop": point, "ci95": [lo, hi], "draws": len(kept),
            "undefined_draws": draws - len(kept)}


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.double().clamp(1e-12, 1 - 1e-12)
    return (p / (1 - p)).log()


def drop_on_differing(clean: Split, contaminated: Split, scores: dict, probability: dict,
                      draws=BOOTSTRAP_DRAWS, seed=BOOTSTRAP_SEED) -> dict:
    """METHOD.md §8b on the pairs whose prefixes differ: per method AUROC clean and contaminated,
    the drop with its paired bootstrap interval, and how far the evaluation turn's score moved
    between its two prefixes: mean |logit(p_clean) - logit(p_contaminated)| over the pairs, also
    divided by the std of that probe's logits over both test splits (a probe with larger
    weights moves more in raw logits). scores[method][split]: one (N,) tensor per seed."""
    pairs = differing_pairs(clean, contaminated)
    if pairs is None:
        return {"skipped": "the features carry no input digests (extracted before they were "
                           "recorded): extract them again"}
    a, b = pairs
    out = {"n_pairs": len(a), "n_pairs_all": len(clean.y), "positives": int(clean.y[a].sum()),
           "draws": draws, "seed": seed, "methods": {}}
    if not a:
        return {**out, "skipped": "no pair differs"}
    y_a, y_b = clean.y[a], contaminated.y[b]
    for method, per_split in scores.items():
        s_a = [s[a] for s in per_split["matched_clean_test"]]
        s_b = [s[b] for s in per_split["matched_contaminated_test"]]
        row = {"clean": mean_std([probes.auroc(y_a, s) for s in s_a]),
               "contaminated": mean_std([probes.auroc(y_b, s) for s in s_b]),
               **paired_bootstrap_drop(y_a, s_a, y_b, s_b, draws, seed)}
        if probability[method]:
            moved, rel = [], []
            for sa, sb, whole_a, whole_b in zip(s_a, s_b, per_split["matched_clean_test"],
                                                per_split["matched_contaminated_test"]):
                d = (_logit(sa) - _logit(sb)).abs().mean().item()
                spread = torch.cat([_logit(whole_a), _logit(whole_b)]).std().item()
                moved.append(d)
                rel.append(d / spread if spread > 0 else float("nan"))
            row["mean_abs_dlogit"], row["rel_abs_dlogit"] = mean_std(moved), mean_std(rel)
        out["methods"][method] = row
    groups = {"hidden": HIDDEN_PROBES, "attention": ATTENTION_PROBES}
    out["groups"] = {}
    for group, names in groups.items():
        rows = [out["methods"][m] for m in names if "mean_abs_dlogit" in out["methods"].get(m, {})]
        if rows:
            out["groups"][group] = {
                "probes": [m for m in names if m in out["methods"]],
                "mean_abs_dlogit": sum(r["mean_abs_dlogit"]["mean"] for r in rows) / len(rows),
                "rel_abs_dlogit": sum(r["rel_abs_dlogit"]["mean"] for r in rows) / len(rows)}
    return out


def diagnostic_summary(split: Split, scores: dict) -> dict:
    """Table (e): AUROC on the adversarial set, overall and per rule of its negatives (each
    rule's negatives against every positive)."""
    rules = split.meta.get("diagnostic_rule") or [None] * len(split.y)
    neg_rules = sorted({r for r, y in zip(rules, split.y.tolist()) if y == 0 and r})
    out = {"n": len(split.y), "positives": int(split.y.sum()),
           "by_rule_n": {r: rules.count(r) for r in sorted(set(filter(None, rules)))},
           "methods": {}}
    pos = [i for i, y in enumerate(split.y.tolist()) if y == 1]
    for method, per_split in scores.items():
        seeds = per_split[DIAGNOSTIC_SPLIT]
        row = {"auroc": mean_std([probes.auroc(split.y, s) for s in seeds]), "by_rule": {}}
        for rule in neg_rules:
            idx = pos + [i for i, r in enumerate(rules) if r == rule]
            row["by_rule"][rule] = mean_std([probes.auroc(split.y[idx], s[idx]) for s in seeds])
        out["methods"][method] = row
    return out


def stat_subsets() -> list[tuple[str, ...]]:
    """The 15 non-empty subsets of the four attention statistics, smallest first."""
    return [c for k in range(1, 5) for c in itertools.combinations(probes.ATTN_STATS, k)]


def distance_bucket(d: int) -> str | None:
    return None if d < 1 else ("7+" if d >= 7 else str(d))


def run_report(features_dir, mode="mixed", seeds=SEEDS, C=0.01, crossfit=0, log=None):
    """Everything of METHOD.md §8 (a)-(e) from the features of the matched splits, as JSON."""
    log = log or sys.stderr
    names = TRAIN_SPLITS["mixed"] + TEST_SPLITS + (DIAGNOSTIC_SPLIT,)
    splits = load_splits(features_dir, names)
    missing = [n for n in TEST_SPLITS + TRAIN_SPLITS[mode] if n not in splits]
    if missing:
        raise FileNotFoundError(f"{features_dir}: missing features of {missing} "
                                "(name them <data file stem>.safetensors)")
    tests = {n: splits[n] for n in TEST_SPLITS + (DIAGNOSTIC_SPLIT,) if n in splits}
    tests["all_test"] = concat_splits([splits[n] for n in TEST_SPLITS])
    # per-seed values: detection[method][split][metric] -> list over seeds
    detection, distance, ablation = {}, {}, {}
    kept, probability_of = {}, {}   # method -> split -> [(N,) scores per seed]; P(correct)?
    n_train, fit_seconds = {}, []
    t0 = time.perf_counter()

    def add(table, keys, value):
        node = table
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node.setdefault(keys[-1], []).append(value)

    def score_all(method, scorer, probability):
        for split_name, split in tests.items():
            p = scorer(split.raw)
            kept.setdefault(method, {}).setdefault(split_name, []).append(p)
            probability_of[method] = probability
            scores = metrics(split.y, p, split.episode_id, probability)
            for metric, value in scores.items():
                add(detection, (method, split_name, metric), value)
            if split_name == "matched_contaminated_test":
                buckets = [distance_bucket(d) for d in split.raw["distance"].tolist()]
                for b in DISTANCE_BUCKETS:
                    idx = [i for i, x in enumerate(buckets) if x == b]
                    if idx:
                        m = metrics(split.y[idx], p[idx], None, probability)
                        for metric in ("accuracy", "auroc"):
                            if metric in m:
                                add(distance, (method, b, metric), m[metric])
                        distance.setdefault("_n", {})[b] = len(idx)

    for seed in seeds:
        t = time.perf_counter()
        train = training_set(splits, mode, seed)
        n_train[seed] = {"n": len(train.y), "positives": int(train.y.sum())}
        info = {"seed": seed, "C": C, "mode": mode}
        models = fit_baselines(train, C, info)
        # (d) PAIR's stage 2 on every subset of the four statistics (stage 1 shared); the full
        # set is PAIR itself
        stage1, s_bc = pair.fit_stage1(train.raw, train.y, C, crossfit, train.episode_id, seed,
                                       stage1=models["last_token"])
        for subset in stat_subsets():
            model = pair.fit_stage2(stage1, s_bc, train.raw, train.y, C, subset, info)
            for split_name in TEST_SPLITS + ("all_test",):
                split = tests[split_name]
                add(ablation, ("+".join(subset), split_name),
                    probes.auroc(split.y, model.scores(split.raw)[1]))
        models["pair"] = model
        clean = training_set(splits, "clean_only", seed)
        models["pair_clean_only"] = pair.fit_pair(
            clean.raw, clean.y, C, crossfit, clean.episode_id, seed,
            info={**info, "mode": "clean_only"},
            stage1=models["last_token"] if mode == "clean_only" else None)
        fit_seconds.append(time.perf_counter() - t)
        for name, model in models.items():
            score_all(name, lambda raw, m=model: predict(m, raw), True)
        print(f"  seed {seed}: {len(models)} models + 15 ablations fitted "
              f"({time.perf_counter() - t:.1f}s)", file=log)
    for name in SCORES:           # unsupervised: no training, one value per split
        score_all(name, lambda raw, n=name: unsupervised_score(n, raw), False)

    def summarize(node):
        if isinstance(node, list):
            return mean_std(node)
        return {k: (v if k == "_n" else summarize(v)) for k, v in node.items()}

    t_drop = time.perf_counter()
    drop_differing = drop_on_differing(splits["matched_clean_test"],
                                       splits["matched_contaminated_test"], kept, probability_of)
    drop_differing["seconds"] = time.perf_counter() - t_drop
    diagnostic = (diagnostic_summary(tests[DIAGNOSTIC_SPLIT], kept)
                  if DIAGNOSTIC_SPLIT in tests else None)
    meta = splits["matched_clean_test"].meta
    return {
        "features_dir": str(features_dir), "mode": mode, "seeds": list(seeds), "C": C,
        "crossfit": crossfit, "model": meta.get("model"), "dtype": meta.get("dtype"),
        "data": {n: s.meta.get("data") for n, s in splits.items()},
        "n_records": {n: len(s.y) for n, s in tests.items()},
        "positives": {n: int(s.y.sum()) for n, s in tests.items()},
        "n_train": n_train, "fit_seconds_per_seed": fit_seconds,
        "seconds": time.perf_counter() - t0,
        "detection": summarize(detection), "distance": summarize(distance),
        "ablation": summarize(ablation), "drop_differing": drop_differing,
        "diagnostic": diagnostic,
    }


def guess_paper_ref(result: dict) -> str | None:
    """The paper's dataset whose name is a path component of the data or features paths."""
    paths = [str(v) for v in result["data"].values()] + [result["features_dir"]]
    parts = {part.lower() for path in paths for part in Path(path).parts}
    return next((name for name in PAPER_DETECTION if name in parts), None)


def ms_cell(node, digits=3) -> str:
    """A mean_std node as a table cell, "mean ± std"; — where it is undefined."""
    if not node or node.get("mean") is None:
        return "—"
    return f"{node['mean']:.{digits}f} ± {node['std']:.{digits}f}"


def nested(result, *keys):
    """result[k1][k2]...; None where a key is missing."""
    node = result
    for k in keys:
        node = node.get(k) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def render_markdown(result: dict, paper_ref: str | None) -> str:
    det = result["detection"]
    methods = [m for m in METHODS if m in det]
    k = result["crossfit"]
    stage2_input = f"out-of-fold (K={k})" if k > 1 else "in-sample"
    lines = [f"# PAIR detection report — {result['features_dir']}", "",
             f"Model `{result['model']}` ({result['dtype']}); train mode `{result['mode']}` "
             f"(PAIR (clean_only) is trained on matched_clean_train alone); C = {result['C']}; "
             f"stage 2 on {stage2_input} s_bc; seeds {', '.join(map(str, result['seeds']))} "
             f"(each a class-balanced "
             f"subsample: {', '.join(str(v['n']) for v in result['n_train'].values())} "
             f"training records). Mean ± sample std over seeds; unsupervised scores need no "
             f"training (std 0) and have no calibration (—).", "",
             "Test records: " + ", ".join(f"{n} {result['n_records'][n]} "
                                          f"({result['positives'][n]} correct)"
                                          for n in result["n_records"]), ""]
    # (a)
    header = ["Method", "AUROC clean", "AUROC contaminated", "AUROC both", "ECE clean",
              "ECE contaminated", "ECE both"]
    if paper_ref:
        header += [f"paper AUROC ({paper_ref}, 7B)", f"paper ECE ({paper_ref}, 7B)"]
    rows = []
    for m in methods:
        row = [METHODS[m][0]]
        row += [ms_cell(nested(det, m, s, "auroc")) for s in TEST_SPLITS + ("all_test",)]
        row += [ms_cell(nested(det, m, s, "ece")) for s in TEST_SPLITS + ("all_test",)]
        if paper_ref:
            ref = PAPER_DETECTION[paper_ref].get(m)
            row += ["—" if ref is None else f"{ref[0]:.4f} ± {ref[1]:.3f}",
                    "—" if ref is None or ref[2] is None else f"{ref[2]:.4f} ± {ref[3]:.3f}"]
        rows.append(row)
    lines += ["## (a) Detection (paper Table result_pair)", ""] + md_table(header, rows)
    if paper_ref:
        lines += ["", f"The paper's numbers are for Qwen2.5-7B-Instruct on {paper_ref}; the "
                  "paper does not say which test split they pool, so they sit beside each of "
                  "ours. Its Hidden + Attn concatenates the multi-layer hidden state; ours is "
                  "[last_token; attention] (METHOD.md §4)."]
    header = ["Method"] + [f"{metric} {s}" for metric in ("AUPRC", "Brier", "pairwise")
                           for s in ("clean", "contaminated")]
    rows = [[METHODS[m][0]] + [ms_cell(nested(det, m, s, k)) for k in ("auprc", "brier", "pairwise")
                               for s in TEST_SPLITS] for m in methods if METHODS[m][1]]
    lines += ["", "Other metrics (pairwise = within-episode ranking accuracy):", ""]
    lines += md_table(header, rows)
    # (b)
    rows = []
    for m in methods:
        a = nested(det, m, "matched_clean_test", "auroc")
        b = nested(det, m, "matched_contaminated_test", "auroc")
        if a and b and a["mean"] is not None and b["mean"] is not None:
            drop = a["mean"] - b["mean"]
            relative = f"{100 * drop / a['mean']:+.1f}%" if a["mean"] else "n/a"   # AUROC 0
            rows.append([METHODS[m][0], f"{a['mean']:.3f}", f"{b['mean']:.3f}", f"{drop:+.3f}",
                         relative])
    lines += ["", "## (b) AUROC drop clean → contaminated prefix", "",
              "Whole splits (every record, including pairs whose two dialogs are identical):",
              ""]
    lines += md_table(["Method", "clean", "contaminated", "drop", "relative"], rows)
    lines += _render_differing(result, methods)
    # (c)
    dist = result["distance"]
    counts = dist.get("_n", {})
    buckets = [b for b in DISTANCE_BUCKETS if b in counts]
    lines += ["", "## (c) Distance sensitivity (matched_contaminated_test)", "",
              "d = assistant turns from the nearest earlier contaminated turn to the evaluation "
              "turn; accuracy at threshold 0.5 (AUROC for unsupervised scores; — where a bucket "
              "holds one class).", ""]
    if buckets:
        header = ["Method"] + [f"d={b} (n={counts[b]})" for b in buckets]
        rows = []
        for m in methods:
            metric = "accuracy" if METHODS[m][1] else "auroc"
            rows.append([METHODS[m][0] + ("" if METHODS[m][1] else " [AUROC]")]
                        + [ms_cell(nested(dist, m, b, metric)) for b in buckets])
        lines += md_table(header, rows)
    else:
        lines += ["No record of matched_contaminated_test has an earlier contaminated turn."]
    # (d)
    abl = result["ablation"]
    rows = [[k.replace("+", " + ")]
            + [ms_cell(nested(abl, k, s)) for s in TEST_SPLITS + ("all_test",)] for k in abl]
    lines += ["", "## (d) Ablation: attention statistics in PAIR's stage 2 (AUROC)", ""]
    lines += md_table(["Statistics", "clean", "contaminated", "both"], rows)
    # (e)
    lines += ["", "## (e) Adversarial diagnostic set", ""]
    diag = result.get("diagnostic")
    if DIAGNOSTIC_SPLIT in result["n_records"] and diag:
        rules = [r for r in diag["by_rule_n"] if diag["by_rule_n"][r] and any(
            r in row["by_rule"] for row in diag["methods"].values())]
        lines += [f"{diag['n']} records ({diag['positives']} correct): consistent-but-incorrect "
                  "turns after a clean prefix (label 0) vs correct turns after a contaminated "
                  "prefix (label 1)" + ("; records per rule: " + ", ".join(
                      f"{r} {n}" for r, n in diag["by_rule_n"].items()) if diag["by_rule_n"]
                      else "") + ". AUROC below 0.5 = "
                  "the probe ranks the fluent wrong turn above the right turn after errors: it "
                  "tracks belief-consistency. Per rule: that rule's negatives against every "
                  "positive.", ""]
        lines += md_table(["Method", "AUROC"] + [f"vs {r}" for r in rules],
                          [[METHODS[m][0], ms_cell(diag["methods"][m]["auroc"])]
                           + [ms_cell(diag["methods"][m]["by_rule"].get(r)) for r in rules]
                           for m in methods if m in diag["methods"]])
    else:
        lines += [f"No {DIAGNOSTIC_SPLIT}.safetensors in the features directory."]
    return "\n".join(lines) + "\n"


def _render_differing(result: dict, methods: list[str]) -> list[str]:
    dd = result.get("drop_differing") or {}
    lines = ["", "On the pairs whose two dialogs differ (an earlier turn was contaminated):", ""]
    if "skipped" in dd:
        return lines + [f"Not computed: {dd['skipped']}."]
    lines += [f"{dd['n_pairs']} of {dd['n_pairs_all']} pairs differ ({dd['positives']} with a "
              f"correct evaluation turn). Drop = AUROC clean − AUROC contaminated on those "
              f"pairs, mean over seeds; 95% interval from a paired bootstrap ({dd['draws']} "
              f"resamples of the pairs, seed {dd['seed']}). |Δ logit| = mean over the pairs of "
              "how far the evaluation turn's logit moved between its clean and its "
              "contaminated prefix; relative = divided by the std of that probe's logits over "
              "both test splits.", ""]
    rows = []
    for m in methods:
        row = dd["methods"].get(m)
        if row is None:
            continue
        ci = row.get("ci95")
        rows.append([METHODS[m][0], ms_cell(row["clean"]), ms_cell(row["contaminated"]),
                     "undefined (one class)" if row["drop"] is None else
                     f"{row['drop']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]",
                     ms_cell(row.get("mean_abs_dlogit")), ms_cell(row.get("rel_abs_dlogit"))])
    lines += md_table(["Method", "clean", "contaminated", "drop [95% CI]", "|Δ logit|",
                       "relative |Δ logit|"], rows)
    for group, g in dd.get("groups", {}).items():
        lines.append(f"\nMean over the {group} probes ({', '.join(g['probes'])}): |Δ logit| "
                     f"{g['mean_abs_dlogit']:.3f}, relative {g['rel_abs_dlogit']:.3f}.")
    return lines


def md_table(header, rows) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def json_clean(node):
    """NaN -> None so the JSON is standard."""
    if isinstance(node, dict):
        return {str(k): json_clean(v) for k, v in node.items()}
    if isinstance(node, list):
        return [json_clean(v) for v in node]
    if isinstance(node, float) and node != node:
        return None
    return node
