"""The contamination analyses: (b) on the matched pairs whose dialogs differ, its paired
bootstrap, the GTA diagnostic set built from the released data, the by-episode split of released
test files, and (opt-in, real 0.5B checkpoint) every extracted feature against transformers."""
import json
import math
import random
from pathlib import Path

import pytest
import torch

import envs
import model as M
import probes
from lab.probing import detection, features, report
from lab.worlds import released

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------
# (b) on the pairs that differ

TOOLS = [{"name": "OCR", "description": "reads text", "inputs": [{"name": "image",
                                                                  "type": "image"}]}]


def call(thought, image):
    return {"role": "assistant", "thought": thought,
            "tool_calls": [{"function": {"name": "OCR", "arguments": {"image": image}}}]}


def obs(text):
    return {"role": "tool", "name": "OCR", "content": {"type": "text", "content": text}}


def matched(eid, dialog, label, contaminated_prefix, prefix_type):
    return {"episode_id": eid, "turn_idx": len(dialog) - 1, "label": label,
            "contamination_type": None, "has_contaminated_prefix": contaminated_prefix,
            "original_contaminated_turn_indices": [1] if contaminated_prefix else [],
            "prefix_type": prefix_type, "dialogs": dialog, "tools": TOOLS, "files": []}


def hand_made_pairs():
    """Four matched pairs: a and c identical twice, b with a contaminated call, d with a
    contaminated thought only."""
    task = {"role": "user", "content": "What does the sign say?"}
    final = {"role": "assistant", "content": "STOP"}
    gold = [task, call("Read it.", "a.jpg"), obs("STOP")]
    clean, contaminated = [], []
    for eid, wrong, label in (("a", None, 1), ("b", call("Read it.", "b.jpg"), 1),
                              ("c", None, 0), ("d", call("Guess it.", "a.jpg"), 0)):
        bad = gold if wrong is None else [task, wrong, obs("STOP")]
        clean.append(matched(eid, gold + [final], label, wrong is not None, "clean"))
        contaminated.append(matched(eid, bad + [final], label, wrong is not None,
                                    "contaminated"))
    return clean, contaminated


def split_of(records, tokenizer, name, order):
    """A detection.Split holding only what the filter reads: keys, labels and input digests."""
    records = [records[i] for i in order]
    digests = []
    for r in records:
        ids, span, _ = features.render_record(r, tokenizer)
        digests.append(features.input_digest(ids, span))
    raw = {"input_digest": torch.stack(digests),
           "turn_idx": torch.tensor([r["turn_idx"] for r in records])}
    return detection.Split(name, raw, torch.tensor([r["label"] for r in records]),
                           [r["episode_id"] for r in records], {})


def test_differing_pairs_on_a_hand_made_matched_set():
    tokenizer = M.Tokenizer.from_file(ROOT / "data" / "shop-policy" / "tokenizer.json")
    clean, contaminated = hand_made_pairs()
    a = split_of(clean, tokenizer, "matched_clean_test", [0, 1, 2, 3])
    b = split_of(contaminated, tokenizer, "matched_contaminated_test", [3, 2, 1, 0])
    rows_a, rows_b = report.differing_pairs(a, b)
    # b and d differ (d only in a thought); paired by (episode, turn), not by row order
    assert [a.episode_id[i] for i in rows_a] == ["b", "d"]
    assert [b.episode_id[j] for j in rows_b] == ["b", "d"]
    # the released flag says the same on these records
    assert [r["episode_id"] for r in clean if r["has_contaminated_prefix"]] == ["b", "d"]
    # features without digests cannot be filtered: reported, not guessed
    del a.raw["input_digest"]
    assert report.differing_pairs(a, b) is None


def normal_scores(n, sigma, g):
    """Scores y + N(0, sigma^2): AUROC = Phi(1 / (sigma sqrt 2))."""
    y = (torch.rand(n, generator=g) < 0.5).long()
    return y, y + sigma * torch.randn(n, generator=g)


def true_auroc(sigma):
    return 0.5 * (1 + math.erf(1 / (sigma * math.sqrt(2)) / math.sqrt(2)))


def test_paired_bootstrap_is_reproducible_and_covers_the_true_drop():
    g = torch.Generator().manual_seed(0)
    y, s_clean = normal_scores(300, 0.8, g)
    s_cont = y + 1.6 * torch.randn(300, generator=g)
    one = report.paired_bootstrap_drop(y, [s_clean], y, [s_cont])
    assert one == report.paired_bootstrap_drop(y, [s_clean], y, [s_cont])      # seeded
    other = report.paired_bootstrap_drop(y, [s_clean], y, [s_cont], seed=1)
    assert other["drop"] == one["drop"] and other["ci95"] != one["ci95"]
    assert one["draws"] == 1000
    truth = true_auroc(0.8) - true_auroc(1.6)                            # ~0.20
    assert one["ci95"][0] < truth < one["ci95"][1]
    assert one["ci95"][0] > 0                                           # a real drop is seen
    # identical scores on both sides: drop 0 and a zero-width interval (pairs stay paired)
    same = report.paired_bootstrap_drop(y, [s_clean], y, [s_clean.clone()])
    assert same["drop"] == 0 and same["ci95"] == [0, 0]
    # coverage over fresh data sets: a 95% interval misses rarely
    covered = 0
    for k in range(20):
        y, s_clean = normal_scores(200, 0.8, g)
        s_cont = y + 1.6 * torch.randn(200, generator=g)
        ci = report.paired_bootstrap_drop(y, [s_clean], y, [s_cont], draws=300, seed=k)["ci95"]
        covered += ci[0] < truth < ci[1]
    assert covered >= 16, covered
    # one class on a side: the drop is undefined, not a number
    assert report.paired_bootstrap_drop(torch.ones(5), [torch.rand(5)], torch.ones(5),
                                        [torch.rand(5)])["drop"] is None


