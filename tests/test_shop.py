"""The built-in world (envs.py: exact labels, replay, splits; lab/worlds/shopdata.py: data,
contamination; lab/worlds/shop.py: the long worlds), the recipe of the built-in policy
(lab/policies/sft.py) and the on-policy probe corpus."""
import argparse
import collections
import json
import os
import random
import re
import shlex
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
import torch

import envs
import grpo
import model as mdl
import probes
from lab import shop as shop_command
from lab import train as lab_train
from lab.methods import onpolicy
from lab.policies import sft
from lab.probing import detection, features, traces
from lab.worlds import released, shop, shopdata

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ROOT / "data" / "shop-policy"
FILES = sorted(f"{kind}{part}_{split}.json" for kind in ("", "matched_")
               for part in ("clean", "contaminated") for split in ("train", "test")) + \
    ["diagnostic_test.json", "matched_diagnostic_test.json"]
NUMBER = re.compile(r"(\w+ at store \w|1 USD) (?:costs|=) (\d+\.\d+)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("shop")
    shopdata.make_shop_data(out, episodes=60, seed=7)
    return out


def load(folder, name):
    return json.loads((Path(folder) / name).read_text())


def hand_task(currency="EUR"):
    # 3 apple at B (2.50) + 2 pear at A (1.20), EUR rate 0.90 -> (7.50 + 2.40) * 0.9 = 8.91
    prices = {(s, i): Decimal("5.00") for s in envs.SHOP_STORES for i in envs.SHOP_ITEMS}
    prices["B", "apple"] = Decimal("2.50")
    prices["A", "pear"] = Decimal("1.20")
    rates = {"USD": Decimal("1.00"), "EUR": Decimal("0.90"), "GBP": Decimal("0.80"),
             "CAD": Decimal("1.30"), "JPY": Decimal("150.00")}
    lines = ((3, "apple", "B"), (2, "pear", "A"))
    return envs.ShopTask(0, prices, rates, lines, currency, "hand-made task")


def act(thought, name, **arguments):
    return envs.render_action(thought, name, arguments)


def test_labeler_on_hand_written_turns():
    task = hand_task()
    assert task.answer == "8.91"
    ep = envs.ShopEpisode("hand", task)
    turns = [
        (act("I need the price of pear at store A.", "Lookup", store="A", item="pear"), True),
        (act("pear at store A costs 1.20.", "Lookup", store="A", item="pear"), False),  # again
        (act("I need the price of apple at store C.", "Lookup", store="C", item="apple"),
         False),                                                # the task does not need it
        (act("pear at store A costs 1.30.", "Lookup", store="B", item="apple"), False),  # misread
        (act("I need the price of apple at store E.", "Lookup", store="E", item="apple"), False),
        (act(None, "Calculator", expression="3*2.50"), True),   # a line subtotal
        (act(None, "Calculator", expression="7.5"), False),     # already computed
        (act("Now 99 more.", "Rate", currency="EUR"), False),   # 99: a number the task lacks
        (act("1 USD = 0.90 EUR. The total is (3*2.50+2*1.20)*0.90.", "Calculator",
             expression="(3*2.50+2*1.20)*0.9"), True),
    ]
    for text, _ in turns:
        assert not ep.done
        ep.step(text)
    assert ep.labels() == [want for _, want in turns]
    observations = [m["content"] for m in ep.messages[2::2]]
    assert observations[1] == "Observation: pear at store A costs 1.20 USD."
    assert observations[4].startswith("Observation: Error: unknown store 'E'.")
    assert observations[-1] == "Observation: 8.91"
    ep1 = envs.ShopEpisode("hand", task)
    ep1.step("Thought: I will look it up.\nAction: Lookup")
    assert ep1.labels() == [False] and ep1.messages[-1]["content"].startswith(
        "Observation: Invalid reply")
    ep2 = envs.ShopEpisode("hand", task)
    ep2.step(envs.render_final("The total is 8.91 EUR.", "8.91"))
    assert ep2.done and ep2.score() == 1.0 and ep2.labels() == [True]
    ep3 = envs.ShopEpisode("hand", task)
    ep3.step(envs.render_final("The total is 8.91 EUR.", "8.93"))
    assert ep3.score() == 0.0 and ep3.labels() == [False]
    ep4 = envs.ShopEpisode("hand", task)
    ep4.step(envs.render_final("The total is 9.91 EUR.", "8.91"))   # right answer, false claim
    assert ep4.score() == 1.0 and ep4.labels() == [False]
    # the words after the claim are not its currency; a thousands comma is part of its number
    for thought, right in (("The total is 8.91 and I am done.", True),
                           ("The total is 8.91 for 2 lines.", True),
                           ("The total is 8.91 USD.", False),        # the task is in EUR
                           ("The total is 1,008.91 EUR.", False),    # read whole: not 8.91
                           ("The total is 8,91 EUR.", False),        # 891
                           ("The total is 8.91 (2 lines).", True),   # the start that computes
                           ("The total is 9.91 (2 lines).", False)):
        ep5 = envs.ShopEpisode("hand", task)
        ep5.step(envs.render_final(thought, "8.91"))
        assert ep5.labels() == [right], thought


def test_the_answer_is_the_total_rounded_not_a_cent_off():
    task = hand_task()
    task.rates["EUR"] = Decimal("0.92")             # (7.50 + 2.40) * 0.92 = 9.108
    assert task.total == Decimal("9.108") and task.answer == "9.11"
    for answer, right in (("9.11", True), ("9.108", True), ("9.1", False), ("9.10", False),
                          ("9.12", False)):
        ep = envs.ShopEpisode("hand", task)
        ep.step(envs.render_final(f"The total is {answer} EUR.", answer))
        assert (ep.score(), ep.labels()) == (float(right), [right]), answer


def test_out_of_turns_scores_zero():
    ep = envs.ShopEnv("test", seed=1, episodes=1).episode(0)
    while not ep.done:
        ep.step(act(None, "Rate", currency="USD"))
    assert len(ep.steps) == envs.MAX_TURNS and ep.score() == 0.0 and not any(ep.labels())


def test_gold_dialogs_replay_score_and_label():
    env = envs.ShopEnv("test", seed=3, episodes=80)
    calls, templates = collections.Counter(), set()
    for i in range(len(env)):
        ep = env.episode(i)
        task = ep.task
        dialog, _ = shopdata.shop_gold(task)
        assert envs.dialog_to_messages(dialog[:1], envs.SHOP_TOOLS) == ep.messages
        pairs = released.play_gold(ep, dialog)
        assert pairs and all(recorded == returned for recorded, returned in pairs)
        assert ep.done and ep.score() == 1.0
        assert ep.labels() == [True] * len(ep.steps)
        assert shopdata.shop_dialog_labels(task, dialog) == ep.labels()
        assert dialog[-1]["content"] == task.answer == f"{float(task.answer):.2f}"
        calls[len(pairs)] += 1
        templates.add(task.text.split()[0])
    assert set(calls) == {2, 3, 4, 5}
    assert templates == {"What", "How", "I"}


def test_divided_dialog_is_the_gold_one_converting_the_wrong_way_round():
    task = hand_task("EUR")             # (3*2.50+2*1.20) USD = 9.90 USD; EUR rate 0.90
    gold, divided = shopdata.shop_gold(task)[0], shopdata.shop_divided(task)
    calc = next(i for i, m in enumerate(divided) if m.get("tool_calls") and
                m["tool_calls"][0]["function"]["name"] == "Calculator")
    assert divided[:calc] == gold[:calc]            # the same lookups and rate
    assert divided[calc]["tool_calls"][0]["function"]["arguments"] == \
        {"expression": "(3*2.50+2*1.20)/0.90"}
    assert divided[calc]["thought"].endswith("The total is (3*2.50+2*1.20)/0.90.")
    assert divided[calc + 1]["content"]["content"] == "11.0"
    assert divided[-1]["content"] == "11.00" and divided[-1]["thought"] == \
        "The total is 11.00 EUR."                   # it answers what it computed
    labels = shopdata.shop_dialog_labels(task, divided)
    assert labels == [True] * (len(labels) - 2) + [False, False]
    ep = envs.ShopEpisode("hand", task)
    released.play_gold(ep, divided)
    assert ep.score() == 0.0
    assert shopdata.shop_divided(hand_task("USD")) is None     # nothing to convert


# ---------------------------------------------------------------------------------------------
# shop-long: the long-horizon world

def slip_labels(n_lines: int, slip: str) -> list[bool]:
    """What each turn of a shop-long dialog with one slip must be labelled: the slip's own turn
    and every later turn that carries its number are wrong, the rest right."""
    turns = 2 * n_lines + 3             # per line Lookup + running total; Rate, conversion, answer
    wrong = {"store": {0} | set(range(1, 2 * n_lines, 2)),     # every running total after it
             "forget": {2 * n_lines - 1}, "divided": set()}[slip]
    wrong |= {turns - 2, turns - 1}                             # the conversion, the answer
    return [t not in wrong for t in range(turns)]


def test_long_world_gold_dialogs_replay_score_and_label():
    env = envs.ShopEnv("test", seed=3, episodes=60, world=shop.LONG_WORLD)
    turns = collections.Counter()
    for i in range(len(env)):
        ep = env.episode(i)
        task = ep.task
        assert ep.id == f"shop-long-3-test-{i}" and shop.shop_task_from_id(ep.id) == task
        assert task.currency != "USD" and 3 <= len(task.lines) <= 5
        dialog = shop.long_dialog(task)
        pairs = released.play_gold(ep, dialog)      # every tool call re-executed: same observations
        assert pairs and all(recorded == returned for recorded, returned in pairs)
        assert ep.score() == 1.0 and ep.labels() == [True] * len(ep.steps)
        assert shopdata.shop_dialog_labels(task, dialog) == ep.labels()
        turns[len(ep.steps)] += 1
    assert set(turns) == {9, 11}
    assert envs.ShopEnv("test", seed=3, episodes=5).episode(0).task != \
        envs.ShopEnv("test", seed=3, episodes=5, world=shop.LONG_WORLD).episode(0).task


def test_long_world_rejects_tasks_whose_gold_values_tie():
    """A Calculator result equal to an earlier one is a wasted call, labelled wrong, so a task
    whose converted total equals one of its running totals would make its own gold wrong."""
    world = shop.long_task(envs.shop_episode_seed("test", 42, 0))
    prices = {**world.prices, ("C", "milk"): Decimal("40.00"), ("C", "rice"): Decimal("8.00"),
              ("C", "egg"): Decimal("12.00")}           # running totals 40, 48, 60 USD
    rates = {**world.rates, "GBP": Decimal("0.80")}     # 60 USD is 48.00 GBP: a running total
    tie = shop.LongTask(0, prices, rates, ((1, "milk", "C"), (1, "rice", "C"), (1, "egg", "C")),
                        "GBP", "")
    assert not all(shopdata.shop_dialog_labels(tie, shop.long_dialog(tie)))
    assert not shop._long_distinct(tie)
    assert shop._long_distinct(world) and all(shopdata.shop_dialog_labels(
        world, shop.long_dialog(world)))


def test_long_world_slips_are_turn_local_and_each_fails_the_episode():
    env = envs.ShopEnv("train", seed=42, episodes=40, world=shop.LONG_WORLD)
    for i in range(len(env)):
        task = env.episode(i).task
        for slip in shop.LONG_SLIPS:
            dialog = shop.long_dialog(task, (slip,))
            ep = env.episode(i)
            pairs = released.play_gold(ep, dialog)
            assert all(recorded == returned for recorded, returned in pairs)
            assert ep.score() == 0.0, (i, slip)
            assert ep.labels() == slip_labels(len(task.lines), slip), (i, slip)
        both = shopdata.shop_dialog_labels(task, shop.long_dialog(task, ("store", "divided")))
        assert both == [a and b for a, b in zip(slip_labels(len(task.lines), "store"),
                                                slip_labels(len(task.lines), "divided"))]
    task = env.episode(0).task
    first = shop.long_dialog(task, ("store",))[1]["tool_calls"][0]["function"]["arguments"]
    assert first["item"] == task.lines[0][1] and first["store"] != task.lines[0][2]


def test_long_world_counts_only_running_totals():
    task = envs.ShopEnv("test", episodes=1, world=shop.LONG_WORLD).episode(0).task
    subtotals = [f"{q}*{task.prices[s, i]}" for q, i, s in task.lines]
    steps = [envs.Action(None, "Calculator", {"expression": "+".join(subtotals[1:3])}),
             envs.Action(None, "Calculator", {"expression": "+".join(subtotals)}),
             envs.Action(None, "Calculator", {"expression": "+".join(subtotals[:2])})]
    assert envs.shop_labels(task, steps) == [False, True, True]     # running totals only
    short = envs.ShopTask(0, task.prices, task.rates, task.lines, task.currency, "")
    assert envs.shop_labels(short, steps[:1]) == [True]      # shop counts any subset sum


def test_long_sft_dialogs_make_each_slip_on_its_own_where_its_habit_is():
    gold = shop_command.long_sft_dialogs(30, 0.0, seed=1)
    assert gold == [envs.dialog_to_messages(shop.long_dialog(shop.long_task(
        envs.shop_episode_seed("train", 1, i))), envs.SHOP_TOOLS, []) for i in range(30)]
    made, habits, every = collections.Counter(), collections.Counter(), collections.Counter()
    for i, dialog in enumerate(shop_command.long_sft_dialogs(600, 0.5, seed=1)):
        task = shop.long_task(envs.shop_episode_seed("train", 1, i))
        n = len(task.lines)
        inputs = [m["content"].split("Action Input:")[-1] for m in dialog
                  if m["role"] == "assistant"]
        seen = {"store": f'"store": "{task.lines[0][2]}"' not in inputs[0],
                "forget": "+" not in inputs[2 * n - 1], "divided": "/" in inputs[2 * n + 1]}
        slips = tuple(k for k in shop.LONG_SLIPS if seen[k])
        assert dialog == envs.dialog_to_messages(shop.long_dialog(task, slips),
                                                 envs.SHOP_TOOLS, [])
        has = {k for k in shop.LONG_SLIPS if shop.LONG_HABITS[k](task)}
        assert set(slips) <= has, (i, slips, has)           # never where its habit is not
        made.update(slips)
        habits.update(has)
        if len(has) == 3:
            every[len(slips)] += 1
    for s in shop.LONG_SLIPS:
        assert 0.35 * 600 <= habits[s] <= 0.65 * 600, habits     # each habit: half the tasks
        assert 0.4 * habits[s] <= made[s] <= 0.6 * habits[s], (made, habits)    # 50% of those
    assert every[0] and every[3] and every[1] and every[2], every   # ... each drawn on its own


def test_sft_shop_long_continues_a_shop_policy_byte_for_byte(tmp_path):
    tiny = ["--episodes", "6", "--steps", "2", "--batch", "2", "--hidden", "16", "--layers",
            "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "32", "--vocab", "300",
            "--eval-episodes", "0", "--threads", "1", "--induction-steps", "2"]
    shop_command.main(["sft", "--out", str(tmp_path / "shop")] + tiny)
    for name in ("a", "b"):
        shop_command.main(["sft", "--out", str(tmp_path / name), "--world", "shop-long", "--slips",
                   "0.5", "--init", str(tmp_path / "shop")] + tiny)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    recipe = sft.policy_recipe(tmp_path / "a")
    assert len(recipe) == 2 and "--world shop-long --slips 0.5" in recipe[1]
    assert "shop-long-policy" in (tmp_path / "a" / "README.md").read_text()
    with pytest.raises(SystemExit):
        shop_command.main(["sft", "--out", str(tmp_path / "c"), "--world", "shop-long"] + tiny)


def test_the_readme_commands_rebuild_a_continued_policy_in_one_directory(tmp_path):
    """As data/shop-long-policy's README does: both commands write one directory, the second
    continuing it in place (--init = --out). Its README's commands, run as written into another
    directory, write the same bytes."""
    tiny = ["--episodes", "6", "--steps", "2", "--batch", "2", "--hidden", "16", "--layers",
            "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "32", "--vocab", "300",
            "--threads", "1", "--induction-steps", "2"]
    c, d = tmp_path / "c", tmp_path / "d"
    shop_command.main(["sft", "--out", str(c), "--eval-episodes", "0"] + tiny)
    shop_command.main(["sft", "--out", str(c), "--world", "shop-long", "--slips", "0.5", "--init",
               str(c), "--eval-episodes", "0"] + tiny)
    recipe = sft.policy_recipe(c)
    assert len(recipe) == 2 and f"--out {c} " in recipe[1] and f"--init {c} " in recipe[1]
    for line in recipe:
        argv = shlex.split(line.replace(str(c), str(d)))
        assert argv[:4] == ["python", "-m", "lab.shop", "sft"], line
        shop_command.main(argv[3:] + ["--eval-episodes", "0"])      # evaluation writes no weights
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (c / f).read_bytes() == (d / f).read_bytes(), f


class _Stop(Exception):
    pass


def test_sft_resumed_after_a_stop_writes_the_same_bytes(tmp_path, monkeypatch):
    """A run stopped right after a checkpoint (in the induction phase, and in the dialog phase)
    and resumed writes the uninterrupted run's policy, byte for byte; other flags are refused."""
    tiny = ["--episodes", "6", "--steps", "4", "--batch", "2", "--hidden", "16", "--layers", "1",
            "--heads", "2", "--kv-heads", "1", "--intermediate", "32", "--vocab", "300",
            "--eval-episodes", "0", "--threads", "1", "--induction-steps", "3",
            "--save-every", "2"]
    shop_command.main(["sft", "--out", str(tmp_path / "a")] + tiny)
    save = sft.save_sft_checkpoint
    for stop in (2, 4, 6):          # checkpoints after 2 induction steps, 1 and 3 dialog steps
        out = tmp_path / f"stop{stop}"

        def save_then_stop(path, args, done, *rest):
            save(path, args, done, *rest)
            if done == stop:
                raise _Stop

        monkeypatch.setattr(sft, "save_sft_checkpoint", save_then_stop)
        with pytest.raises(_Stop):
            shop_command.main(["sft", "--out", str(out)] + tiny)
        monkeypatch.setattr(sft, "save_sft_checkpoint", save)
        assert json.loads((out / "sft-checkpoint" / "trainer.json").read_text())["done"] == stop
        with pytest.raises(SystemExit):         # not started over by accident
            shop_command.main(["sft", "--out", str(out)] + tiny)
        with pytest.raises(SystemExit, match="--lr 0.001 \\(was 0.003\\)"):
            shop_command.main(["sft", "--out", str(out), "--resume", "--lr", "0.001"] + tiny)
        shop_command.main(["sft", "--out", str(out), "--resume"] + tiny)
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (out / f).read_bytes() == (tmp_path / "a" / f).read_bytes(), (stop, f)
        assert not (out / "sft-checkpoint").exists()
    with pytest.raises(SystemExit, match="cannot resume"):
        shop_command.main(["sft", "--out", str(tmp_path / "none"), "--resume"] + tiny)


def test_episodes_deterministic_and_splits_disjoint():
    a, b = envs.ShopEnv("train", seed=5, episodes=50), envs.ShopEnv("train", seed=5, episodes=50)
    assert [a.episode(i).task for i in range(50)] == [b.episode(i).task for i in range(50)]
    assert a.episode(a.ids[7]).task == a.episode(7).task
    test = envs.ShopEnv("test", seed=5, episodes=50)
    assert not set(a.ids) & set(test.ids)
    worlds = {tuple(sorted(env.episode(i).task.prices.items())) for env in (a, test)
              for i in range(50)}
    assert len(worlds) == 100
    seeds = lambda split, seed: {envs.shop_episode_seed(split, seed, i)  # noqa: E731
                                 for i in (0, 1, envs.SHOP_SPLIT_SIZE[split] - 1)}
    for x, y in (("train", "val"), ("val", "test"), ("train", "test")):
        assert not seeds(x, 5) & seeds(y, 5)
    assert not seeds("test", 5) & seeds("train", 6)
    val = envs.ShopEnv("val", seed=5, episodes=50)
    assert not set(val.ids) & (set(a.ids) | set(test.ids))
    assert shop.shop_task_from_id(val.ids[3]) == val.episode(3).task
    with pytest.raises(ValueError, match="unknown split"):
        envs.ShopEnv("dev")
    with pytest.raises(KeyError, match="no episode"):
        a.episode("shop-5-test-0")


def test_make_data_is_byte_for_byte_deterministic(data, tmp_path):
    assert sorted(p.name for p in data.iterdir()) == sorted(FILES)
    shopdata.make_shop_data(tmp_path, episodes=60, seed=7)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (data / name).read_bytes(), name
    shopdata.make_shop_data(tmp_path / "other", episodes=60, seed=8)
    assert (tmp_path / "other" / "clean_train.json").read_bytes() != \
        (data / "clean_train.json").read_bytes()
    with pytest.raises(ValueError, match="--episodes 1"):
        shopdata.make_shop_data(tmp_path, episodes=1)
    # past the train seeds' range: refused at once (it ran for hours before the range check)
    with pytest.raises(ValueError, match="--episodes 1000000000000: 2 to 4,500,000"):
        shopdata.make_shop_data(tmp_path / "huge", episodes=10**12)
    assert not (tmp_path / "huge").exists()


def test_make_data_says_what_it_wrote_in_the_users_file_mode(tmp_path, capsys, monkeypatch):
    shop_command.main(["make-data", "--out", str(tmp_path / "a"), "--episodes", "10"])
    out = capsys.readouterr().out
    assert f"10 episodes (seed 42) -> {tmp_path / 'a'}" in out
    assert re.search(r"clean_train\.json +8 episodes", out), out
    assert re.search(r"matched_diagnostic_test\.json +\d+ turn records", out), out
    umask = os.umask(0)
    os.umask(umask)
    assert {(p.stat().st_mode & 0o777) for p in (tmp_path / "a").iterdir()} == {0o666 & ~umask}
    os.umask(0o027)                                 # a group-readable umask is honoured too
    try:
        shopdata.make_shop_data(tmp_path / "b", episodes=2)
    finally:
        os.umask(umask)
    assert {(p.stat().st_mode & 0o777) for p in (tmp_path / "b").iterdir()} == {0o640}


def test_make_data_files_load_and_split_80_20(data):
    for split, n in (("train", 48), ("test", 12)):
        clean = envs.load_episodes(data / f"clean_{split}.json")
        cont = released.load_released_episodes(data / f"contaminated_{split}.json")
        assert list(clean) == list(cont) == [f"shop-7-{split}-{i}" for i in range(n)]
        for fam in ("clean", "contaminated"):
            records = released.load_matched(data / f"matched_{fam}_{split}.json")
            assert all(r["tools"] == envs.SHOP_TOOLS for r in records)
        for eid, rec in clean.items():
            task = shop.shop_task_from_id(eid)
            assert rec["dialogs"] == shopdata.shop_gold(task)[0]
            assert rec["gt_answer"] == {"whitelist": [[task.answer]], "blacklist": None}
    assert len(released.load_matched(data / "matched_diagnostic_test.json")) == 24


def test_contamination_follows_the_paper_procedure(data):
    kinds = collections.Counter()
    for split in ("train", "test"):
        clean = load(data, f"clean_{split}.json")
        for eid, rec in load(data, f"contaminated_{split}.json").items():
            task = shop.shop_task_from_id(eid)
            gold, cont = clean[eid]["dialogs"], rec["dialogs"]
            idx = rec["contaminated_turn_indices"]
            assert 1 <= len(idx) <= 2 and idx == sorted(set(idx))
            assert idx[-1] < len(cont) - 1                  # never the evaluation (last) turn
            assert [i for i in range(len(gold)) if gold[i] != cont[i]] == idx  # downstream kept
            assert rec["original_turn_contents"] == [gold[i] for i in idx]
            labels = shopdata.shop_dialog_labels(task, cont)
            assert [labels[(i - 1) // 2] for i in idx] == [False] * len(idx)
            for i, kind in zip(idx, rec["contamination_types"]):
                kinds[kind] += 1
                old_thought, old_call, _ = envs.assistant_parts(gold[i])
                thought, call, _ = envs.assistant_parts(cont[i])
                if kind == "tool_misuse":
                    assert thought == old_thought and call != old_call
                elif kind == "reasoning_error" and old_call["name"] != "Calculator":
                    assert call == old_call and thought != old_thought
                elif kind == "observation_misinterpretation":
                    # the thought restates the previous observation's fact with another number
                    fact, number = NUMBER.search(envs.tool_result_text(cont[i - 1])).groups()
                    said = NUMBER.search(thought)
                    assert said.group(1) == fact and said.group(2) != number
                elif kind == "stale_memory":
                    earlier = {NUMBER.search(envs.tool_result_text(m)).group(2)
                               for m in gold[:i - 1] if m["role"] == "tool"
                               and m["name"] == "Lookup"}
                    new = collections.Counter(re.findall(r"\d+\.\d+", thought)) - \
                        collections.Counter(re.findall(r"\d+\.\d+", old_thought))
                    assert new and set(new) <= earlier
    assert set(kinds) == set(released.CONTAMINATION_TYPES), kinds


def test_a_rewrite_right_by_coincidence_falls_back_to_another_kind():
    # 6 bread at A costs 1.20 USD: the reasoning error "6+1.20" equals 6*1.20, so no
    # reasoning_error rewrite of the Calculator turn is an error; make-data shop --seed 43 used
    # to stop here. Every rng draw that picks reasoning_error for that turn must fall back.
    task = envs.shop_task(430001751)
    gold, turns = shopdata.shop_gold(task)
    assert task.lines == ((6, "bread", "A"),) and task.currency == "USD"
    picked = 0
    for seed in range(40):
        rng = random.Random(seed)
        dialog, idx, kinds, _ = shopdata.shop_contaminate(task, gold, turns, rng)
        labels = shopdata.shop_dialog_labels(task, dialog)
        assert [labels[(i - 1) // 2] for i in idx] == [False] * len(idx)
        picked += idx == [3]
    assert picked                           # the coincidental turn was drawn and rewritten


def test_matched_records_mirror_the_release_and_labels_resimulate(data):
    for split in ("train", "test"):
        cont_eps = load(data, f"contaminated_{split}.json")
        clean_eps = load(data, f"clean_{split}.json")
        pairs = zip(load(data, f"matched_clean_{split}.json"),
                    load(data, f"matched_contaminated_{split}.json"))
        seen = collections.defaultdict(list)
        for c, x in pairs:
            eid, t = c["episode_id"], c["turn_idx"]
            ep = cont_eps[eid]
            idx = ep["contaminated_turn_indices"]
            assert (x["episode_id"], x["turn_idx"]) == (eid, t)
            assert c["prefix_type"] == "clean" and x["prefix_type"] == "contaminated"
            assert c["dialogs"][-1] == x["dialogs"][-1] == ep["dialogs"][t]
            assert c["dialogs"][:-1] == clean_eps[eid]["dialogs"][:t]
            assert x["dialogs"] == ep["dialogs"][:t + 1]
            for r in (c, x):
                assert r["original_contaminated_turn_indices"] == idx
                assert r["has_contaminated_prefix"] == any(i < t for i in idx)
                want = dict(zip(idx, ep["contamination_types"])).get(t)
                assert r["contamination_type"] == want
                task = shop.shop_task_from_id(eid)
                assert r["label"] == int(shopdata.shop_dialog_labels(task, r["dialogs"])[-1])
            assert c["label"] == x["label"] == int(t not in idx)
            seen[eid].append(t)
        # one record per assistant turn of every episode, in order
        assert seen == {eid: list(range(1, len(ep["dialogs"]), 2))
                        for eid, ep in cont_eps.items()}


def test_contaminated_dialog_labels_match_episode_replay(data):
    # Stepping a contaminated dialog's texts through the environment gives the same labels:
    # the labeler reads what the policy wrote, never the recorded observations.
    for eid, rec in list(load(data, "contaminated_test.json").items())[:12]:
        task = shop.shop_task_from_id(eid)
        ep = envs.ShopEpisode(eid, task)
        for m in rec["dialogs"]:
            if m["role"] == "assistant":
                ep.step(envs.render_assistant(m))
        assert ep.labels() == shopdata.shop_dialog_labels(task, rec["dialogs"])


def test_diagnostic_set(data):
    records = load(data, "matched_diagnostic_test.json")
    clean = load(data, "clean_test.json")
    cont = load(data, "contaminated_test.json")
    assert load(data, "diagnostic_test.json") == clean
    assert [r["diagnostic"] for r in records] == \
        ["consistent_incorrect", "inconsistent_correct"] * len(clean)
    for wrong, repair in zip(records[::2], records[1::2]):
        eid, j = wrong["episode_id"], cont[wrong["episode_id"]]["contaminated_turn_indices"][0]
        task = shop.shop_task_from_id(eid)
        assert wrong["turn_idx"] == repair["turn_idx"] == j + 2
        assert (wrong["label"], wrong["prefix_type"], wrong["has_contaminated_prefix"]) == \
            (0, "clean", False)
        assert wrong["dialogs"][:-1] == clean[eid]["dialogs"][:j + 2]
        assert (repair["label"], repair["prefix_type"], repair["has_contaminated_prefix"]) == \
            (1, "contaminated", True)
        assert repair["dialogs"][:j + 1] == cont[eid]["dialogs"][:j + 1]
        # the contaminated call's observation is its true result
        _, call, _ = envs.assistant_parts(repair["dialogs"][j])
        assert envs.tool_result_text(repair["dialogs"][j + 1]) == \
            envs.shop_execute(task, call["name"], call["arguments"]).text
        for r in (wrong, repair):
            assert r["label"] == int(shopdata.shop_dialog_labels(task, r["dialogs"])[-1])
        # consistent: the wrong turn restates the last observation truly and fetches a fact
        # the task does not need (or already has); the repair redoes what the prefix got wrong
        thought, call, _ = envs.assistant_parts(wrong["dialogs"][-1])
        assert call["name"] in ("Lookup", "Rate")
        fact = envs.shop_execute(task, call["name"], call["arguments"]).fact
        known, computed, _ = shopdata._shop_state(task, wrong["dialogs"][:-1])
        assert fact not in task.needed or fact in known
        assert envs.shop_thought_true(task, thought.split("I need")[0], known, computed)


def test_make_data_is_fast(tmp_path):
    import time
    start = time.perf_counter()
    counts = shopdata.make_shop_data(tmp_path, episodes=200, seed=1)
    assert time.perf_counter() - start < 5.0
    assert counts["clean_train.json"] == 160 and counts["clean_test.json"] == 40


def test_cli_make_data_matches_the_library(tmp_path):
    # Another process with another hash seed: nothing may depend on set or dict hashing order.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    cli = [sys.executable, "-m", "lab.shop", "make-data", "--episodes", "30",
           "--seed", "9"]
    subprocess.run(cli + ["--out", str(tmp_path / "cli")], check=True, env=env, cwd=tmp_path)
    shopdata.make_shop_data(tmp_path / "lib", episodes=30, seed=9)
    for name in FILES:
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "lib" / name).read_bytes()
    bad = subprocess.run(cli[:4] + ["--episodes", "1", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode != 0 and "--episodes 1" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_cli_help_says_what_every_flag_does():
    for args, flags in (([], ["make-data", "sft"]), (["make-data"], ["--out", "--episodes"]),
                        (["sft"], ["--init", "--divided", "--induction-steps", "--threads"])):
        out = subprocess.run([sys.executable, "-m", "lab.shop", *args, "--help"],
                             capture_output=True, text=True, check=True, cwd=ROOT,
                             env=dict(os.environ, COLUMNS="200")).stdout
        assert out.startswith("usage: python -m lab.shop")
        for flag in flags:      # the flag (and its metavar), then its help text
            assert re.search(rf"^ +{flag}( [A-Z_]+)?\s+[a-z(]", out, re.M), (args, flag)


def test_make_dispatches_to_shop():
    env = envs.ShopEnv("train", seed=3, episodes=5)
    assert isinstance(env, envs.ShopEnv) and len(env) == 5
    assert env.ids == [f"shop-3-train-{i}" for i in range(5)]
    assert env.episode(4).task == shop.shop_task_from_id("shop-3-train-4")


# ---------------------------------------------------------------------------------------------
# the built-in policy (sft): deterministic training, loadable output

def test_sft_is_deterministic_and_loadable(tmp_path):
    tiny = ["--episodes", "10", "--steps", "3", "--batch", "2", "--hidden", "16", "--layers",
            "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "32", "--vocab", "300",
            "--eval-episodes", "0", "--threads", "1", "--induction-steps", "3"]
    for name in ("a", "b"):
        shop_command.main(["sft", "--out", str(tmp_path / name)] + tiny)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):   # README: timings
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    policy, tok = mdl.load_model(tmp_path / "a")
    assert policy.config.arch == "Qwen2ForCausalLM" and policy.config.tie_word_embeddings
    assert tok.decode(tok.encode("<|im_start|>user\n3 apple<|im_end|>")) == \
        "<|im_start|>user\n3 apple<|im_end|>"
    assert "python -m lab.shop sft --out" in (tmp_path / "a" / "README.md").read_text()
    # sft writes, by default, what grpo.py trains by default; each world its own policy
    assert grpo.parse_args(["--out", "x"]).model == str(envs.BUILTIN_POLICY)
    assert lab_train.parse_args(["--out", "x", "--env", "shop-long"]).model == \
        str(shop.LONG_WORLD.policy)


def test_sft_divided_replaces_only_clean_non_usd_dialogs():
    base = shop_command.sft_dialogs(20, 0.3, seed=1)
    assert shop_command.sft_dialogs(20, 0.3, seed=1, divided=0.0) == base     # nothing else moves
    habit = shop_command.sft_dialogs(20, 0.3, seed=1, divided=1.0)
    changed = 0
    for before, after in zip(base, habit):
        if before == after:
            continue
        changed += 1
        assert not before[0]["content"].split("\n")[0].endswith("in USD?")
        calcs = [m["content"] for m in after
                 if m["role"] == "assistant" and "Action: Calculator" in m["content"]]
        assert len(calcs) == 1 and "/" in calcs[0].split("Action Input:")[1]
    assert changed >= 5         # ~70% clean x ~80% non-USD of 16 training dialogs


def test_sft_continues_a_saved_policy_with_its_tokenizer(tmp_path):
    tiny = ["--episodes", "10", "--steps", "2", "--batch", "2", "--hidden", "16", "--layers",
            "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "32", "--vocab", "300",
            "--eval-episodes", "0", "--threads", "1", "--induction-steps", "2"]
    shop_command.main(["sft", "--out", str(tmp_path / "a")] + tiny)
    shop_command.main(["sft", "--out", str(tmp_path / "b"), "--init", str(tmp_path / "a"),
               "--divided", "0.7"] + tiny)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == \
        (tmp_path / "b" / "tokenizer.json").read_bytes()
    a, _ = mdl.load_model(tmp_path / "a")
    b, _ = mdl.load_model(tmp_path / "b")
    assert a.config == b.config
    moved = [k for k, v in a.state_dict().items() if not torch.equal(v, b.state_dict()[k])]
    assert moved                                    # it trained ...
    readme = (tmp_path / "b" / "README.md").read_text()
    recipe = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    assert len(recipe) == 2 and f"--out {tmp_path / 'a'}" in recipe[0]   # ... and says from what
    assert f"--init {tmp_path / 'a'}" in recipe[1] and "--divided 0.7" in recipe[1]
    # --divided applies to the dialogs not contaminated only (sft_dialogs), and it says so
    assert "dialogs, where, of those not contaminated, 70% of the non-USD ones" in readme


# A bad flag of sft, after tiny valid ones (so that a run that wrongly starts is short): each is
# refused in one line naming the flag, before a policy is written.
_TINY_SFT = ["--episodes", "6", "--steps", "2", "--batch", "2", "--hidden", "16", "--layers", "1",
             "--heads", "2", "--kv-heads", "1", "--intermediate", "32", "--vocab", "300",
             "--eval-episodes", "0", "--threads", "1", "--induction-steps", "2",
             "--save-every", "0"]


@pytest.mark.parametrize("bad", [
    "--batch 0", "--batch 6", "--heads 3", "--hidden 6", "--kv-heads 3", "--hidden 0", "--lr nan",
    "--lr 0", "--episodes 1", "--steps -1", "--steps 0", "--contaminated 2", "--divided -1",
    "--vocab 0", "--warmup -5", "--warmup 0", "--save-every -1", "--induction-rows -1",
    "--induction-text 5", "--induction-text nan", "--threads -1", "--threads CORES+1",
    "--seed -1", "--eval-episodes -1", "--init FILE", "--init EMPTY", "--init BROKEN"])
def test_sft_refuses_a_bad_flag_before_writing_a_policy(bad, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    flag, value = bad.split()
    value = {"FILE": str(tmp_path / "file"), "EMPTY": str(tmp_path / "empty"),
             "BROKEN": str(tmp_path / "broken"),
             "CORES+1": str((os.cpu_count() or 1) + 1)}.get(value, value)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        shop_command.main(["sft", "--out", str(out)] + _TINY_SFT + [flag, value])
    said = f"{e.value.code}\n{capsys.readouterr().err}"
    assert flag in said and "Traceback" not in said, said
    assert not (out / "model.safetensors").exists() and not (out / "README.md").exists()


def test_make_data_refuses_a_file_as_out(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit, match="--out"):
        shop_command.main(["make-data", "--out", str(tmp_path / "f"), "--episodes", "4"])
    assert (tmp_path / "f").read_text() == "x"


# ---------------------------------------------------------------------------------------------
# the probes of the built-in world: the on-policy corpus

def test_on_policy_corpus_labels_are_the_worlds():
    policy, tok = mdl.load_model(BUILTIN)
    env = envs.ShopEnv("train")
    play = argparse.Namespace(max_turns=10, max_new_tokens=96, max_len=4096, temperature=1.0,
                              top_p=1.0)
    trajs = probes.rollout(policy, tok, [env.episode(i) for i in (0, 0, 1, 2, 3, 3)], play,
                           generator=torch.Generator().manual_seed(1))
    split = onpolicy.turn_records(trajs)
    labels = [ok for traj in trajs for ok in traj.episode.labels()]
    assert split.y.tolist() == [int(ok) for ok in labels]
    assert 0 < sum(labels) < len(labels)            # the built-in policy gets some turns wrong
    # distance: assistant turns back to the nearest earlier wrong turn of the same rollout
    k = 0
    for traj in trajs:
        last_wrong = None
        for t, ok in enumerate(traj.episode.labels()):
            want = -1 if last_wrong is None else t - last_wrong
            assert split.raw["distance"][k] == want and split.raw["turn_idx"][k] == t
            assert split.episode_id[k] == traj.episode.id
            last_wrong = t if not ok else last_wrong
            k += 1
    first = probes.raw_features(trajs[0].steps[0].trace)
    for key, v in first.items():
        assert torch.equal(split.raw[key][0], v), key
    # kind: one code per turn_kind, the same code for the same kind
    kinds = [onpolicy.turn_kind(s.text) for traj in trajs for s in traj.steps]
    assert "Lookup" in kinds
    codes = dict(zip(kinds, split.raw["kind"].tolist()))
    assert [codes[k] for k in kinds] == split.raw["kind"].tolist()
    assert len(set(codes.values())) == len(codes)


def test_the_probe_corpora_say_what_they_do_before_their_silent_parts(monkeypatch):
    # the first call of a process compiles the decoding step (a minute without a line): a line
    # right after it; the contaminated corpus says what it does before tracing (~20 s)
    policy, tok = mdl.load_model(BUILTIN)
    lines = []

    def log(line, **kw):
        lines.append(line)
    monkeypatch.setattr(onpolicy, "rollout", lambda p, t, batch, *a, **k: [None] * len(batch))
    monkeypatch.setattr(onpolicy, "turn_records", lambda trajs: trajs)
    onpolicy.sample_own_turns(policy, tok, envs.ShopEnv("val"), 20, 2, None, 0, log)
    assert re.fullmatch(r"  16/40 rollouts of val episodes, the first 16 in \d+s .*", lines[0])
    lines.clear()
    monkeypatch.setattr(traces, "trace_batch", lambda *a: lines.append("traced") or [])
    monkeypatch.setattr(probes, "stack_raw", lambda raws: {})
    onpolicy.contaminated_corpus(policy, tok, 3, log)
    assert lines[0].startswith("  contaminated corpus: `python -m lab.shop make-data "
                               "--episodes 3`") and \
        lines[1] == "traced" and lines[2].endswith("s")


def test_contaminated_corpus_is_the_recipes_training_set_of_every_traced_record(tmp_path):
    # the corpus picks its records from labels before tracing: the same rows, in the same order,
    # as detection.training_set on both matched train splits traced whole, one record at a time
    policy, tok = mdl.load_model(BUILTIN)
    got = onpolicy.contaminated_corpus(policy, tok, 3, lambda *a, **k: None)
    shopdata.make_shop_data(tmp_path, episodes=3, seed=onpolicy.PROBE_SEED)
    splits = {}
    for name in detection.TRAIN_SPLITS["mixed"]:
        recs = released.load_matched(tmp_path / f"{name}.json")
        raws = []
        for r in recs:
            ids, span, _ = features.render_record(r, tok)
            raws.append(probes.raw_features(traces.trace_forward(policy, ids, span)))
        raw = probes.stack_raw(raws)
        raw["turn_idx"] = torch.tensor([int(r["turn_idx"]) for r in recs])
        splits[name] = detection.Split(name, raw, torch.tensor([int(r["label"]) for r in recs]),
                                       [str(r["episode_id"]) for r in recs], {})
    want = detection.training_set(splits, "mixed", onpolicy.PROBE_SEED)
    assert len(got.y) < sum(len(s.y) for s in splits.values())     # not every record is kept
    assert torch.equal(got.y, want.y) and got.keys() == want.keys()
    assert 0 < int(got.y.sum()) < len(got.y)
    for key in want.raw:
        torch.testing.assert_close(got.raw[key], want.raw[key], atol=1e-5, rtol=1e-4)


def test_kind_balanced_indices_balance_every_kind_that_has_both_classes():
    # kind 0: 5 right, 1 wrong; kind 1: 1 right, 3 wrong; kind 2: 2 wrong only
    y = torch.tensor([1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0])
    kind = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    idx = onpolicy.kind_balanced_indices(y, kind, seed=3)
    assert torch.equal(idx, onpolicy.kind_balanced_indices(y, kind, seed=3))     # seeded
    for k, (right, wrong) in {0: (5, 5), 1: (3, 3), 2: (0, 2)}.items():
        got = y[idx][kind[idx] == k]
        assert (int(got.sum()), int((got == 0).sum())) == (right, wrong), k
    assert set(idx.tolist()) == set(range(12))      # every turn kept, minorities drawn again
    assert idx[kind[idx] == 0].tolist().count(5) == 5


def test_heldout_auroc_reports_each_habit_at_its_own_turn_with_a_clean_prefix(monkeypatch):
    ids = {k: f"shop-long-42-test-{k}" for k in range(6)}
    # test-0: forget at turn 7; 1: store at 0; 2, 3, 5: divided at 7; 4: store at 0, forget at 7
    assert [shop.slip_turns(shop.shop_task_from_id(ids[k])) for k in (0, 1, 2, 4)] == \
        [{"forget": 7}, {"store": 0}, {"divided": 7}, {"store": 0, "forget": 7}]
    rows = [  # (episode, turn, right, distance to an earlier wrong turn, P(correct))
        (1, 0, 1, -1, 0.3), (4, 0, 0, -1, 0.6),     # store: the slip ranked above the right turn
        (4, 1, 0, 1, 0.1), (4, 7, 0, 7, 0.1),       # after the slip: not the forget decision
        (0, 7, 1, -1, 0.5), (0, 0, 1, -1, 0.9),     # forget made right; a turn no habit is at
        (2, 7, 0, -1, 0.2), (3, 7, 1, -1, 0.8), (5, 7, 1, -1, 0.7)]        # divided: ranked
    episode, turn, y, distance, p = zip(*rows)
    nll = torch.tensor([1.0, 0.2, 0.5, 0.5, 0.4, 0.1, 0.95, 0.9, 0.6])     # each turn -log pi
    raw = {"turn_idx": torch.tensor(turn), "distance": torch.tensor(distance),
           "kind": torch.zeros(len(rows), dtype=torch.long), "nll": nll}
    split = detection.Split("own_turns", raw, torch.tensor(y), [ids[k] for k in episode],
                            {"kinds": ["Calculator"]})
    p = torch.tensor(p)
    monkeypatch.setattr(onpolicy.detection, "predict", lambda m, raw: p)
    got = onpolicy.heldout_auroc({"pair": object()}, split)
    assert got["pair"]["slip=store"] == 0.0 and got["n"]["slip=store"] == 2
    assert got["pair"]["slip=forget"] is None and got["n"]["slip=forget"] == 1     # one class
    assert got["pair"]["slip=divided"] == 1.0 and got["n_correct"]["slip=divided"] == 2
    y = torch.tensor(y)
    for group, sel in {"all": slice(None), "kind=Calculator": slice(None),
                       "clean_prefix": torch.tensor(distance) < 0}.items():
        assert got["pair"][group] == pytest.approx(probes.auroc(y[sel], p[sel])), group
        assert got["confidence"][group] == pytest.approx(probes.auroc(y[sel], -nll[sel])), group
    # no probe: the confident slip ranks above the right turn; the divided slip is the unsure one
    assert got["confidence"]["slip=store"] == 0.0 and got["confidence"]["slip=divided"] == 1.0


def test_slip_turns_are_where_each_slipped_dialog_is_first_labelled_wrong():
    for world in ("shop-long", "shop"):
        env, seen = envs.ShopEnv("val", world=shop.WORLDS[world]), collections.Counter()
        for i in range(40):
            task = env.episode(i).task
            for slip, turn in shop.slip_turns(task).items():
                dialog = shop.long_dialog(task, (slip,)) if world == "shop-long" else \
                    shopdata.shop_divided(task)
                labels = shopdata.shop_dialog_labels(task, dialog)
                assert labels.index(False) == turn, (world, i, slip)
                seen[slip] += 1
        assert set(seen) == ({"store", "forget", "divided"} if world == "shop-long" else
                             {"divided"}), seen


def test_the_report_warns_where_the_rewards_probe_favours_a_habit():
    def report(pair_at, probe_at):
        groups = {"all": 0.8, "clean_prefix": 0.8, "contaminated_prefix": 0.9}
        return {"heldout": {"pair": {**groups, **pair_at}, "last_token": {**groups, **probe_at},
                            "confidence": {**groups, "slip=store": 0.0, "slip=divided": 0.1},
                            "n": {"all": 50, "slip=store": 10, "slip=divided": 8},
                            "n_correct": {"all": 30, "slip=store": 4, "slip=divided": 2}},
                "contaminated_corpus_pair": {"all": 0.4}}
    lines = []
    onpolicy.log_report(report({"slip=store": 0.7, "slip=divided": 0.2}, {"slip=store": 0.3,
                                                                          "slip=divided": 0.9}),
                        "pair", lambda line, **kw: lines.append(line))
    text = "\n".join(lines)
    assert "PAIR at the habits' own turns" in text and "store 0.700 (10 turns, 6 wrong)" in text
    assert "confidence" in text and "store 0.000, divided 0.100" in text
    (warning,) = [line for line in lines if "warning" in line]
    assert "the divided slip above the same turn made right (0.200 on 8" in warning
    lines.clear()            # a probe reward: its own probe is judged, not PAIR
    onpolicy.log_report(report({"slip=store": 0.7, "slip=divided": 0.2}, {"slip=store": 0.3,
                                                                          "slip=divided": 0.9}),
                        "last_token", lambda line, **kw: lines.append(line))
    (warning,) = [line for line in lines if "warning" in line]
    assert "the last_token probe ranks the store slip" in warning


def test_generate_plays_a_runs_adapter(tmp_path, capsys):
    # a run's checkpoint is an adapter: lab.generate plays the policy with it. B = 0 changes
    # nothing; a large B changes the greedy reply; a broken adapter is one line naming the flag
    from lab import generate
    prompt = ["--model", str(BUILTIN), "--max-new-tokens", "24", "--prompt",
              "How much do 2 pear at store B cost in total, in USD?"]
    generate.main(prompt)
    base = capsys.readouterr().out
    policy, _ = mdl.load_model(BUILTIN)
    mdl.apply_lora(policy, r=4, alpha=8.0, dropout=0.0)
    mdl.save_adapter(policy, tmp_path / "zero")
    generate.main(prompt + ["--adapter", str(tmp_path / "zero")])
    assert capsys.readouterr().out == base
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in mdl.lora_parameters(policy):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    mdl.save_adapter(policy, tmp_path / "moved")
    generate.main(prompt + ["--adapter", str(tmp_path / "moved")])
    assert capsys.readouterr().out != base
    (tmp_path / "broken").mkdir()
    with pytest.raises(SystemExit, match="^--adapter: .*adapter_config.json: cannot read"):
        generate.main(prompt + ["--adapter", str(tmp_path / "broken")])
