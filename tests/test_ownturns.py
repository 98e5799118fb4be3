"""lab/ownturns.py: the labelling rule on hand-made turns and on every gold turn of the released
GTA test split; the prefix's one forward shared by the samples gives the turns and statistics of
runs that prefill it themselves; a killed extraction resumes to the files of an unbroken one."""
import json

import pytest
import torch

import envs
import model as M
import probes
from lab import bench, dryrun, ownturns
from lab.probing import detection

TOOLS = [{"name": name, "description": "", "inputs": []}
         for name in ("OCR", "Calculator", "GoogleSearch")]


def call(name, arguments, thought="I use a tool."):
    return {"role": "assistant", "thought": thought,
            "tool_calls": [{"type": "function",
                            "function": {"name": name, "arguments": arguments}}]}


# the gold dialog: OCR (turn 1), Calculator (turn 3), the answer (turn 5)
RECORD = {"dialogs": [{"role": "user", "content": "What do the two prices on the menu cost?"},
                      call("OCR", {"image": "image/image_1.jpg"}),
                      {"role": "tool", "name": "OCR", "content": "(1, 2, 3, 4) beer 2, wine 4"},
                      call("Calculator", {"expression": "2+4"}),
                      {"role": "tool", "name": "Calculator", "content": "6"},
                      {"role": "assistant", "content": "They cost 6 dollars."}],
          "tools": TOOLS, "files": [{"type": "image", "path": "image/image_1.jpg"}],
          "gt_answer": {"whitelist": [["6"]], "blacklist": None}}


def action(name, arguments):
    return envs.render_action("My reasoning.", name, arguments)


@pytest.mark.parametrize("turn, text, verdict", [
    (1, action("OCR", {"image": "image/image_1.jpg"}), ("call", 1, "gold_call")),
    (1, action("OCR", {"image": "  Image/IMAGE_1.jpg"}), ("call", 1, "gold_call")),
    (1, action("OCR", {"image": "image/image_2.jpg"}), ("call", 0, "unseen_arguments")),
    (1, action("GoogleSearch", {"query": "menu prices"}), ("call", 0, "unseen_arguments")),
    (1, action("WebSearch", {"query": "menu prices"}), ("call", 0, "unavailable_tool")),
    (1, action("Translator", {"text": "beer"}), ("call", 0, "unlisted_tool")),
    (1, action("Calculator", {"expression": "2+4"}), ("call", None, "later_gold_call")),
    (3, action("OCR", {"image": "image/image_1.jpg"}), ("call", 0, "repeated_call")),
    (3, action("Calculator", {"expression": "2+4"}), ("call", 1, "gold_call")),
    (3, action("Calculator", {"expression": "4 + 2.0"}), ("call", 1, "same_value")),
    (3, action("Calculator", {"expression": "2*4"}), ("call", 0, "other_value")),
    (3, action("Calculator", {"expression": "2+"}), ("call", 0, "calculator_error")),
    (3, "Action: Calculator\nAction Input: {expression: 2+4}", ("malformed", 0, "parse_error")),
    (1, "Observation: beer 2, wine 4", ("malformed", 0, "parse_error")),
    (5, envs.render_final("Adding.", "The total is 6."), ("final", 1, "answer_match")),
    (5, envs.render_final("Adding.", "The total is 8."), ("final", 0, "answer_mismatch")),
    (1, envs.render_final(None, "6"), ("final", 1, "answer_match")),
    (5, action("GoogleSearch", {"query": "2+4"}), ("call", 0, "unseen_arguments")),
])
def test_the_labelling_rule_on_hand_made_turns(turn, text, verdict):
    got = ownturns.label_turn(text, RECORD, turn)
    assert (got.kind, got.label, got.reason) == verdict


def test_a_final_answer_without_a_reference_is_undecided():
    record = dict(RECORD, gt_answer=None)
    got = ownturns.label_turn(envs.render_final(None, "6"), record, 5)
    assert (got.kind, got.label, got.reason) == ("final", None, "no_reference:no_answer")
    # a call is still labelled: the rule reads the gold dialog, not the reference
    assert ownturns.label_turn(action("OCR", {"image": "image/image_2.jpg"}), record, 1).label == 0