def test_report_measures_the_differing_pairs(tmp_path):
    from test_pair import synthetic_split
    for name, episodes, seed in (("train", 40, 1), ("test", 30, 2)):
        for kind in ("clean", "contaminated"):
            path = tmp_path / f"matched_{kind}_{name}.safetensors"
            synthetic_split(path, episodes, seed, kind == "contaminated", path.stem)
            raw, meta = detection.load_features(path)
            # pairs 0, 3, 6, ... are the same input twice; the others differ
            n = len(raw["label"])
            digest = torch.zeros(n, 32, dtype=torch.uint8)
            digest[:, 0] = torch.arange(n) % 251
            if kind == "contaminated":
                digest[torch.arange(n) % 3 != 0, 1] = 1
            raw["input_digest"] = digest
            probes.save_safetensors(raw, path, {"pair_features": json.dumps(meta)})
    result = report.run_report(tmp_path, seeds=(42,))
    dd = result["drop_differing"]
    assert dd["n_pairs"] == 40 and dd["n_pairs_all"] == 60
    # synthetic: the hidden state flips on a contaminated prefix, attention does not
    last, attention = dd["methods"]["last_token"], dd["methods"]["multi_attn"]
    assert last["drop"] > 0.3 and last["ci95"][0] > 0
    assert last["rel_abs_dlogit"]["mean"] > 3 * attention["rel_abs_dlogit"]["mean"]
    assert dd["groups"]["hidden"]["rel_abs_dlogit"] > dd["groups"]["attention"]["rel_abs_dlogit"]
    text = report.render_markdown(result, None)
    assert "drop [95% CI]" in text and "40 of 60 pairs differ" in text


# ----------------------------------------------------------------------------------------------
# The GTA diagnostic set from the released data

def test_diagnostic_rules_on_a_hand_made_episode():
    record = {"dialogs": [
        {"role": "user", "content": "How much do 3 tickets cost?"},
        call("Read the price list.", "p.jpg"), obs("(1, 2, 30, 40) Adult 12.5 Child 7 Parking 4"),
        {"role": "assistant", "thought": "An adult ticket is 12.5, so 3 cost 12.5 * 3.",
         "tool_calls": [{"function": {"name": "Calculator",
                                      "arguments": {"expression": "12.5 * 3"}}}]},
        {"role": "tool", "name": "Calculator", "content": "37.5"},
        {"role": "assistant", "content": "37.5"}], "gt_answer": {"whitelist": [["37.5"]]}}
    dialog = record["dialogs"]
    assert released.repeat_previous_call(dialog, 3) == dialog[1]
    assert released.repeat_previous_call(dialog, 5) == dialog[3]
    assert released.repeat_previous_call(dialog, 1) is None               # no earlier call
    turn = released.unused_observation_number(record, 3, random.Random(0))
    # 12.5 is copied from the observation; the unused values are 7 and 4 (never the box
    # coordinates 1, 2, 30, 40, and never 3 or 37.5, which the gold turns use)
    expression = turn["tool_calls"][0]["function"]["arguments"]["expression"]
    assert expression in ("7 * 3", "4 * 3")
    assert turn["thought"] == f"An adult ticket is {expression[0]}, so 3 cost {expression}."
    assert released.unused_observation_number(record, 1, random.Random(0)) is None


