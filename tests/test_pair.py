"""pair.py: reward transforms by hand, PAIR fit / save / load / reward, the protocol, the report,
and the whole pipeline (shop data -> extract with a tiny random model -> train -> eval ->
report)."""
import json
import math
import pickle
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import pair
import probes
from lab import study
from lab.infra import runs
from lab.probing import detection, features, report, traces
from lab.worlds import released as lab_data
from pair import Pair


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------
# reward transforms (METHOD.md §7), by hand: sigma(logit(s) / 2) = sqrt(s)/(sqrt(s) + sqrt(1-s))

def test_temp_clip_hand_values():
    assert pair.temp_clip(0.9) == pytest.approx(0.75)                    # sqrt 9 = 3
    assert pair.temp_clip(0.1) == pytest.approx(0.25)
    assert pair.temp_clip(0.01) == pytest.approx(1 / (1 + math.sqrt(99)))
    assert pair.temp_clip(0.5) == pytest.approx(0.5)
    assert pair.temp_clip(0.999) == 0.95                                 # 0.969 -> clipped
    assert pair.temp_clip(1.0) == 0.95 and pair.temp_clip(0.0) == 0.05   # logit clamped, finite
    assert pair.temp_clip(0.3, T=1.0) == pytest.approx(0.3)
    assert pair.temp_clip(0.9, T=2.0, eps=0.3) == 0.7


def test_momentum_hand_values():
    # first turn: no bonus, whatever alpha
    assert pair.momentum_reward(0.75, [], alpha=5) == 0.75
    # t=2: sigma(logit(0.5) + 5 (0.5 - 0.75)) = sigma(-1.25)
    assert pair.momentum_reward(0.5, [0.75], alpha=5) == pytest.approx(1 / (1 + math.exp(1.25)))
    # t=3: sigma(ln(1/3) + 5 (0.25 - 0.625)) = 1 / (1 + 3 e^1.875)
    assert pair.momentum_reward(0.25, [0.75, 0.5], alpha=5) == pytest.approx(
        1 / (1 + 3 * math.exp(1.875)))
    # above the running mean -> boosted: sigma(ln 3 + 5 * 0.5) = 3 e^2.5 / (1 + 3 e^2.5)
    assert pair.momentum_reward(0.75, [0.25], alpha=5) == pytest.approx(
        3 * math.exp(2.5) / (1 + 3 * math.exp(2.5)))
    assert pair.momentum_reward(0.25, [0.75, 0.5], alpha=0) == 0.25      # vanilla
    assert pair.trajectory_rewards([0.9, 0.5, 0.1], alpha=5) == pytest.approx(
        [0.75, 1 / (1 + math.exp(1.25)), 1 / (1 + 3 * math.exp(1.875))])
    assert pair.trajectory_rewards([0.9, 0.1], alpha=0) == pytest.approx([0.75, 0.25])


# ----------------------------------------------------------------------------------------------
# synthetic features files (the real ones come from `extract`, tested at the bottom)

L, H, D = 3, 2, 6


def synthetic_split(path, n_episodes, seed, contaminated, name):
    """Two evaluation turns per episode. The hidden state carries the label on a clean prefix and
    flips it after a contaminated one (belief-consistency); attention carries it in both."""
    g = torch.Generator().manual_seed(seed)          # same seed for a clean/contaminated pair
    n = 2 * n_episodes
    y = (torch.rand(n, generator=g) < 0.6).long()
    distance = torch.randint(1, 9, (n,), generator=g)
    distance[::3] = -1
    sign = 2.0 * y - 1
    hidden_sign = torch.where(torch.tensor(contaminated) & (distance > 0), -sign, sign)
    raw = {"h_last4": torch.randn(n, 4, D, generator=g), "h_mean": torch.randn(n, D, generator=g)}
    raw["h_last4"][:, -1, 0] += 1.5 * hidden_sign
    for s in ("max", "std", "prefix", "self", "entropy", "lookback"):
        raw[f"attn_{s}"] = torch.rand(n, L, H, generator=g)
    raw["attn_prefix"][:, 1, 0] += 0.6 * sign
    raw["attn_entropy"][:, :, :] -= 0.3 * sign[:, None, None]
    raw["coe_r"] = torch.randn(n, generator=g) + 0.5 * sign
    raw["coe_c"] = torch.rand(n, generator=g)
    raw.update(label=y, turn_idx=torch.tensor([3, 5] * n_episodes), distance=distance,
               distance_messages=2 * distance, record_index=torch.arange(n),
               truncated=torch.zeros(n, dtype=torch.long))
    meta = {"data": f"/data/gta/{name}.json", "model": "synthetic", "dtype": "float32",
            "episode_id": [f"ep{i // 2}" for i in range(n)],
            "contamination_type": [None] * n,
            "prefix_type": ["contaminated" if contaminated else "clean"] * n, "failed": []}
    probes.save_safetensors(raw, path, {"pair_features": json.dumps(meta)})


@pytest.fixture(scope="module")
def features_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("feats")
    for name, episodes, seed in (("train", 60, 1), ("test", 30, 2)):
        synthetic_split(d / f"matched_clean_{name}.safetensors", episodes, seed, False,
                        f"matched_clean_{name}")
        synthetic_split(d / f"matched_contaminated_{name}.safetensors", episodes, seed, True,
                        f"matched_contaminated_{name}")
    return d


