"""The premise world, shop-copy (lab/worlds/shop.py): each decision's slip copies another value of its
episode and fails it alone; its dialogs misread each decision on its own; held-out success
sampled (lab.train --eval-samples); the regime command (lab/premise.py)."""
import collections
import json
import types

import numpy as np
import pytest
import torch

import envs
import grpo
import pair
from lab import compare, premise
from lab import shop as shop_command
from lab import train as lab_train
from lab.methods import credit
from lab.probing import detection
from lab.worlds import released, shop, shopdata
from test_grpo import _cache, pair_cache, tiny_policy  # noqa: F401  (fixtures)


def copy_env(split="train", episodes=30):
    return envs.ShopEnv(split, seed=42, episodes=episodes, world=shop.COPY_WORLD)


def test_shop_copy_tasks_are_shop_longs_of_the_same_seed():
    env, long = copy_env(), envs.ShopEnv("train", seed=42, episodes=30, world=shop.LONG_WORLD)
    for i in range(len(env)):
        a, b = env.episode(i).task, long.episode(i).task
        assert isinstance(a, shop.CopyTask) and (a.lines, a.currency, a.text) == \
            (b.lines, b.currency, b.text)
    key = next(iter(env.records))
    assert key.startswith("shop-copy-42-train-")
    assert isinstance(shop.shop_task_from_id(key), shop.CopyTask)
    with pytest.raises(ValueError, match="WORLD one of shop, shop-long, shop-copy"):
        shop.shop_task_from_id("shop-short-42-train-0")


def test_each_decision_copies_another_value_of_its_episode_and_fails_it_alone():
    env = copy_env()
    kinds = collections.Counter()
    for i in range(len(env)):
        task = env.episode(i).task
        decisions = shop.copy_decisions(task.seed)
        n = len(task.lines)
        assert list(decisions) == [f"{k} {j}" for j in range(1, n + 1)
                                   for k in ("store", "quantity")] + ["currency", "convert"]
        turns = shop.slip_turns(task)
        assert len(turns) >= 8 - sum(not v for v in decisions.values())
        for decision, values in decisions.items():
            for value in values:
                dialog = shop.long_dialog(task, misread={decision: value})
                ep = env.episode(i)
                assert all(a == b for a, b in released.play_gold(ep, dialog))  # real tools
                labels = ep.labels()
                assert ep.score() == 0.0, (i, decision, value)
                # wrong where it is made, right before it: the turn slip_turns names
                assert labels.index(False) == turns[decision] == \
                    shopdata.shop_dialog_labels(task, shop.long_dialog(
                        task, misread={decision: values[0]})).index(False)
                kinds[shop.slip_kind(decision)] += 1
        # the values are the episode's own: another store, another line's quantity
        for k, (q, _, store) in enumerate(task.lines):
            assert store not in decisions[f"store {k + 1}"]
            assert set(decisions[f"quantity {k + 1}"]) <= {x for x, _, _ in task.lines} - {q}
    assert set(kinds) == set(shop.COPY_DECISIONS)
    assert shop.slip_kind("store 2") == "store" and shop.slip_kind("forget") == "forget"


def test_copy_sft_dialogs_misread_each_decision_on_its_own():
    gold = shop_command.copy_sft_dialogs(20, 0.0, seed=1)
    assert gold == [envs.dialog_to_messages(shop.long_dialog(shop.copy_task(
        envs.shop_episode_seed("train", 1, i))), envs.SHOP_TOOLS, []) for i in range(20)]
    assert shop_command.copy_sft_dialogs(50, 0.4, seed=1) == shop_command.copy_sft_dialogs(50, 0.4, seed=1)
    first = collections.Counter()
    for i, dialog in enumerate(shop_command.copy_sft_dialogs(300, 0.4, seed=1)):
        task = shop.copy_task(envs.shop_episode_seed("train", 1, i))
        want = [m for m in envs.dialog_to_messages(shop.long_dialog(task), envs.SHOP_TOOLS, [])
                if m["role"] == "assistant"]
        made = [m for m in dialog if m["role"] == "assistant"]
        assert len(made) == len(want) == 2 * len(task.lines) + 3
        k = next((k for k, (a, b) in enumerate(zip(made, want)) if a != b), None)
        assert k is None or k in shop.slip_turns(task).values(), (i, k)    # at a decision
        first[k] += 1
    # 8-10 decisions each misread with p 0.4: a dialog without a slip is rare (0.6^8 = 1.7%)
    assert first[None] <= 0.06 * 300, first
    assert first[0] >= 0.3 * 300, first             # the first decision: its own 40%


