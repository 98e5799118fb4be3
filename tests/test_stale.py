"""The stale-value world, shop-stale (lab/stale.py): at each of eight decisions the thought states
the current value and the action carries it or the stale one it replaced, which fails the episode
alone; its dialogs draw each decision on its own; the regime's within-group numbers
(lab/premise.py)."""
import collections
import re
import types

import pytest
import torch

import envs
import pair
from lab import premise
from lab import shop as shop_command
from lab.worlds import released, shop, shopdata, stale


def stale_env(split="train", episodes=40):
    return envs.ShopEnv(split, seed=42, episodes=episodes, world=stale.STALE_WORLD)


def test_a_built_in_world_of_four_lines_its_ids_rebuilt():
    env = stale_env()
    assert shop.WORLDS["shop-stale"] is stale.STALE_WORLD
    for i in range(len(env)):
        task = env.episode(i).task
        assert isinstance(task, stale.StaleTask) and len(task.lines) == stale.STALE_LINES
        assert len({s for _, _, s in task.lines}) == 1 and task.currency != "USD"
    key = env.ids[3]
    assert key == "shop-stale-42-train-3"
    assert shop.shop_task_from_id(key) == env.episode(3).task


def test_the_gold_dialog_renders_parses_plays_and_scores_one():
    env = stale_env()
    for i in range(len(env)):
        ep = env.episode(i)
        dialog = stale.stale_dialog(ep.task)
        messages = envs.dialog_to_messages(dialog, envs.SHOP_TOOLS, [])
        turns = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [envs.parse_react(t) for t in turns] == shopdata.dialog_steps(dialog)
        assert len(turns) == 14 <= stale.STALE_MAX_TURNS
        # the tools answer as the dialog says, every turn is right, the answer the total
        assert all(a == b for a, b in released.play_gold(ep, dialog))
        assert ep.labels() == [True] * 14 and ep.score() == 1.0


def test_each_stale_value_alone_fails_the_episode_where_its_thought_is_right():
    env = stale_env()
    kinds = collections.Counter()
    for i in range(len(env)):
        task = env.episode(i).task
        gold = shopdata.dialog_steps(stale.stale_dialog(task))
        turns = stale.slip_turns(task)
        assert list(turns) == list(stale.DECISIONS) and shop.slip_turns(task) == turns
        assert list(turns.values()) == [3, 4, 6, 7, 9, 10, 12, 13]     # eight turns, in order
        for decision, k in turns.items():
            dialog = stale.stale_dialog(task, {decision})
            ep = env.episode(i)
            assert all(a == b for a, b in released.play_gold(ep, dialog))     # real tools
            labels = ep.labels()
            assert labels.index(False) == k and ep.score() == 0.0, (i, decision)
            step = shopdata.dialog_steps(dialog)[k]
            # the thought is the gold's (right: the gold is right throughout), after the same
            # prefix; only the action carries the stale value
            assert step.thought == gold[k].thought and step != gold[k]
            assert shopdata.dialog_steps(dialog)[:k] == gold[:k]
            kinds[shop.slip_kind(decision)] += 1
    assert set(kinds) == set(stale.STALE_DECISIONS)


def test_the_stale_value_is_the_one_it_replaced():
    task = stale_env().episode(0).task
    costs = [q * task.prices[s, i] for q, i, s in task.lines]
    dialog = stale.stale_dialog(task, {"price 3"})
    steps = shopdata.dialog_steps(dialog)
    q3 = task.lines[2][0]
    (_, item2, store), (_, item3, _) = task.lines[1:3]
    # line 3's cost at line 2's price, the thought stating line 3's
    assert steps[6].arguments == {"expression": f"{q3}*{task.prices[store, item2]}"}
    assert steps[6].thought.endswith(f"costs {q3}*{task.prices[store, item3]}.")
    # the answer given is the dollar total as the Calculator wrote it, its thought the converted
    dialog = stale.stale_dialog(task, {"answer"})
    steps = shopdata.dialog_steps(dialog)
    assert steps[13].answer == dialog[-6]["content"]["content"]
    assert float(steps[13].answer) == pytest.approx(float(sum(costs)))
    assert steps[13].thought == f"The total is {task.answer} {task.currency}."


def test_stale_sft_dialogs_draw_each_decision_on_its_own_at_its_rate():
    gold = stale.stale_sft_dialogs(10, 0.0, seed=1)
    assert gold == [envs.dialog_to_messages(stale.stale_dialog(stale.stale_task(
        envs.shop_episode_seed("train", 1, i))), envs.SHOP_TOOLS, []) for i in range(10)]
    assert stale.stale_sft_dialogs(30, 0.55, seed=1) == stale.stale_sft_dialogs(30, 0.55, seed=1)
    made = collections.Counter()
    n = 200
    for i, dialog in enumerate(stale.stale_sft_dialogs(n, 0.55, seed=2)):
        task = stale.stale_task(envs.shop_episode_seed("train", 2, i))
        turns = [m["content"] for m in dialog if m["role"] == "assistant"]
        assert len(turns) == 14
        # each decision's action carries the value its own thought states, or not
        for decision, k in stale.slip_turns(task).items():
            thought, action = turns[k].split("\n", 1)
            if decision == "answer":
                carried = action.split("Final Answer: ")[1]
                right = re.search(r"The total is (\S+) ", thought).group(1)
            else:
                carried = re.search(r'"expression": "([^"]+)"', action).group(1)
                right = re.search(r"(?:costs|is) (\S+)\.$", thought).group(1)
            made[decision] += carried != right
    for decision in stale.DECISIONS:
        assert 0.44 <= made[decision] / n <= 0.66, (decision, made[decision])