def fake_trace(raw, i):
    """A probes.TurnTrace-like object carrying record i of a features batch."""
    h_last = torch.randn(L + 1, D)
    h_last[-4:] = raw["h_last4"][i]
    return SimpleNamespace(h_last=h_last, h_mean=torch.randn(L + 1, D), tokens=[], span=(0, 1),
                           finished=True,
                           attn_stats={s: raw[f"attn_{s}"][i] for s in
                                       ("max", "std", "prefix", "self", "entropy", "lookback")})


def forbid_pickle(monkeypatch):
    def no_pickle(*a, **k):
        raise AssertionError("pickle used while loading")
    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(torch, "load", no_pickle)


# ----------------------------------------------------------------------------------------------
# PAIR

def test_pair_is_two_probes_on_the_paper_inputs(features_dir):
    train = detection.load_split(features_dir / "matched_clean_train.safetensors")
    model = pair.fit_pair(train.raw, train.y)
    X1 = probes.feature("last_token", train.raw)
    ref1 = probes.Probe().fit(X1, train.y)
    s_bc = ref1.predict_proba(X1)
    ref2 = probes.Probe().fit(torch.cat([probes.feature("multi_attn", train.raw),
                                         s_bc[:, None]], 1), train.y)
    got_bc, got_final = model.scores(train.raw)
    torch.testing.assert_close(got_bc, s_bc)
    torch.testing.assert_close(got_final, ref2.predict_proba(
        torch.cat([probes.feature("multi_attn", train.raw), s_bc[:, None]], 1)))