def test_a_copy_dialogs_misreads_are_drawn_at_their_rate():
    seen = collections.Counter()
    for i, dialog in enumerate(shop_command.copy_sft_dialogs(200, 0.3, seed=3)):
        task = shop.copy_task(envs.shop_episode_seed("train", 3, i))
        decisions = shop.copy_decisions(task.seed)
        calls = [m["content"].split("Action Input:")[-1] for m in dialog
                 if m["role"] == "assistant"][:-1]
        for k, (q, item, store) in enumerate(task.lines):
            seen["store", f'"store": "{store}"' not in calls[2 * k]] += 1
        seen["currency", f'"currency": "{task.currency}"' not in calls[2 * len(task.lines)]] += 1
        assert all(decisions[f"store {k + 1}"] for k in range(len(task.lines)))
    for kind in ("store", "currency"):
        rate = seen[kind, True] / (seen[kind, True] + seen[kind, False])
        assert 0.22 <= rate <= 0.38, (kind, rate)


def test_sft_writes_a_shop_copy_policy_and_its_recipe(tmp_path):
    tiny = ["--episodes", "6", "--steps", "2", "--batch", "2", "--hidden", "16", "--layers",
            "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "32", "--vocab", "300",
            "--eval-episodes", "0", "--threads", "1", "--induction-steps", "2"]
    shop_command.main(["sft", "--out", str(tmp_path / "shop")] + tiny)
    shop_command.main(["sft", "--out", str(tmp_path / "copy"), "--world", "shop-copy", "--slips", "0.4",
               "--init", str(tmp_path / "shop")] + tiny)
    readme = (tmp_path / "copy" / "README.md").read_text()
    assert "shop-copy-policy" in readme and "--world shop-copy --slips 0.4" in readme
    with pytest.raises(SystemExit):                     # a long world continues a saved policy
        shop_command.main(["sft", "--out", str(tmp_path / "c"), "--world", "shop-copy"] + tiny)


def run_args(policy, out, *more):
    args = lab_train.parse_args(["--env", "shop-copy", "--model", str(policy), "--out", str(out),
                                 "--threads", "1", "--max-new-tokens", "24", *more],
                                recorded=False)
    grpo.resolve_preset(args, pair.Processes(), lab_train.WORLDS)
    return args


def test_sampled_evaluation_plays_each_episode_k_times_the_same_way(tiny_policy, tmp_path):
    args = run_args(tiny_policy, tmp_path / "run", "--eval-samples", "3", "--eval-batch", "4",
                    "--max-turns", "3")
    policy, tok = grpo.load_policy(args, pair.Processes(), lab_train.WORLDS)
    env = copy_env("test", 5)
    pool = list(range(5))
    a = credit.sampled(policy, tok, env, pool, 5, args, pair.Processes())
    b = credit.sampled(policy, tok, env, pool, 5, args, pair.Processes())
    assert a == b and a["episodes"] == 5 and a["samples"] == 3 and len(a["scores"]) == 5
    assert all(3 * s == round(3 * s) for s in a["scores"])         # a mean of 3 scores
    assert a["decoding"] == f"3 samples an episode at T {args.temperature}"
    assert a["success"] == pytest.approx(sum(a["scores"]) / 5)


def test_a_sampled_run_records_and_tabulates_its_decoding(tiny_policy, tmp_path):
    args = run_args(tiny_policy, tmp_path / "run", "--eval-samples", "2", "--steps", "1",
                    "--reward", "labels", "--eval-episodes", "3", "--val-episodes", "2",
                    "--max-turns", "2", "--batch", "1", "--group", "2")
    lab_train.train(args)
    ev = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ev] == [0, 1]
    how = f"2 samples an episode at T {args.temperature}"
    assert all(e["samples"] == 2 and e["test"]["decoding"] == how for e in ev)
    recorded = json.loads((tmp_path / "run" / "args.json").read_text())
    assert recorded["eval_samples"] == 2
    assert compare.decoding(tmp_path / "run") == \
        f"sampled: 2 rollouts of each episode at T {args.temperature}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["base"]["decoding"] == how
    assert f"held-out success ({how}, 3 test episodes)" in grpo.summary_text(summary)