def test_every_gold_turn_of_the_released_test_split_is_right_or_undecided(release_dir):
    env = envs.GTAEnv("test", release_dir, match="loose")
    verdicts = []
    for key in env.ids:
        record = env.records[key]
        for t, message in enumerate(record["dialogs"]):
            if message["role"] == "assistant":
                verdicts.append(ownturns.label_turn(envs.render_assistant(message), record, t))
    undecided = [v for v in verdicts if v.label is None]
    assert all(v.label == 1 for v in verdicts if v.label is not None)
    assert all(v.kind == "final" and v.reason.startswith("no_reference") for v in undecided)
    assert sum(v.kind == "call" for v in verdicts) == 127 and len(verdicts) == 177


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """Random weights of a toy Qwen2 trunk with the real Qwen2.5 tokenizer (lab/dryrun.py's)."""
    from conftest import QWEN_TOKENIZER
    if not (QWEN_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"Qwen2.5 tokenizer not found at {QWEN_TOKENIZER}")
    out = tmp_path_factory.mktemp("tiny-qwen")
    torch.manual_seed(0)
    dryrun.write_checkpoint(bench.shape_config("tiny"), torch.float32, QWEN_TOKENIZER,
                            M.Tokenizer.from_file(QWEN_TOKENIZER), out)
    return out


def test_the_shared_prefill_gives_the_turns_of_runs_that_prefill_alone(tiny_qwen, one_thread):
    net, tok = M.load_model(tiny_qwen)
    ids = tok.render([{"role": "user", "content": "Count the apples in image/image_1.jpg."}],
                     add_generation_prompt=True)[0]
    k, n = 3, 12
    shared = ownturns.own_turns(net, tok, ids, k, n, torch.Generator().manual_seed(7))
    # each run prefills the whole prompt itself: the k sampled rows in one call of generate,
    # drawing from the same generator; the greedy one alone
    sampled = probes.generate(net, net.new_cache(k), [ids] * k, n, 1.0, stop_ids=[tok.im_end_id],
                              generator=torch.Generator().manual_seed(7))
    greedy = probes.generate(net, net.new_cache(1), [ids], n, 0.0, stop_ids=[tok.im_end_id])
    alone = sampled + greedy
    assert len(shared) == k + 1
    assert len({tuple(t.tokens) for t in shared[:k]}) > 1          # k draws, not one k times
    for a, b in zip(shared, alone):
        assert a.tokens == b.tokens and a.span == b.span and a.finished == b.finished
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(a.h_mean, b.h_mean, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.h_last, b.h_last, atol=1e-4, rtol=1e-4)
        for stat in M.STATS:
            torch.testing.assert_close(a.attn_stats[stat], b.attn_stats[stat], atol=1e-4, rtol=1e-4)


def run_extract(model_dir, data_dir, out, extra=()):
    ownturns.main(["extract", "--model", str(model_dir), "--data-dir", str(data_dir),
                   "--split", "test", "--out", str(out), "--episodes", "2", "--k", "2",
                   "--max-new-tokens", "6", "--shard-size", "1", *extra])


def test_a_killed_extraction_resumes_to_the_files_of_an_unbroken_one(
        tiny_qwen, release_dir, tmp_path, monkeypatch, one_thread, capsys):
    run_extract(tiny_qwen, release_dir, tmp_path / "whole")
    write_shard = ownturns.write_shard
    written = []

    def killed_after_two(parts, rows, strings):
        if len(written) == 2:
            raise KeyboardInterrupt             # as a kill between two shards
        write_shard(parts, rows, strings)
        written.append(1)

    monkeypatch.setattr(ownturns, "write_shard", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        run_extract(tiny_qwen, release_dir, tmp_path / "resumed")
    assert not (tmp_path / "resumed" / "own_turns.safetensors").exists()
    monkeypatch.setattr(ownturns, "write_shard", write_shard)
    capsys.readouterr()
    run_extract(tiny_qwen, release_dir, tmp_path / "resumed")
    assert "2 prefixes already done" in capsys.readouterr().err

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    names = sorted(p.relative_to(whole) for p in whole.rglob("*") if p.is_file()
                   and p.name != ".lock")
    assert names == sorted(p.relative_to(resumed) for p in resumed.rglob("*") if p.is_file()
                           and p.name != ".lock")
    assert len([n for n in names if n.name.startswith("shard_")]) >= 4
    for name in names:
        assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name

    summary = json.loads((whole / "summary.json").read_text())
    turns = [json.loads(line) for line in (whole / "turns.jsonl").read_text().splitlines()]
    assert len(turns) == summary["turns"] == 3 * summary["prefixes"]
    assert summary["labelled"] + summary["undecided"] == summary["turns"]
    assert [t["greedy"] for t in turns[:3]] == [False, False, True]

    # the labelled turns read back as a study features file
    raw, meta = detection.load_features(whole / "own_turns.safetensors")
    assert len(raw["label"]) == summary["labelled"] == len(meta["episode_id"])
    assert set(meta["kind"]) <= set(ownturns.KINDS)

    # other arguments on the same output are refused, naming what differs
    with pytest.raises(SystemExit, match="different arguments .*k"):
        ownturns.main(["extract", "--model", str(tiny_qwen), "--data-dir", str(release_dir),
                       "--split", "test", "--out", str(whole), "--episodes", "2", "--k", "3",
                       "--max-new-tokens", "6", "--shard-size", "1"])