def test_gta_diagnostic_set_from_the_release(release_dir, tmp_path):
    counts = released.make_gta_diagnostic(release_dir, tmp_path, seed=0)
    first = (tmp_path / "matched_diagnostic_test.json").read_bytes()
    released.make_gta_diagnostic(release_dir, tmp_path, seed=0)
    assert (tmp_path / "matched_diagnostic_test.json").read_bytes() == first     # deterministic
    records = released.load_matched(tmp_path / "matched_diagnostic_test.json")        # the schema
    assert counts["records"] == len(records)
    gold = envs.load_episodes(release_dir / "gta" / "clean_test.json")
    negatives = [r for r in records if r["label"] == 0]
    positives = [r for r in records if r["label"] == 1]
    assert {r["diagnostic_rule"] for r in negatives} == set(released.DIAGNOSTIC_RULES)
    for r in negatives:
        dialog, t = gold[r["episode_id"]]["dialogs"], r["turn_idx"]
        assert r["diagnostic"] == "consistent_incorrect" and not r["has_contaminated_prefix"]
        assert r["dialogs"][:t] == dialog[:t]                             # a clean prefix
        assert r["dialogs"][t] != dialog[t]                               # never the gold turn
        assert released._tool_call(r["dialogs"][t]) != released._tool_call(dialog[t])
    given = json.loads((release_dir / "gta" / "matched_contaminated_test.json").read_text())
    expected = [r for r in given if r["has_contaminated_prefix"] and r["label"] == 1]
    assert len(positives) == len(expected) == 57
    for r in positives:
        dialog, t = gold[r["episode_id"]]["dialogs"], r["turn_idx"]
        assert r["diagnostic"] == "inconsistent_correct" and r["has_contaminated_prefix"]
        assert r["dialogs"][t] == dialog[t]                               # the gold turn
        assert r["dialogs"][:t] != dialog[:t]                             # after contamination
        assert any(i < t for i in r["original_contaminated_turn_indices"])


def test_split_episodes_of_released_test_files(release_dir, tmp_path):
    counts = released.split_episodes(release_dir, "toolbench", tmp_path, seed=0, episodes=12)
    again = released.split_episodes(release_dir, "toolbench", tmp_path / "again", seed=0,
                                    episodes=12)
    assert counts == again
    halves = {}
    for split in ("train", "test"):
        episodes = envs.load_episodes(tmp_path / f"clean_{split}.json")
        halves[split] = set(episodes)
        for kind in ("clean", "contaminated"):
            records = released.load_matched(tmp_path / f"matched_{kind}_{split}.json")
            assert {r["episode_id"] for r in records} <= halves[split]
    assert len(halves["train"]) == len(halves["test"]) == 6
    assert not halves["train"] & halves["test"]
    given = json.loads((release_dir / "toolbench" / "matched_clean_test.json").read_text())
    chosen = halves["train"] | halves["test"]
    assert counts["matched_clean_train.json"] + counts["matched_clean_test.json"] == \
        sum(r["episode_id"] in chosen for r in given)


# ----------------------------------------------------------------------------------------------
# Opt-in: the real 0.5B checkpoint, every extracted feature against transformers (float32)

def test_extracted_features_equal_transformers_on_gta(qwen05b_dir, release_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    from test_model import reference_stats
    folder = release_dir / "gta"
    given = json.loads((folder / "matched_clean_test.json").read_text())
    # the three shortest records: float32 eager attention of 24 layers stays small
    chosen = sorted(given, key=lambda r: len(json.dumps(r["dialogs"])))[:3]
    (tmp_path / "matched_clean_test.json").write_text(json.dumps(chosen))
    (tmp_path / "clean_test.json").write_text((folder / "clean_test.json").read_text())
    net, tok = M.load_model(qwen05b_dir, dtype=torch.float32)
    features.extract(net, tok, tmp_path / "matched_clean_test.json", tmp_path / "f.safetensors")
    ours, _ = detection.load_features(tmp_path / "f.safetensors")
    del net
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        qwen05b_dir, dtype=torch.float32, attn_implementation="eager").eval()
    records = released.load_matched(tmp_path / "matched_clean_test.json")
    worst = {}
    for i, record in enumerate(records):
        ids, (start, end), _ = features.render_record(record, tok)
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
        hs = [h[0].double() for h in out.hidden_states]                      # L+1 x (T, d)
        stats = reference_stats(out.attentions, start, end)                  # (1, L, H)
        span_mean = torch.stack([h[start:end].mean(0) for h in hs])          # (L+1, d)
        ref = {"h_last4": torch.stack([h[end - 1] for h in hs[-4:]]),
               "h_mean": span_mean[-1]}
        ref.update({f"attn_{k}": v[0] for k, v in stats.items()})
        # CoE (METHOD.md §4) written out again from the transformers hidden states
        step = span_mean[1:] - span_mean[:-1]
        M_l = step.norm(dim=-1) / (span_mean[-1] - span_mean[0]).norm()
        cos = torch.nn.functional.cosine_similarity(span_mean[1:], span_mean[:-1], dim=-1)
        end_angle = torch.arccos(torch.nn.functional.cosine_similarity(
            span_mean[-1], span_mean[0], dim=0).clamp(-1, 1))
        A_l = torch.arccos(cos.clamp(-1, 1)) / end_angle
        ref["coe_r"] = M_l.mean() - A_l.mean()
        ref["coe_c"] = torch.hypot((M_l * torch.cos(A_l)).mean(), (M_l * torch.sin(A_l)).mean())
        for key in detection.RAW_KEYS:
            got, want = ours[key][i].double(), ref[key].double()
            diff = (got - want).abs().max().item()
            worst[key] = max(worst.get(key, 0.0), diff)
            # hidden states of Qwen2.5 reach ~1e3 in a few dimensions: relative to the scale
            scale = max(1.0, want.abs().max().item())
            assert diff <= 2e-4 * scale, (key, i, diff, scale)
    print("max abs difference per feature:", json.dumps(worst))