def test_the_regime_counts_what_the_premise_needs():
    turns = type("T", (), {})()
    # two first-error turns of kind store (one slip), one of kind currency, one later turn
    turns.y = torch.tensor([1, 0, 1, 0])
    turns.raw = {"distance": torch.tensor([-1, -1, -1, 2]),
                 "nll": torch.tensor([0.1, 0.9, 0.2, 0.05])}
    turns.episode_id = ["A", "A", "A", "A"]
    got = premise.confidence_at_first_errors(turns, ["store 1", "store 1", "currency", None])
    assert got["turns"] == 3 and got["slips"] == 1 and got["auroc"] == 1.0
    # within groups: the right and the slip of store 1 in episode A, one pair
    assert got["within"]["auroc"] == 1.0 and got["within"]["pairs"] == 1
    assert got["by_kind"]["store"] == {"turns": 2, "slips": 1, "auroc": 1.0}
    assert got["by_kind"]["currency"]["auroc"] is None          # one class only
    assert premise.wilson(0, 10)[0] == 0.0 and premise.wilson(10, 10)[1] == 1.0
    mean, (lo, hi) = premise.mean_interval([0.0, 0.5, 1.0, 0.5])
    assert mean == 0.5 and lo < 0.5 < hi


def test_the_readout_fits_probes_on_the_first_errors_and_scores_them_out_of_fold():
    # 40 episodes of 6 turns, all first errors with a clean prefix but the last of each; the
    # label is written in the last hidden state only, so the hidden-state probes and PAIR (whose
    # stage 1 reads it) rank the slips, the attention probe does not
    g = torch.Generator().manual_seed(0)
    n, d, L, H = 240, 8, 2, 2
    y = torch.randint(0, 2, (n,), generator=g)
    h_last4 = torch.randn(n, 4, d, generator=g)
    h_last4[:, -1, 0] += 3.0 * y
    raw = {"h_last4": h_last4, "h_mean": h_last4[:, -1] + 0.1 * torch.randn(n, d, generator=g)}
    for stat in ("max", "std", "prefix", "self", "entropy", "lookback"):
        raw[f"attn_{stat}"] = torch.rand(n, L, H, generator=g)
    raw["distance"] = torch.tensor([-1] * n)
    turns = type("T", (), {})()
    turns.y, turns.raw = y, raw
    turns.episode_id = [f"e{i // 6}" for i in range(n)]
    at = [None if i % 6 == 5 else "store 1" for i in range(n)]
    got = premise.readout_at_first_errors(turns, at)
    first = torch.tensor([i % 6 != 5 for i in range(n)])
    assert got["turns"] == 200 and got["slips"] == int((y[first] == 0).sum())
    assert got["folds"] == 5
    for name in ("last_token", "mean_pooled", "multi_layer", "pair"):
        assert got["auroc"][name] > 0.9, name
        lo, hi = got["auroc_interval"][name]
        assert lo <= got["auroc"][name] <= hi
    assert 0.35 < got["auroc"]["multi_attn"] < 0.65
    # within each episode's decision, right against slip, as pooled
    assert got["within"]["last_token"]["auroc"] > 0.85
    assert 0.3 < got["within"]["multi_attn"]["auroc"] < 0.7
    # too few episodes for the folds, or a fold's complement of one class: nothing to fit
    assert premise.readout_at_first_errors(turns, at, folds=41) is None
    turns.y = torch.ones(n, dtype=torch.long)
    assert premise.readout_at_first_errors(turns, at) is None


def test_the_gate_taken_apart_tells_a_reward_pooled_over_episodes_from_one_within_groups():
    # two episodes of two one-turn rollouts, a right decision and a slip each; the confidence
    # reward is high in episode A and low in B, and within each the slip is the more confident
    nll = torch.tensor([0.2, 0.1, 2.0, 1.9])
    raw = {"nll": nll, "rollout": torch.arange(4), "distance": torch.full((4,), -1),
           "score": torch.zeros(4), "turn_idx": torch.zeros(4, dtype=torch.long)}
    turns = detection.Split("heldout", raw, torch.tensor([1, 0, 1, 0]), ["A", "A", "B", "B"], {})
    at = ["store 1"] * 4
    args = types.SimpleNamespace(reward="confidence", advantage="position", outcome_weight=0.0)
    got = premise.gate_apart(turns, at, None, args, credit.forms()["position"])
    want = {"turns": 4, "slips": 2, "gate": 0.0, "reward_pooled": 0.25, "reward_within": 0.0,
            "centred": 0.0}
    assert got["all"] == want and got["by_kind"] == {"store": want}
    turns.episode_id = ["A", "B", "C", "D"]            # a group of one: nothing within it
    alone = premise.gate_apart(turns, at, None, args, credit.forms()["position"])["all"]
    assert alone["reward_pooled"] == 0.25 and alone["reward_within"] is None
    assert alone["centred"] == 0.5 and alone["gate"] == 0.5
    args.reward = "igpo"                                # not computable from the stored turns
    assert premise.gate_apart(turns, at, None, args, credit.forms()["position"]) is None