def test_sft_writes_a_shop_stale_policy_and_its_recipe(tmp_path):
    tiny = ["--episodes", "6", "--steps", "2", "--batch", "2", "--hidden", "16", "--layers",
            "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "32", "--vocab", "300",
            "--eval-episodes", "0", "--threads", "1", "--induction-steps", "2"]
    shop_command.main(["sft", "--out", str(tmp_path / "shop")] + tiny)
    shop_command.main(["sft", "--out", str(tmp_path / "stale"), "--world", "shop-stale", "--slips",
               "0.55", "--init", str(tmp_path / "shop")] + tiny)
    readme = (tmp_path / "stale" / "README.md").read_text()
    assert readme.startswith("# shop-stale-policy") and "--world shop-stale --slips 0.55" in readme


def test_within_groups_compares_one_decision_of_one_episode_sampled_both_ways():
    # episode A: at "price 2" a right and a slip, the right scored higher; at "convert" a right
    # and a slip the other way; episode B: a right only (no pair)
    y = torch.tensor([1, 0, 1, 0, 1])
    score = torch.tensor([0.9, 0.1, 0.2, 0.8, 0.5])
    keys = [("A", "price 2"), ("A", "price 2"), ("A", "convert"), ("A", "convert"),
            ("B", "price 2")]
    got = premise.within_groups(y, score, keys)
    assert got["auroc"] == 0.5 and got["pairs"] == 2 and got["groups"] == 2
    lo, hi = got["interval95"]
    assert lo == 0.0 and hi == 1.0
    # grouped by episode alone, the right turn at convert would meet the slip at price 2 too
    assert premise.within_groups(y, score, [k[0] for k in keys])["pairs"] == 4
    assert premise.within_groups(y[:1], score[:1], keys[:1]) is None
    # ties count a half
    assert premise.within_groups(y[:2], torch.tensor([0.3, 0.3]), keys[:2])["auroc"] == 0.5


def test_the_room_in_groups_counts_decisions_reached_with_a_clean_prefix():
    groups = [premise.Group(True, {"price 2": [True, False], "subtotal 2": [True]}),
              premise.Group(True, {"price 2": [False, False], "subtotal 2": []}),
              premise.Group(False, {"price 2": [True, True], "subtotal 2": [False, True]})]
    got = premise.room_in_groups(groups)
    assert got["decisions_reached"] == 5 and got["both"] == pytest.approx(2 / 5)
    assert got["first_decision_both"] == pytest.approx(1 / 3)
    assert got["groups_with_both"] == pytest.approx(2 / 3)
    lo, hi = got["both_interval95"]
    assert 0.0 <= lo <= 2 / 5 <= hi <= 1.0


def test_the_probe_a_reward_reads_is_scored_at_the_first_errors_pooled_and_within():
    # 30 episodes of 4 first-error turns at one decision and one later turn; the label is
    # written in the last hidden state, which PAIR's stage 1 reads
    g = torch.Generator().manual_seed(1)
    n, d, L, H = 150, 8, 2, 2
    y = torch.randint(0, 2, (n,), generator=g)
    h_last4 = torch.randn(n, 4, d, generator=g)
    h_last4[:, -1, 0] += 3.0 * y
    raw = {"h_last4": h_last4, "h_mean": h_last4[:, -1]}
    for stat in ("max", "std", "prefix", "self", "entropy", "lookback"):
        raw[f"attn_{stat}"] = torch.rand(n, L, H, generator=g)
    raw["distance"] = torch.tensor([-1 if i % 5 != 4 else 1 for i in range(n)])
    turns = types.SimpleNamespace(y=y, raw=raw, episode_id=[f"e{i // 5}" for i in range(n)])
    at = ["price 2" if i % 5 != 4 else None for i in range(n)]
    ctx = types.SimpleNamespace(pair=pair.fit_pair(raw, y), probe=None)
    got = premise.probe_apart(turns, at, ctx)
    assert got["turns"] == 120 and got["auroc"] > 0.9 and got["within"]["auroc"] > 0.9
    lo, hi = got["auroc_interval"]
    assert lo <= got["auroc"] <= hi
    assert premise.probe_apart(turns, at, types.SimpleNamespace(pair=None, probe=None)) is None