def test_pair_save_load_reward_and_latency(features_dir, tmp_path, monkeypatch):
    train = detection.load_split(features_dir / "matched_clean_train.safetensors")
    test = detection.load_split(features_dir / "matched_contaminated_test.safetensors")
    model = pair.fit_pair(train.raw, train.y, info={"mode": "clean_only"})
    model.save(tmp_path / "pair")
    assert sorted(p.name for p in (tmp_path / "pair").iterdir()) == [
        "pair.json", "stage1.safetensors", "stage2.safetensors"]
    forbid_pickle(monkeypatch)
    loaded = Pair.load(tmp_path / "pair")
    assert loaded.info["mode"] == "clean_only" and loaded.stats == probes.ATTN_STATS
    s_bc, s_final = model.scores(test.raw)
    for a, b in zip(loaded.scores(test.raw), (s_bc, s_final)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # a turn read from its trace, as grpo.py's PAIR reward reads it: the same scores
    for i in range(3):
        raw = {k: v[None] for k, v in probes.raw_features(fake_trace(test.raw, i)).items()}
        for a, b in zip(loaded.scores(raw), (s_bc, s_final)):
            assert a.item() == pytest.approx(b[i].item(), abs=1e-12)


def test_a_probe_reads_a_turn_from_its_trace_as_from_the_features_file(features_dir, tmp_path,
                                                                       monkeypatch):
    # grpo.py's probe rewards: P(correct) of the features of a turn's trace
    train = detection.load_split(features_dir / "matched_clean_train.safetensors")
    for name in ("attention", "hidden_attn", "multi_layer"):
        probe = probes.Probe(info={"feature": name}).fit(probes.feature(name, train.raw), train.y)
        probe.save(tmp_path / f"{name}.safetensors")
        forbid_pickle(monkeypatch)
        loaded = probes.Probe.load(tmp_path / f"{name}.safetensors")
        p = probe.predict_proba(probes.feature(name, train.raw))
        raw = {k: v[None] for k, v in probes.raw_features(fake_trace(train.raw, 4)).items()}
        assert loaded.predict_proba(probes.feature(name, raw)).item() == pytest.approx(
            p[4].item(), abs=1e-12)


def test_crossfit_uses_out_of_fold_scores(features_dir):
    train = detection.load_split(features_dir / "matched_clean_train.safetensors")
    folds = pair.episode_folds(train.episode_id, 3, seed=7)
    by_episode = {}
    for e, f in zip(train.episode_id, folds.tolist()):
        assert by_episode.setdefault(e, f) == f        # an episode never straddles folds
    assert sorted(set(folds.tolist())) == [0, 1, 2]
    stage1, s_oof = pair.fit_stage1(train.raw, train.y, crossfit=3, groups=train.episode_id,
                                    seed=7)
    X1 = probes.feature("last_token", train.raw)
    held = folds == 1
    expect = probes.Probe().fit(X1[~held], train.y[~held]).predict_proba(X1[held])
    torch.testing.assert_close(s_oof[held], expect)
    _, s_in = pair.fit_stage1(train.raw, train.y)
    assert (s_oof - s_in).abs().max() > 1e-3
    torch.testing.assert_close(stage1.predict_proba(X1), s_in)  # the kept stage 1 sees all


# ----------------------------------------------------------------------------------------------
# protocol

def test_balanced_indices():
    y = torch.tensor([1] * 30 + [0] * 10)
    a, b = detection.balanced_indices(y, 42), detection.balanced_indices(y, 43)
    assert len(a) == 20 and y[a].sum() == 10
    assert a.equal(detection.balanced_indices(y, 42)) and not a.equal(b)
    assert set(range(30, 40)) <= set(a.tolist())     # the minority class is kept whole


def test_mixed_training_set_takes_the_same_records(features_dir):
    splits = detection.load_splits(features_dir, detection.TRAIN_SPLITS["mixed"])
    mixed = study.training_set(splits, "mixed", 43)
    clean = study.training_set(splits, "clean_only", 43)
    n = len(clean.y)
    assert len(mixed.y) == 2 * n and mixed.y[:n].equal(mixed.y[n:])
    assert mixed.keys()[:n] == mixed.keys()[n:] == clean.keys()
    assert mixed.y.sum() * 2 == len(mixed.y)


def test_contamination_distance():
    roles = ["user", "assistant", "tool", "assistant", "tool", "user", "assistant", "tool",
             "assistant"]
    dialogs = [{"role": r} for r in roles]
    rec = {"turn_idx": 8, "dialogs": dialogs, "original_contaminated_turn_indices": [3, 8, 10]}
    # nearest earlier contaminated turn: message 3; assistant turns 6 and 8 follow -> d = 2
    assert features.contamination_distance(rec) == (2, 5)
    rec["original_contaminated_turn_indices"] = [6, 1]
    assert features.contamination_distance(rec) == (1, 2)
    rec["original_contaminated_turn_indices"] = [8]
    assert features.contamination_distance(rec) == (-1, -1)
    assert report.distance_bucket(1) == "1" and report.distance_bucket(9) == "7+"
    assert report.distance_bucket(-1) is None


def test_train_eval_report_cli(features_dir, tmp_path, capsys):
    study.main(["train", "--features", str(features_dir), "--out", str(tmp_path / "m"),
               "--seeds", "42", "43"])
    files = {p.relative_to(tmp_path / "m").as_posix() for p in (tmp_path / "m").rglob("*")
             if p.is_file()}
    assert {f"seed42/{n}.safetensors" for n in probes.FEATURES} <= files
    assert "seed43/pair_mixed/pair.json" in files
    assert all(f.endswith((".safetensors", ".json", runs.LOCK_FILE)) for f in files)
    study.main(["eval", "--probes", str(tmp_path / "m"), "--features", str(features_dir),
               "--out", str(tmp_path / "eval.json")])
    ev = json.loads((tmp_path / "eval.json").read_text())
    assert len(ev["pair_mixed"]["matched_clean_test"]["auroc"]["values"]) == 2
    # a later train into the same directory: eval reads the seeds it wrote, not the stale ones
    study.main(["train", "--features", str(features_dir), "--out", str(tmp_path / "m"),
               "--seeds", "44", "--C", "1.0"])
    study.main(["eval", "--probes", str(tmp_path / "m"), "--features", str(features_dir),
               "--out", str(tmp_path / "eval.json")])
    ev = json.loads((tmp_path / "eval.json").read_text())
    assert len(ev["pair_mixed"]["matched_clean_test"]["auroc"]["values"]) == 1
    assert "ignoring seed42, seed43" in capsys.readouterr().err

    study.main(["report", "--features", str(features_dir), "--out", str(tmp_path / "r"),
               "--seeds", "42", "43", "44"])
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    md = (tmp_path / "r" / "report.md").read_text()
    det = rep["detection"]
    assert set(det) == set(report.METHODS)
    auroc = {m: {s: det[m][s]["auroc"]["mean"] for s in study.TEST_SPLITS} for m in det}
    # the synthetic data is built so that the hidden state flips after a contaminated prefix
    clean, contam = "matched_clean_test", "matched_contaminated_test"
    assert auroc["last_token"][clean] > 0.8 and auroc["last_token"][contam] < 0.65
    assert auroc["pair"][contam] > auroc["last_token"][contam] + 0.1
    assert auroc["pair"][clean] > 0.8
    assert len(det["pair"][clean]["auroc"]["values"]) == 3
    assert det["coe_c"][clean]["auroc"]["std"] == 0.0 and "ece" not in det["coe_c"][clean]
    # an unsupervised score is reported by AUROC only, in the tables too
    assert all(set(det[m][clean]) == {"auroc"} for m in det if not report.METHODS[m][1])
    other = md.split("Other metrics")[1].split("## (b)")[0]
    assert "Last-token" in other and "CoE-R" not in other and "Entropy (unsup.)" not in other
    assert len(rep["ablation"]) == 15
    assert set(rep["distance"]["_n"]) == set(report.DISTANCE_BUCKETS)
    assert rep["paper_ref"] == "gta" and "0.9217" in md
    for section in ("(a)", "(b)", "(c)", "(d)", "(e)"):
        assert f"## {section}" in md
    # (b): every method's AUROC clean and contaminated, the drop and the relative drop
    table = [line for line in md.split("## (b)")[1].split("## (c)")[0].splitlines()
             if line.startswith("|")]
    assert table[0] == "| Method | clean | contaminated | drop | relative |"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    expect = []
    for m in det:
        a, b = auroc[m][clean], auroc[m][contam]
        expect.append([report.METHODS[m][0], f"{a:.3f}", f"{b:.3f}", f"{a - b:+.3f}",
                       f"{100 * (a - b) / a:+.1f}%"])
    assert sorted(rows) == sorted(expect) and len(rows) == len(report.METHODS)
    drop = {row[0]: float(row[3]) for row in rows}
    assert drop["Last-token"] > 0.15 and drop["PAIR"] < drop["Last-token"] - 0.1
    # a clean AUROC of 0 (a tiny test split can give one) has a drop but no relative drop
    det["last_token"][clean]["auroc"]["mean"] = 0.0
    table = study.render_markdown(rep, "gta").split("## (b)")[1]
    assert f"| Last-token | 0.000 | {auroc['last_token'][contam]:.3f} |" in table
    assert table.split("| Last-token |")[1].split("\n")[0].rstrip().endswith("| n/a |")


def _truncate(path: Path, keep: int = 100):
    path.write_bytes(path.read_bytes()[:keep])


def test_unreadable_files_are_one_line_errors(features_dir, tmp_path, capsys):
    # A truncated or corrupt input is an error naming the file, never a traceback.
    feats = tmp_path / "feats"
    feats.mkdir()
    for p in features_dir.glob("*.safetensors"):
        (feats / p.name).write_bytes(p.read_bytes())
    study.main(["train", "--features", str(feats), "--out", str(tmp_path / "m"), "--seeds", "42"])
    seed = tmp_path / "m" / "seed42"

    bad = feats / "matched_clean_test.safetensors"
    _truncate(bad)
    with pytest.raises(SystemExit, match=f"error: {bad}: truncated or corrupt features file"):
        study.main(["eval", "--probes", str(tmp_path / "m"), "--features", str(feats)])
    (feats / bad.name).write_bytes((features_dir / bad.name).read_bytes())

    _truncate(seed / "last_token.safetensors", 20)
    with pytest.raises(SystemExit, match="last_token.safetensors: truncated or corrupt probe"):
        study.main(["eval", "--probes", str(tmp_path / "m"), "--features", str(feats)])
    (seed / "last_token.safetensors").unlink()

    (seed / "pair_mixed" / "pair.json").write_text("{not json")
    with pytest.raises(SystemExit, match="pair.json: not JSON"):
        study.main(["eval", "--probes", str(tmp_path / "m"), "--features", str(feats)])
    (seed / "pair_mixed" / "pair.json").write_text(json.dumps(
        {"format": "pair/1", "stats": ["max"], "stage1": "../../x.safetensors",
         "stage2": "stage2.safetensors"}))
    with pytest.raises(SystemExit, match="unexpected stage file names"):
        study.main(["eval", "--probes", str(tmp_path / "m"), "--features", str(feats)])

    (tmp_path / "x.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(SystemExit, match="error: .*x.safetensors: truncated or corrupt probe"):
        study.main(["score", "--probe", str(tmp_path / "x.safetensors"),
                    "--features", str(bad)])

    # readable features that no probe can use: labels other than 0/1, episode ids not a list
    tensors, meta = probes.read_safetensors(bad, "features")
    meta = json.loads(meta["pair_features"])
    fit = ["fit", "--features", str(bad), "--feature", "attention", "--out",
           str(tmp_path / "p.safetensors")]
    for t, m, expect in ((dict(tensors, label=tensors["label"] * 7), meta, "labels must be 0"),
                         (tensors, dict(meta, episode_id=3), "episode_id must be a list")):
        probes.save_safetensors(t, bad, {"pair_features": json.dumps(m)})
        with pytest.raises(SystemExit, match=f"error: {bad}: .*{expect}"):
            study.main(fit)
    probes.save_safetensors(tensors, bad, {"pair_features": json.dumps(meta)})
    with pytest.raises(SystemExit, match=f"error: .*{bad}"):       # --out under a file
        study.main(fit[:-1] + [str(bad / "p.safetensors")])
    with pytest.raises(SystemExit):
        study.main(fit + ["--C", "0"])
    assert "argument --C: must be a positive number, not 0" in capsys.readouterr().err


def test_extract_checks_the_data_before_loading_the_model(tmp_path):
    data = tmp_path / "matched_clean_train.json"
    data.write_text("[{]")
    with pytest.raises(SystemExit, match="matched_clean_train.json"):
        study.main(["extract", "--model", str(tmp_path / "no-model"), "--data", str(data),
                   "--out", str(tmp_path / "f.safetensors")])


# ----------------------------------------------------------------------------------------------
# the whole pipeline: make-data shop -> extract (tiny random model) -> train -> eval -> report

SHOP_SPLITS = ("matched_clean_train", "matched_contaminated_train", "matched_clean_test",
               "matched_contaminated_test", "matched_diagnostic_test")


def tiny_checkpoint(directory: Path, data_dir: Path) -> Path:
    """A random 4-layer Qwen2 model and a small byte-level BPE with the ChatML specials, trained
    on the shop dialogs (no download)."""
    import model as mdl
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    directory.mkdir(parents=True)
    texts = [m["content"] for f in sorted(data_dir.glob("matched_*.json"))
             for r in lab_data.load_matched(f) for m in lab_data.record_messages(r)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    tok.save(str(directory / "tokenizer.json"))
    config = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": tok.get_vocab_size(),
              "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "max_position_embeddings": 8192,
              "eos_token_id": tok.token_to_id("<|im_end|>")}
    (directory / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    net = mdl.Transformer(mdl.Config.from_dict(config))
    save_file({k: v.contiguous() for k, v in net.state_dict().items()},
              str(directory / "model.safetensors"))
    return directory


def test_pipeline_on_shop(tmp_path, monkeypatch, capsys):
    import model as mdl
    from lab import shop
    t_start = time.perf_counter()
    data, feats = tmp_path / "data", tmp_path / "feats"
    shop.main(["make-data", "--out", str(data), "--episodes", "20", "--seed", "5"])
    ckpt = tiny_checkpoint(tmp_path / "ckpt", data)

    # an interrupted extraction resumes where it stopped
    real_trace_forward, calls = traces.trace_forward, []

    def interrupted(net, ids, span):
        calls.append(span)
        if len(calls) == 10:
            raise KeyboardInterrupt
        return real_trace_forward(net, ids, span)
    monkeypatch.setattr(traces, "trace_forward", interrupted)
    target = feats / "matched_clean_train.safetensors"
    extract_args = ["extract", "--model", str(ckpt), "--data",
                    str(data / "matched_clean_train.json"), "--out", str(target),
                    "--shard-size", "4"]
    with pytest.raises(KeyboardInterrupt):
        study.main(extract_args)
    assert not target.exists() and len(list(target.parent.glob("*.parts/shard_*"))) == 2
    manifest = target.with_name(target.name + ".parts") / "manifest.json"
    kept = manifest.read_text()
    manifest.write_text("[]")                   # JSON, but not the manifest: refused, named
    with pytest.raises(SystemExit, match="manifest.json: not a manifest"):
        study.main(extract_args)
    manifest.write_text(kept)
    calls.clear()
    monkeypatch.setattr(traces, "trace_forward", lambda *a: (calls.append(a[2]),
                                                             real_trace_forward(*a))[1])
    study.main(extract_args)
    records = lab_data.load_matched(data / "matched_clean_train.json")
    assert len(calls) == len(records) - 8               # the two shards were not redone
    assert not target.with_name(target.name + ".parts").exists()

    # a failing record is reported by id and kept in the metadata; a rerun retries only it
    target = feats / "matched_clean_test.safetensors"
    test_records = lab_data.load_matched(data / "matched_clean_test.json")

    def failing(net, ids, span):
        calls.append(span)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_trace_forward(net, ids, span)
    calls.clear()
    monkeypatch.setattr(traces, "trace_forward", failing)
    extract_args = ["extract", "--model", str(ckpt), "--data",
                    str(data / "matched_clean_test.json"), "--out", str(target)]
    study.main(extract_args)
    _, meta = study.load_features(target)
    bad = f"{test_records[1]['episode_id']}@{test_records[1]['turn_idx']}"
    assert meta["failed"][0]["id"] == bad and "boom" in meta["failed"][0]["error"]
    assert len(meta["failed"]) == 1 and meta["n_records"] == len(test_records) - 1
    assert f"1 {bad}: RuntimeError: boom" in capsys.readouterr().err
    calls.clear()
    monkeypatch.setattr(traces, "trace_forward", lambda *a: (calls.append(a[2]),
                                                             real_trace_forward(*a))[1])
    study.main(extract_args)
    assert len(calls) == 1
    _, meta = study.load_features(target)
    assert meta["failed"] == [] and meta["n_records"] == len(test_records)

    for split in ("matched_contaminated_train", "matched_contaminated_test",
                  "matched_diagnostic_test"):
        study.main(["extract", "--model", str(ckpt), "--data", str(data / f"{split}.json"),
                   "--out", str(feats / f"{split}.safetensors")])

    # the features file holds what one teacher-forced forward gives, and the record columns
    raw, meta = study.load_features(feats / "matched_contaminated_test.safetensors")
    recs = lab_data.load_matched(data / "matched_contaminated_test.json")
    net, tok = mdl.load_model(ckpt)
    for i in (0, len(recs) - 1):
        ids, spans = tok.render(lab_data.record_messages(recs[i]))
        expect = detection.raw_with_coe(real_trace_forward(net, ids, spans[-1]))
        for k, v in expect.items():
            torch.testing.assert_close(raw[k][i], v, msg=k)
    assert raw["label"].tolist() == [r["label"] for r in recs]
    assert raw["turn_idx"].tolist() == [r["turn_idx"] for r in recs]
    assert raw["distance"].tolist() == [features.contamination_distance(r)[0] for r in recs]
    assert meta["episode_id"] == [r["episode_id"] for r in recs]
    assert meta["contamination_type"] == [r["contamination_type"] for r in recs]
    assert meta["dims"] == {"d": 16, "L": 4, "H": 4}
    # long sequences keep their last max_len tokens, the span shifted with them
    full_ids, full_spans = tok.render(lab_data.record_messages(recs[0]))
    cut_ids, cut_span, cut = features.render_record(recs[0], tok, max_len=len(full_ids) - 7)
    assert cut == 7 and cut_ids == full_ids[7:]
    assert cut_span == (full_spans[-1][0] - 7, full_spans[-1][1] - 7)
    with pytest.raises(ValueError, match="does not fit"):
        features.render_record(recs[0], tok, max_len=1)

    study.main(["train", "--features", str(feats), "--out", str(tmp_path / "probes"),
               "--seeds", "42"])
    study.main(["eval", "--probes", str(tmp_path / "probes"), "--features", str(feats),
               "--out", str(tmp_path / "eval.json")])
    study.main(["report", "--features", str(feats), "--seeds", "42", "43"])
    rep = json.loads((feats / "report.json").read_text())
    assert rep["paper_ref"] is None                      # shop: no paper numbers
    assert rep["n_records"]["matched_diagnostic_test"] == len(
        lab_data.load_matched(data / "matched_diagnostic_test.json"))
    for m in report.METHODS:
        assert 0 <= rep["detection"][m]["matched_clean_test"]["auroc"]["mean"] <= 1
        assert rep["detection"][m]["matched_diagnostic_test"]["auroc"]["mean"] is not None
    # the trained PAIR scores a live turn (grpo.py's reward) as it scores the extracted record
    model = Pair.load(tmp_path / "probes" / "seed42" / "pair_mixed")
    trace = real_trace_forward(net, ids, spans[-1])
    live = model.scores({k: v[None] for k, v in probes.raw_features(trace).items()})
    extracted = model.scores({k: v[-1:] for k, v in raw.items()})
    for a, b in zip(live, extracted):
        torch.testing.assert_close(a, b)
    print(f"\nshop pipeline: {time.perf_counter() - t_start:.1f}s")


# ----------------------------------------------------------------------------------------------
# one writer per output: real processes racing, kill -9

ROOT = Path(__file__).resolve().parents[1]
# pair.py extract with each forward slowed down, so that two runs surely overlap
SLOW_EXTRACT = ("import sys, time\n"
                "from lab import study\n"
                "from lab.probing import traces\n"
                "real = traces.trace_forward\n"
                "traces.trace_forward = lambda *a: (time.sleep(0.03), real(*a))[1]\n"
                "study.main(sys.argv[1:])\n")


@pytest.fixture(scope="module")
def shop_ckpt(tmp_path_factory):
    from lab import shop
    root = tmp_path_factory.mktemp("shop")
    shop.main(["make-data", "--out", str(root / "data"), "--episodes", "20", "--seed", "5"])
    return root / "data", tiny_checkpoint(root / "ckpt", root / "data")


def _env():
    import os
    return dict(os.environ, OMP_NUM_THREADS="1")


def test_two_extracts_on_one_output_one_refuses_and_the_file_is_complete(shop_ckpt, tmp_path):
    import subprocess
    import sys
    data, ckpt = shop_ckpt
    out = tmp_path / "feats" / "matched_clean_train.safetensors"
    argv = ["extract", "--model", str(ckpt), "--data", str(data / "matched_clean_train.json"),
            "--out", str(out), "--shard-size", "4"]
    runs = [subprocess.Popen([sys.executable, "-c", SLOW_EXTRACT, *argv], cwd=ROOT, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [(r.wait(timeout=300), r.stderr.read()) for r in runs]
    refused = [err for rc, err in results if rc != 0]
    assert len(refused) == 1, results
    assert f"{study.parts_dir(out)} is in use by pid" in refused[0]
    raw, meta = study.load_features(out)
    n = len(lab_data.load_matched(data / "matched_clean_train.json"))
    assert meta["n_records"] == n and meta["failed"] == [] and len(raw["label"]) == n
    assert raw["record_index"].tolist() == list(range(n))
    assert not study.parts_dir(out).exists()


def test_an_extract_stopped_before_its_first_shard_leaves_nothing_behind(shop_ckpt, tmp_path,
                                                                         monkeypatch):
    data, ckpt = shop_ckpt
    out = tmp_path / "feats" / "matched_clean_train.safetensors"
    argv = ["extract", "--model", str(ckpt), "--data", str(data / "matched_clean_train.json"),
            "--out", str(out), "--shard-size", "4"]

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(traces, "trace_forward", interrupted)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        study.main(argv)
    assert not study.parts_dir(out).exists() and not out.exists()


def wait_for(condition, timeout=120.0):
    t0 = time.perf_counter()
    while not condition():
        assert time.perf_counter() - t0 < timeout, "timed out"
        time.sleep(0.05)


def holds(directory: Path, proc) -> bool:
    lock = directory / ".lock"
    return lock.is_file() and lock.read_text().strip() == str(proc.pid)


def test_a_busy_output_is_refused_and_kill_9_frees_it(features_dir, tmp_path):
    import signal
    import subprocess
    import sys
    out = tmp_path / "m"
    train = ["train", "--features", str(features_dir), "--out", str(out)]
    first = subprocess.Popen([sys.executable, "-m", "lab.study", *train, "--seeds",
                              *map(str, range(40, 60))], cwd=ROOT, env=_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # it holds the output (or, unlocked, has begun writing into it)
        wait_for(lambda: holds(out, first) or (out / "seed40").exists())
        with pytest.raises(SystemExit, match=f"{out} is in use by pid {first.pid}; "):
            study.main(train + ["--seeds", "42"])
        with pytest.raises(SystemExit, match=f"{out} is in use by pid {first.pid}; "):
            study.main(["report", "--features", str(features_dir), "--out", str(out)])
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)       # no cleanup runs: the kernel drops the lock
        first.wait()
    study.main(train + ["--seeds", "42"])
    assert json.loads((out / "train.json").read_text())["runs"][0]["seed"] == 42


def test_claims_nest_and_survive_the_directory_being_removed(tmp_path):
    d = tmp_path / "x.parts"
    with runs.exclusive_dir(d):
        with runs.exclusive_dir(d):             # nested in one process: fine
            pass
        assert str(d.resolve()) in runs._claims
        import shutil
        shutil.rmtree(d)                        # extract removes OUT.parts while holding it
    assert str(d.resolve()) not in runs._claims
    with runs.exclusive_dir(d):
        assert (d / runs.LOCK_FILE).read_text().strip() == str(__import__("os").getpid())


def test_merge_refuses_to_write_an_incomplete_file(shop_ckpt, tmp_path, monkeypatch):
    data, ckpt = shop_ckpt
    out = tmp_path / "f.safetensors"
    real, calls = features._write_shard, []

    def loses_the_second_shard(parts, buffer, failed):
        calls.append(len(buffer))
        if len(calls) != 2:
            real(parts, buffer, failed)
    monkeypatch.setattr(features, "_write_shard", loses_the_second_shard)
    argv = ["extract", "--model", str(ckpt), "--data", str(data / "matched_clean_test.json"),
            "--out", str(out), "--shard-size", "3"]
    with pytest.raises(SystemExit, match=r"3 records .* neither extracted nor listed as failed"):
        study.main(argv)
    assert not out.exists()
    monkeypatch.setattr(features, "_write_shard", real)
    study.main(argv)                              # the rerun extracts the lost records
    _, meta = study.load_features(out)
    assert meta["n_records"] == len(lab_data.load_matched(data / "matched_clean_test.json"))


# ----------------------------------------------------------------------------------------------
# inputs checked against each other: what a file was made from is recorded and compared

def restamp(path: Path, **meta):
    """Rewrite a features file's recorded source (as if extracted with another model)."""
    raw, old = study.load_features(path)
    probes.save_safetensors(raw, path, {"pair_features": json.dumps({**old, **meta})})


def test_features_of_another_model_are_refused(features_dir, tmp_path):
    feats = tmp_path / "feats"
    feats.mkdir()
    for p in features_dir.glob("*.safetensors"):
        (feats / p.name).write_bytes(p.read_bytes())
        restamp(feats / p.name, model="/models/a", model_sha256="a" * 64)
    study.main(["train", "--features", str(feats), "--out", str(tmp_path / "m"), "--seeds", "42"])
    # same width, another model: the test features
    for p in feats.glob("*_test.safetensors"):
        restamp(p, model="/models/b", model_sha256="b" * 64)
    with pytest.raises(SystemExit, match=r"seed42/\S+ was made from model /models/a .*"
                                         r"matched_clean_test.safetensors from model /models/b"):
        study.main(["eval", "--probes", str(tmp_path / "m"), "--features", str(feats)])
    with pytest.raises(SystemExit, match="_test.safetensors from model /models/b"):
        study.main(["report", "--features", str(feats), "--seeds", "42"])
    with pytest.raises(SystemExit, match="do not belong together"):
        study.main(["score", "--probe",
                    str(tmp_path / "m" / "seed42" / "attention.safetensors"),
                    "--features", str(feats / "matched_clean_test.safetensors")])
    # ... and one of the training splits
    restamp(feats / "matched_contaminated_train.safetensors", model_sha256="c" * 64)
    with pytest.raises(SystemExit, match="matched_contaminated_train.safetensors from .*"
                                         r"sha256 cccccccccccc"):
        study.main(["train", "--features", str(feats), "--out", str(tmp_path / "m2")])
    # another dtype of the same model is another source too
    restamp(feats / "matched_contaminated_train.safetensors", model_sha256="a" * 64,
            dtype="bfloat16")
    with pytest.raises(SystemExit, match="dtype differs"):
        study.main(["train", "--features", str(feats), "--out", str(tmp_path / "m2")])
    info = Pair.load(tmp_path / "m" / "seed42" / "pair_mixed").info    # what eval compared
    assert info["model_sha256"] == "a" * 64 and info["dims"] == {"d": D, "L": L, "H": H}


def test_extraction_resumes_by_model_content_not_path(shop_ckpt, tmp_path, monkeypatch):
    import shutil
    import model as mdl
    from safetensors.torch import load_file, save_file
    data, original = shop_ckpt
    ckpt = tmp_path / "ckpt"
    shutil.copytree(original, ckpt)
    out = tmp_path / "f.safetensors"
    argv = ["extract", "--data", str(data / "matched_clean_test.json"), "--out", str(out),
            "--shard-size", "2"]
    real, calls = traces.trace_forward, []

    def interrupted(net, ids, span):
        calls.append(span)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(net, ids, span)
    monkeypatch.setattr(traces, "trace_forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        study.main(argv + ["--model", str(ckpt)])
    monkeypatch.setattr(traces, "trace_forward", real)

    # other weights under the same path: the shards of the first model are not resumed
    tensors = load_file(str(ckpt / "model.safetensors"))
    save_file({k: v + 0.01 for k, v in tensors.items()}, str(ckpt / "model.safetensors"))
    with pytest.raises(SystemExit, match="different arguments .*model_sha256"):
        study.main(argv + ["--model", str(ckpt)])
    # the first model again, from another path: resumed
    save_file(tensors, str(ckpt / "model.safetensors"))
    moved = tmp_path / "moved"
    ckpt.rename(moved)
    monkeypatch.setattr(traces, "trace_forward", lambda *a: (calls.append(a[2]), real(*a))[1])
    calls.clear()
    study.main(argv + ["--model", str(moved)])
    n = len(lab_data.load_matched(data / "matched_clean_test.json"))
    assert len(calls) == n - 4
    _, meta = study.load_features(out)
    assert meta["model_sha256"] == mdl.checkpoint_sha256(moved) \
        == mdl.checkpoint_sha256(original)
    assert meta["data_sha256"] and meta["dims"] == {"d": 16, "L": 4, "H": 4}


# ----------------------------------------------------------------------------------------------
# more hostile inputs: each a one-line error, never a traceback or a silent NaN

def test_hostile_flags_and_values_are_one_line_errors(features_dir, tmp_path, capsys):
    feats = str(features_dir)
    for flag, value in (("--C", "-1"), ("--C", "nan"), ("--crossfit", "-3")):
        with pytest.raises(SystemExit):
            study.main(["train", "--features", feats, "--out", str(tmp_path / "m"), flag, value])
        assert f"argument {flag}: must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main(["train", "--features", feats, "--out", str(tmp_path / "m"),
                    "--crossfit", "2.5"])
    assert "argument --crossfit: invalid int value: '2.5'" in capsys.readouterr().err
    with pytest.raises(SystemExit):         # one fold would be in-sample under another name
        study.main(["train", "--features", feats, "--out", str(tmp_path / "m"), "--crossfit", "1"])
    assert "argument --crossfit: one fold leaves no record" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--crossfit 1000: only 60 training episodes"):
        study.main(["train", "--features", feats, "--out", str(tmp_path / "m"), "--crossfit",
                   "1000", "--seeds", "42"])
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit, match="afile: not a directory"):
        study.main(["train", "--features", feats, "--out", str(tmp_path / "afile")])

    # a NaN in a features file or a probe would turn scores and rewards into NaN silently
    nan_feats = tmp_path / "nan"
    nan_feats.mkdir()
    for p in features_dir.glob("*.safetensors"):
        (nan_feats / p.name).write_bytes(p.read_bytes())
    raw, meta = study.load_features(nan_feats / "matched_clean_train.safetensors")
    raw["attn_max"][3, 1, 0] = float("nan")
    probes.save_safetensors(raw, nan_feats / "matched_clean_train.safetensors",
                            {"pair_features": json.dumps(meta)})
    with pytest.raises(SystemExit, match="matched_clean_train.safetensors: attn_max holds NaN"):
        study.main(["train", "--features", str(nan_feats), "--out", str(tmp_path / "m")])
    train = detection.load_split(features_dir / "matched_clean_train.safetensors")
    probe = probes.Probe(info={"feature": "last_token"}).fit(
        probes.feature("last_token", train.raw), train.y)
    probe.w[2] = float("inf")
    probe.save(tmp_path / "inf.safetensors")
    with pytest.raises(probes.FormatError, match="inf.safetensors: w holds NaN"):
        probes.Probe.load(tmp_path / "inf.safetensors")


def test_extract_of_an_empty_file_says_so(shop_ckpt, tmp_path):
    data, ckpt = shop_ckpt
    empty = tmp_path / "matched_clean_test.json"
    empty.write_text("[]")
    shutil.copy(data / "clean_test.json", tmp_path / "clean_test.json")
    with pytest.raises(SystemExit, match="no record to extract") as stop:
        study.main(["extract", "--model", str(ckpt), "--data", str(empty), "--out",
                   str(tmp_path / "f.safetensors")])
    assert "errors above" not in str(stop.value)


def test_an_out_that_is_a_directory_is_refused_before_any_work(tmp_path):
    # it was refused only after the extraction or the fit, naming a temporary file
    d = tmp_path / "d"
    d.mkdir()
    for main, argv in ((study.main, ["extract", "--model", "no-model", "--data", "no.json"]),
                       (study.main, ["eval", "--probes", "no-probes", "--features", "no"]),
                       (study.main, ["fit", "--features", "no", "--feature", "last_token"])):
        with pytest.raises(SystemExit, match=f"^error: --out {d} is a directory; name the file"):
            main([*argv, "--out", str(d)])
    assert not list(d.iterdir()) and not study.parts_dir(d).exists()


def test_a_negative_seed_is_refused(tmp_path, capsys):
    # it wrote seed-1/, which grpo.py --probes then did not recognise as a seed's probes
    with pytest.raises(SystemExit):
        study.main(["train", "--features", str(tmp_path), "--out", str(tmp_path / "m"),
                   "--seeds", "42", "-1"])
    assert "argument --seeds: must be >= 0, not -1" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
