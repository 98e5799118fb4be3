"""lab/ownturns.py: the labelling rule on hand-made turns and on every gold turn of the released
GTA test split; the prefix's one forward shared by the samples gives the turns and statistics of
runs that prefill it themselves; a killed extraction resumes to the files of an unbroken one;
lab/probing/owndetect.py reads the label out of fold, pooled and within prefixes."""
import json

import pytest
import torch

import envs
import model as M
import probes
from lab import bench, dryrun, ownturns
from lab.probing import detection, owndetect

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


def test_a_turn_the_token_budget_cut_is_undecided_unless_its_step_parsed():
    cut = "Thought: First I read the menu, then I add the two prices, which"
    got = ownturns.label_turn(cut, RECORD, 1, finished=False)
    assert (got.kind, got.label, got.reason) == ("malformed", None, "truncated")
    assert ownturns.label_turn(cut, RECORD, 1, finished=True).label == 0
    # the first step is complete before the cut: labelled by what it does
    done = action("OCR", {"image": "image/image_1.jpg"}) + "\nObservation: beer 2, wi"
    got = ownturns.label_turn(done, RECORD, 1, finished=False)
    assert (got.kind, got.label, got.reason) == ("call", 1, "gold_call")


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


def test_besides_samples_other_episodes_than_the_corpora_named(
        tiny_qwen, release_dir, tmp_path, one_thread, capsys):
    run_extract(tiny_qwen, release_dir, tmp_path / "first")
    run_extract(tiny_qwen, release_dir, tmp_path / "more", ["--besides", str(tmp_path / "first")])
    run_extract(tiny_qwen, release_dir, tmp_path / "third",
                ["--besides", str(tmp_path / "first"), str(tmp_path / "more")])

    def episodes(name):
        return {json.loads(line)["episode_id"]
                for line in (tmp_path / name / "turns.jsonl").read_text().splitlines()}

    first, more, third = episodes("first"), episodes("more"), episodes("third")
    assert len(first) == len(more) == len(third) == 2
    assert not first & more and not (first | more) & third
    # what a corpus grown with --besides left out is read back from its manifest
    env = envs.GTAEnv("test", release_dir)
    path = envs.episode_file("gta", "test", release_dir)
    assert ownturns.episodes_sampled(str(tmp_path / "more"), env, "test", path) == more
    # a corpus of another split is refused by name
    train = envs.episode_file("gta", "train", release_dir)
    with pytest.raises(SystemExit, match="--besides .*first.*another split"):
        ownturns.episodes_sampled(str(tmp_path / "first"), env, "train", train)


