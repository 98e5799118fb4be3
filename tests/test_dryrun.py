"""lab/dryrun.py: the paper's pipeline on random weights of the tiny shape, end to end on the CPU
at small limits; the checkpoint written as a downloaded one is; a shape that cannot fit refused
in one line before anything is written."""
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

import model as M
from lab import bench, dryrun

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "data" / "shop-policy"      # a tokenizer with the chat template's tokens


def test_dry_run_of_the_pipeline_on_the_cpu(release_dir, qwen_tokenizer_dir, tmp_path):
    work = tmp_path / "work"
    r = subprocess.run([sys.executable, "-m", "lab.dryrun", "--device", "cpu", "--shape", "tiny",
                        "--tokenizer", str(qwen_tokenizer_dir), "--data-dir", str(release_dir),
                        "--episodes", "2", "--group", "2", "--max-turns", "2",
                        "--max-new-tokens", "16", "--max-len", "1024", "--eval-batch", "2",
                        "--threads", "1", "--workdir", str(work)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    out = r.stdout
    assert "NOT the paper's (--group 2, --max-turns 2" in out
    for phase in ("checkpoint", "extract matched_clean_train",
                  "extract matched_contaminated_train", "probes", "grpo"):
        assert re.search(rf"^  {phase} +[\dmhds. ]+ +peak +[\d.]+ [MG]iB \(resident\)", out,
                         re.M), phase
    assert re.search(r"^  grpo .*step 2: [\d.]+ s \(rollout .*an evaluation batch: [\d.]+ s$",
                     out, re.M)
    assert "projection of the paper's full run on this CPU" in out
    for name in ("extraction", "probes", "setup", "training", "evaluation", "total"):
        assert re.search(rf"^  {name} .* [\dmhds.]+$", out, re.M), name
    released = sum(len(json.loads((release_dir / "gta" / f"{n}.json").read_text()))
                   for n in dryrun.MATCHED)
    assert f"{released:,} records of the 4 released matched files" in out
    assert "500 steps x" in out and "11 evaluations x" in out
    assert "random weights: the turns of step 2 averaged 16 tokens" in out
    assert re.search(r"^peak memory: [\d.]+ [MG]iB \(\w.*, resident\) of [\d.]+ GiB: fits$", out,
                     re.M)
    assert re.search(r"^largest that fit .*: G [\d,]+ at --max-len 1,024; --max-len [\d,]+", out,
                     re.M)

    # the run read the checkpoint the dry run wrote, through model.load_model
    metrics = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["gen_tokens"] == 2 * 2 * 16 for m in metrics)     # every turn to its limit
    net, _ = M.load_model(work / "checkpoint", dtype=torch.bfloat16)
    assert net.config.hidden_size == bench.SHAPES["tiny"]["hidden_size"]


def test_checkpoint_in_shards_reads_back_as_one(tmp_path, monkeypatch):
    tok = M.Tokenizer.from_file(POLICY)
    cfg = bench.shape_config("tiny")
    size, files = dryrun.write_checkpoint(cfg, torch.bfloat16, POLICY, tok, tmp_path / "one")
    assert files == 1 and not (tmp_path / "one" / M.INDEX).exists()
    monkeypatch.setattr(dryrun, "SHARD_BYTES", 100_000)       # the embedding alone, then the rest
    size_sharded, files = dryrun.write_checkpoint(cfg, torch.bfloat16, POLICY, tok,
                                                  tmp_path / "sharded")
    assert size_sharded == size and files >= 3
    index = json.loads((tmp_path / "sharded" / M.INDEX).read_text())
    assert index["metadata"]["total_size"] == size
    assert sorted(set(index["weight_map"].values())) == \
        [f"model-{k:05d}-of-{files:05d}.safetensors" for k in range(1, files + 1)]
    one, _ = M.load_model(tmp_path / "one", dtype=torch.bfloat16)
    sharded, _ = M.load_model(tmp_path / "sharded", dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(one.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name
    config = json.loads((tmp_path / "sharded" / "config.json").read_text())
    assert config["eos_token_id"] == tok.im_end_id and config["torch_dtype"] == "bfloat16"


def test_a_shape_that_cannot_fit_is_refused_in_one_line(tmp_path):
    work = tmp_path / "work"
    r = subprocess.run([sys.executable, "-m", "lab.dryrun", "--device", "cpu", "--shape",
                        "qwen2.5-7b", "--card-memory", "16", "--workdir", str(work)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refused: qwen2.5-7b needs at least 21.79 GiB")
    assert "judged as a 16 GiB device" in lines[0] and "16 rows x 8,192 tokens" in lines[0]
    assert not work.exists()            # nothing written, nothing loaded


def test_the_price_of_the_paper_s_model():
    config = M.Config.from_dict(bench.shape_config("qwen2.5-7b"))
    s = dryrun.parse_args(["--shape", "qwen2.5-7b"])
    need = dryrun.price(config, torch.bfloat16, s)
    assert need.weights == 7_615_616_512 * 2
    assert need.kv_rows == 16                   # the evaluation batch: more rows than G = 4
    # 2 (key, value) x 28 layers x 4 key heads x 128 x 2 bytes a token, 8,192 tokens a row
    assert need.kv == 16 * 8192 * 2 * 28 * 4 * 128 * 2
    assert need.total == need.weights + need.adapter + need.kv
