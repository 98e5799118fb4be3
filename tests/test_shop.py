"""The built-in shop world: deterministic data, exact labels, contamination, replay, splits."""
import collections
import json
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import re

import pytest

import envs

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(f"{kind}{part}_{split}.json" for kind in ("", "matched_")
               for part in ("clean", "contaminated") for split in ("train", "test")) + \
    ["diagnostic_test.json", "matched_diagnostic_test.json"]
NUMBER = re.compile(r"(\w+ at store \w|1 USD) (?:costs|=) (\d+\.\d+)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("shop")
    envs.make_shop_data(out, episodes=60, seed=7)
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
        dialog, _ = envs.shop_gold(task)
        assert envs.dialog_to_messages(dialog[:1], envs.SHOP_TOOLS) == ep.messages
        pairs = envs.play_gold(ep, dialog)
        assert pairs and all(recorded == returned for recorded, returned in pairs)
        assert ep.done and ep.score() == 1.0
        assert ep.labels() == [True] * len(ep.steps)
        assert envs.shop_dialog_labels(task, dialog) == ep.labels()
        assert dialog[-1]["content"] == task.answer == f"{float(task.answer):.2f}"
        calls[len(pairs)] += 1
        templates.add(task.text.split()[0])
    assert set(calls) == {2, 3, 4, 5}
    assert templates == {"What", "How", "I"}


def test_divided_dialog_is_the_gold_one_converting_the_wrong_way_round():
    task = hand_task("EUR")             # (3*2.50+2*1.20) USD = 9.90 USD; EUR rate 0.90
    gold, divided = envs.shop_gold(task)[0], envs.shop_divided(task)
    calc = next(i for i, m in enumerate(divided) if m.get("tool_calls") and
                m["tool_calls"][0]["function"]["name"] == "Calculator")
    assert divided[:calc] == gold[:calc]            # the same lookups and rate
    assert divided[calc]["tool_calls"][0]["function"]["arguments"] == \
        {"expression": "(3*2.50+2*1.20)/0.90"}
    assert divided[calc]["thought"].endswith("The total is (3*2.50+2*1.20)/0.90.")
    assert divided[calc + 1]["content"]["content"] == "11.0"
    assert divided[-1]["content"] == "11.00" and divided[-1]["thought"] == \
        "The total is 11.00 EUR."                   # it answers what it computed
    labels = envs.shop_dialog_labels(task, divided)
    assert labels == [True] * (len(labels) - 2) + [False, False]
    ep = envs.ShopEpisode("hand", task)
    envs.play_gold(ep, divided)
    assert ep.score() == 0.0
    assert envs.shop_divided(hand_task("USD")) is None     # nothing to convert


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
    assert envs.shop_task_from_id(val.ids[3]) == val.episode(3).task
    with pytest.raises(ValueError, match="unknown split"):
        envs.ShopEnv("dev")
    with pytest.raises(KeyError, match="no episode"):
        a.episode("shop-5-test-0")


def test_make_data_is_byte_for_byte_deterministic(data, tmp_path):
    assert sorted(p.name for p in data.iterdir()) == sorted(FILES)
    envs.make_shop_data(tmp_path, episodes=60, seed=7)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (data / name).read_bytes(), name
    envs.make_shop_data(tmp_path / "other", episodes=60, seed=8)
    assert (tmp_path / "other" / "clean_train.json").read_bytes() != \
        (data / "clean_train.json").read_bytes()
    with pytest.raises(ValueError, match="--episodes 1"):
        envs.make_shop_data(tmp_path, episodes=1)


def test_make_data_says_what_it_wrote_in_the_users_file_mode(tmp_path, capsys, monkeypatch):
    envs.main(["make-data", "shop", "--out", str(tmp_path / "a"), "--episodes", "10"])
    out = capsys.readouterr().out
    assert f"10 episodes (seed 42) -> {tmp_path / 'a'}" in out
    assert re.search(r"clean_train\.json +8 episodes", out), out
    assert re.search(r"matched_diagnostic_test\.json +\d+ turn records", out), out
    umask = os.umask(0)
    os.umask(umask)
    assert {(p.stat().st_mode & 0o777) for p in (tmp_path / "a").iterdir()} == {0o666 & ~umask}
    monkeypatch.setattr(envs, "_UMASK", 0o027)      # a group-readable umask is honoured too
    envs.make_shop_data(tmp_path / "b", episodes=2)
    assert {(p.stat().st_mode & 0o777) for p in (tmp_path / "b").iterdir()} == {0o640}


def test_make_data_files_load_and_split_80_20(data):
    for split, n in (("train", 48), ("test", 12)):
        clean = envs.load_episodes(data / f"clean_{split}.json")
        cont = envs.load_episodes(data / f"contaminated_{split}.json")
        assert list(clean) == list(cont) == [f"shop-7-{split}-{i}" for i in range(n)]
        for fam in ("clean", "contaminated"):
            records = envs.load_matched(data / f"matched_{fam}_{split}.json")
            assert all(r["tools"] == envs.SHOP_TOOLS for r in records)
        for eid, rec in clean.items():
            task = envs.shop_task_from_id(eid)
            assert rec["dialogs"] == envs.shop_gold(task)[0]
            assert rec["gt_answer"] == {"whitelist": [[task.answer]], "blacklist": None}
    assert len(envs.load_matched(data / "matched_diagnostic_test.json")) == 24


def test_contamination_follows_the_paper_procedure(data):
    kinds = collections.Counter()
    for split in ("train", "test"):
        clean = load(data, f"clean_{split}.json")
        for eid, rec in load(data, f"contaminated_{split}.json").items():
            task = envs.shop_task_from_id(eid)
            gold, cont = clean[eid]["dialogs"], rec["dialogs"]
            idx = rec["contaminated_turn_indices"]
            assert 1 <= len(idx) <= 2 and idx == sorted(set(idx))
            assert idx[-1] < len(cont) - 1                  # never the evaluation (last) turn
            assert [i for i in range(len(gold)) if gold[i] != cont[i]] == idx  # downstream kept
            assert rec["original_turn_contents"] == [gold[i] for i in idx]
            labels = envs.shop_dialog_labels(task, cont)
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
    assert set(kinds) == set(envs.CONTAMINATION_TYPES), kinds


def test_a_rewrite_right_by_coincidence_falls_back_to_another_kind():
    # 6 bread at A costs 1.20 USD: the reasoning error "6+1.20" equals 6*1.20, so no
    # reasoning_error rewrite of the Calculator turn is an error; make-data shop --seed 43 used
    # to stop here. Every rng draw that picks reasoning_error for that turn must fall back.
    task = envs.shop_task(430001751)
    gold, turns = envs.shop_gold(task)
    assert task.lines == ((6, "bread", "A"),) and task.currency == "USD"
    picked = 0
    for seed in range(40):
        rng = envs.random.Random(seed)
        dialog, idx, kinds, _ = envs.shop_contaminate(task, gold, turns, rng)
        labels = envs.shop_dialog_labels(task, dialog)
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
                task = envs.shop_task_from_id(eid)
                assert r["label"] == int(envs.shop_dialog_labels(task, r["dialogs"])[-1])
            assert c["label"] == x["label"] == int(t not in idx)
            seen[eid].append(t)
        # one record per assistant turn of every episode, in order
        assert seen == {eid: list(range(1, len(ep["dialogs"]), 2))
                        for eid, ep in cont_eps.items()}


def test_contaminated_dialog_labels_match_episode_replay(data):
    # Stepping a contaminated dialog's texts through the environment gives the same labels:
    # the labeler reads what the policy wrote, never the recorded observations.
    for eid, rec in list(load(data, "contaminated_test.json").items())[:12]:
        task = envs.shop_task_from_id(eid)
        ep = envs.ShopEpisode(eid, task)
        for m in rec["dialogs"]:
            if m["role"] == "assistant":
                ep.step(envs.render_assistant(m))
        assert ep.labels() == envs.shop_dialog_labels(task, rec["dialogs"])


def test_diagnostic_set(data):
    records = load(data, "matched_diagnostic_test.json")
    clean = load(data, "clean_test.json")
    cont = load(data, "contaminated_test.json")
    assert load(data, "diagnostic_test.json") == clean
    assert [r["diagnostic"] for r in records] == \
        ["consistent_incorrect", "inconsistent_correct"] * len(clean)
    for wrong, repair in zip(records[::2], records[1::2]):
        eid, j = wrong["episode_id"], cont[wrong["episode_id"]]["contaminated_turn_indices"][0]
        task = envs.shop_task_from_id(eid)
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
            assert r["label"] == int(envs.shop_dialog_labels(task, r["dialogs"])[-1])
        # consistent: the wrong turn restates the last observation truly and fetches a fact
        # the task does not need (or already has); the repair redoes what the prefix got wrong
        thought, call, _ = envs.assistant_parts(wrong["dialogs"][-1])
        assert call["name"] in ("Lookup", "Rate")
        fact = envs.shop_execute(task, call["name"], call["arguments"]).fact
        known, computed, _ = envs._shop_state(task, wrong["dialogs"][:-1])
        assert fact not in task.needed or fact in known
        assert envs._shop_thought_true(task, thought.split("I need")[0], known, computed)


def test_make_data_is_fast(tmp_path):
    import time
    start = time.perf_counter()
    counts = envs.make_shop_data(tmp_path, episodes=200, seed=1)
    assert time.perf_counter() - start < 5.0
    assert counts["clean_train.json"] == 160 and counts["clean_test.json"] == 40


def test_cli_make_data_matches_the_library(tmp_path):
    # Another process with another hash seed: nothing may depend on set or dict hashing order.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    cli = [sys.executable, str(ROOT / "envs.py"), "make-data", "shop", "--episodes", "30",
           "--seed", "9"]
    subprocess.run(cli + ["--out", str(tmp_path / "cli")], check=True, env=env, cwd=tmp_path)
    envs.make_shop_data(tmp_path / "lib", episodes=30, seed=9)
    for name in FILES:
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "lib" / name).read_bytes()
    bad = subprocess.run(cli[:4] + ["--episodes", "1", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode != 0 and "--episodes 1" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_make_dispatches_to_shop():
    env = envs.make("shop", split="train", seed=3, episodes=5)
    assert isinstance(env, envs.ShopEnv) and len(env) == 5
    assert env.ids == [f"shop-3-train-{i}" for i in range(5)]
    assert env.episode(4).task == envs.shop_task_from_id("shop-3-train-4")