def test_raise_k_samples_more_turns_where_the_samples_missed_a_class(
        tiny_qwen, release_dir, tmp_path, one_thread, capsys):
    first = tmp_path / "first"
    run_extract(tiny_qwen, release_dir, first)
    turns = [json.loads(line) for line in (first / "turns.jsonl").read_text().splitlines()]
    # The tiny model is never right; relabel as a merge would have: the first prefix's greedy
    # turn right and its samples wrong (to raise), the second's samples both (not to raise).
    prefixes = sorted({t["prefix"] for t in turns})
    for t in turns:
        if t["prefix"] == prefixes[0]:
            t["label"] = int(t["greedy"])
        elif t["prefix"] == prefixes[1]:
            t["label"] = int(t["sample"] == 0)
    (first / "turns.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    raised = tmp_path / "raised"
    run_extract(tiny_qwen, release_dir, raised, ["--raise-k", str(first), "--seed", "1",
                                                 "--k", "3"])

    target = next(t for t in turns if t["prefix"] == prefixes[0])
    new = [json.loads(line) for line in (raised / "turns.jsonl").read_text().splitlines()]
    assert [(t["episode_id"], t["turn_idx"], t["sample"], t["greedy"]) for t in new] == [
        (target["episode_id"], target["turn_idx"], s, False) for s in range(3)]
    manifest = json.loads((raised / "parts" / "manifest.json").read_text())
    assert manifest["raise_k"] == [f"{target['episode_id']}/{target['turn_idx']}"]
    # new draws, not the first extraction's again
    old = [t["text"] for t in turns if t["prefix"] == prefixes[0] and not t["greedy"]]
    assert [t["text"] for t in new][:2] != old
    # the same seed would repeat the turns it raises: refused by name
    with pytest.raises(SystemExit, match="--raise-k .*first.*--seed 0"):
        run_extract(tiny_qwen, release_dir, tmp_path / "again", ["--raise-k", str(first)])


# ---- Detection on own turns ---------------------------------------------------------------------

def synthetic_corpus(path, split, n_episodes, seed, d=6, L=2, H=2,
                     name="own_turns.safetensors"):
    """An own_turns.safetensors (or another features file, `name`) of random features: 3 prefixes an episode, 4 turns each; the
    label is written into h_last4 (every fitted method can read it) and each prefix's difficulty
    into logprob_mean alone (the same for its right and wrong turns)."""
    g = torch.Generator().manual_seed(seed)
    episodes, kinds, rows = [], [], []
    for e in range(n_episodes):
        for t in (1, 3, 5):
            hard = torch.rand((), generator=g)
            for s in range(4):
                y = int(torch.rand((), generator=g) > hard)
                raw = {"h_last4": torch.randn(4, d, generator=g), "h_mean": torch.randn(d, generator=g)}
                raw["h_last4"][:, 0] += 1.5 * y
                for stat in ("max", "std", "prefix", "self", "entropy", "lookback"):
                    raw[f"attn_{stat}"] = torch.rand(L, H, generator=g)
                raw.update(coe_r=torch.randn((), generator=g), coe_c=torch.randn((), generator=g),
                           logprob_mean=-hard, label=torch.tensor(y), turn_idx=torch.tensor(t),
                           greedy=torch.tensor(int(s == 3)))
                rows.append(raw)
                episodes.append(f"{e}")
                kinds.append("final" if t == 5 else ("malformed" if s == 3 else "call"))
    tensors = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    meta = {"split": split, "dtype": "float32", "model_sha256": "x" * 64, "episode_id": episodes,
            "kind": kinds}
    path.mkdir(parents=True, exist_ok=True)
    probes.save_safetensors(tensors, path / name,
                            {"pair_features": json.dumps(meta)})


def test_weighted_auroc_is_the_auroc_of_the_turns_repeated():
    g = torch.Generator().manual_seed(0)
    y = (torch.rand(40, generator=g) > 0.6).long()
    s = torch.randint(0, 6, (40,), generator=g).double()            # ties on purpose
    w = torch.randint(0, 4, (3, 40), generator=g)
    got = owndetect.weighted_auroc(y, s, w)
    for r in range(3):
        idx = torch.arange(40).repeat_interleave(w[r])
        assert got[r].item() == pytest.approx(probes.auroc(y[idx], s[idx]), abs=1e-12)


def test_detection_out_of_fold_reads_the_label_pooled_and_within_prefixes(tmp_path, capsys):
    synthetic_corpus(tmp_path / "train", "train", 12, 0)
    synthetic_corpus(tmp_path / "test", "test", 8, 1)
    ownturns.main(["detect", "--corpus", str(tmp_path / "train"), str(tmp_path / "test"),
                   "--out", str(tmp_path / "out")])
    r = json.loads((tmp_path / "out" / "detection.json").read_text())
    assert r["episodes"] == 20 and r["prefixes"] == 60 and r["turns"] == 240
    # prefixes holding both classes: over all their turns, and over the sampled ones alone
    both = {"all": 0, "sampled": 0}
    for split in ("train", "test"):
        raw, _ = detection.load_features(tmp_path / split / "own_turns.safetensors")
        for group in raw["label"].view(-1, 4):
            both["all"] += len(set(group.tolist())) == 2
            both["sampled"] += len(set(group[:3].tolist())) == 2
    assert r["prefixes_both"] == both["all"] > r["prefixes_both_sampled"] == both["sampled"]
    # the same episode id in two splits is two episodes
    pooled = r["own"]["last_token"]["all"]
    assert pooled["auroc"] > 0.75 and pooled["within"]["auroc"] > 0.75
    lo, hi = pooled["interval95"]
    assert lo < pooled["auroc"] < hi
    # a score of how hard the prefix is ranks turns across prefixes, and nothing within one
    hard = r["own"]["logprob_mean"]
    assert hard["all"]["auroc"] > 0.7
    assert hard["all"]["within"]["auroc"] == 0.5
    # paired against that confidence: the label's reader gains within prefixes, for sure
    gain = r["own"]["pair"]["all"]["minus_confidence"]
    assert gain["within"] > 0.2 and gain["within_interval95"][0] > 0
    lo, hi = gain["interval95"]
    assert lo < gain["pooled"] < hi
    assert r["own"]["pair"]["well_formed"]["turns"] == 240 - 40
    assert r["own"]["pair"]["final"]["turns"] == 80
    # every right turn against the malformed ones (40, each the fourth sample of a call prefix)
    kinds, y = [], []
    for split in ("train", "test"):
        raw, meta = detection.load_features(tmp_path / split / "own_turns.safetensors")
        kinds += meta["kind"]
        y += raw["label"].tolist()
    against = sum(k == "malformed" or label == 1 for k, label in zip(kinds, y))
    assert r["own"]["pair"]["malformed"]["turns"] == against
    assert r["own"]["pair"]["malformed"]["right"] == sum(y) > against - 40
    table = (tmp_path / "out" / "detection.md").read_text()
    assert "| pair |" in table and "| logprob_mean |" in table


def test_detection_refuses_corpora_of_two_models(tmp_path):
    synthetic_corpus(tmp_path / "a", "train", 6, 0)
    synthetic_corpus(tmp_path / "b", "test", 6, 1, d=5)
    with pytest.raises(probes.FormatError, match="do not belong together"):
        owndetect.load_corpus([tmp_path / "a", tmp_path / "b"])


def test_detection_beside_and_across_the_released_turns(tmp_path, capsys):
    synthetic_corpus(tmp_path / "own", "train", 12, 0)
    released = tmp_path / "released"
    synthetic_corpus(released, "train", 10, 2, name="matched_clean_train.safetensors")
    synthetic_corpus(released, "test", 8, 3, name="matched_clean_test.safetensors")
    for name in ("matched_clean_train", "matched_clean_test"):      # teacher-forced: no sampling
        path = released / f"{name}.safetensors"
        tensors, meta = probes.read_safetensors(path, "features")
        del tensors["logprob_mean"]
        probes.save_safetensors(tensors, path, meta)
    ownturns.main(["detect", "--corpus", str(tmp_path / "own"), "--released", str(released),
                   "--out", str(tmp_path / "out")])
    r = json.loads((tmp_path / "out" / "detection.json").read_text())
    for block in (r["released"]["matched_clean_test"], r["own_to_released"]["matched_clean_test"]):
        assert block["pair"]["all"]["auroc"] > 0.75 and "within" not in block["pair"]["all"]
    across = r["released_to_own"]["pair"]["all"]
    assert across["auroc"] > 0.75 and across["within"]["auroc"] > 0.75
    assert "logprob_mean" not in r["released"]["matched_clean_test"]
    text = (tmp_path / "out" / "detection.md").read_text()
    assert "released → matched_clean_test" in text
    # the released probes on the well-formed own turns, beside the own probes there
    row = next(line for line in text.split("released → own, well_formed")[1].splitlines()
               if line.startswith("| pair |"))
    well = r["released_to_own"]["pair"]["well_formed"]
    assert f"{well['auroc']:.3f}" in row and f"{well['within']['auroc']:.3f}" in row