def test_the_share_of_the_ceiling_and_its_fieller_interval():
    rng = np.random.default_rng(0)
    outcome = rng.integers(0, 2, (3, 300)).astype(float)
    labels = np.clip(outcome + (rng.random((3, 300)) < 0.4), 0, 1)     # a wide gain over it
    half = np.where(rng.random((3, 300)) < 0.5, labels, outcome)      # about half of that gain
    got = compare.share_of_ceiling(half, labels, outcome)
    assert got["share"] == pytest.approx((half - outcome).mean() / (labels - outcome).mean())
    lo, hi = got["ci95"]
    assert lo < got["share"] < hi and 0.2 < lo < 0.5 < hi < 0.8
    # at an end of the interval, interval95 of R - O - theta (L - O) just holds zero
    for end in (lo, hi):
        mean, half_width = compare.half_width((half - outcome) - end * (labels - outcome))
        assert abs(mean) == pytest.approx(half_width, abs=1e-6)
    # the ceiling's gain not told from zero: the share can be anything
    flat = np.where(rng.random((3, 300)) < 0.02, 1.0, outcome)
    assert None in compare.share_of_ceiling(half, flat, outcome)["ci95"]
    assert compare.share_of_ceiling(half, outcome, outcome) == {"share": None,
                                                               "ci95": [None, None]}


def test_the_credit_table_names_each_rows_share_and_gate():
    def row(name, final, delta, share=None, gate=None):
        return {"reward": name, "final": {"mean": final, "delta_vs_first": delta,
                                          "share_of_ceiling": share}, "premise_gate": gate}
    gate = {"auroc": 0.838, "auroc_interval": [0.803, 0.87], "reward_auroc": 1.0}
    result = {"reference": "outcome", "ceiling": "labels", "rows": [
        row("outcome", 0.3, 0.0), row("labels", 0.6, 0.3, gate=gate),
        row("confidence", 0.45, 0.15, {"share": 0.5, "ci95": [0.2, None]}, gate)]}
    lines = compare.credit_lines(result, lambda x: f"{100 * x:.1f}")
    assert "| confidence | 45.0 | +15.0 | +50% [+20, unbounded] | 0.838 [0.803, 0.870] | " \
        "1.000 |" in lines
    assert "| labels | 60.0 | +30.0 | — | 0.838 [0.803, 0.870] | 1.000 |" in lines
    assert "| outcome | 30.0 | — | — | — | — |" in lines
    assert compare.credit_lines({"reference": "outcome", "rows": [row("outcome", 0.3, 0)]},
                                str) == []


def test_compare_refuses_a_ceiling_that_is_not_a_later_reward(tmp_path):
    with pytest.raises(SystemExit, match="--ceiling labels: not one of --rewards after the first"):
        compare.main(["--rewards", "outcome", "pair", "--ceiling", "labels", "--out",
                      str(tmp_path)])
    with pytest.raises(SystemExit, match="--ceiling outcome"):
        compare.main(["--rewards", "outcome", "pair", "--ceiling", "outcome", "--out",
                      str(tmp_path)])


def test_the_regime_command_measures_a_world_and_writes_it(tiny_policy, tmp_path, capsys):
    out = tmp_path / "regime.json"
    got = premise.main(["--env", "shop-copy", "--model", str(tiny_policy), "--episodes", "3",
                        "--samples", "2", "--groups", "2", "--seeds", "42", "--out", str(out),
                        "--gates", "labels:advantage=outcome-turn", "--", "--max-new-tokens",
                        "8", "--max-turns", "3", "--corpus-heldout", "2", "--corpus-samples",
                        "2"])
    assert json.loads(out.read_text()) == got
    assert got["decisions"]["episodes"] == 3 and got["decisions"]["min"] >= 5
    assert got["success_sampled"]["samples"] == 2 and got["success_sampled"]["episodes"] == 3
    # the paper's preset (not a built-in policy): a step of 1 prompt, its group of 4
    assert got["group"] == 4 and got["groups_without_success_first_step"]["groups"] == 1
    assert got["groups_without_success"]["groups"] == 2
    assert got["heldout_turns"] == {"episodes": 2, "samples": 2}
    printed = capsys.readouterr().out
    assert "held-out success sampled" in printed and f"wrote {out}" in printed
    assert "a probe fitted at first errors" in printed
    gate = got["gates"]["labels:advantage=outcome-turn"]
    assert gate["reward"] == "labels" and gate["advantage"] == "outcome-turn"
    assert "premise gate of labels:advantage=outcome-turn, taken apart" in printed
    assert gate["probe"] is None                            # the labels read no probe
    room = got["room_in_groups"]
    assert room["groups"] == 2 and "groups of G holding a right and a wrong sample" in printed
    with pytest.raises(SystemExit):
        premise.main(["--samples", "0", "--out", str(out)])
