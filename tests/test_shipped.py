"""The probes shipped beside the built-in policy (data/shop-policy/probes/, rebuilt by
`python -m lab.onpolicy`): complete, of the policy's widths, and what the core's default run reads
without the lab."""
import json
import os
import subprocess
import sys
from pathlib import Path

import model
import pair
import probes

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "data" / "shop-policy"


def test_every_shipped_probe_loads_and_reads_the_policys_widths():
    shipped = POLICY / "probes"
    config = model.read_config(POLICY)
    d, L, H = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    report = json.loads((shipped / "probes.json").read_text())
    assert "seconds" not in report and report["heldout"]["pair"]["all"] > 0.5
    head = pair.Pair.load(shipped / "pair")
    assert head.stage1.w.numel() == d and head.stage2.w.numel() == len(head.stats) * H * L + 1
    for name in probes.FEATURES:
        probe = probes.Probe.load(shipped / f"{name}.safetensors")
        assert probe.info["feature"] == name and "fit_seconds" not in probe.info
        assert probe.w.numel() == probes.feature_width(name, d, L, H)


def test_the_default_run_reads_the_shipped_probes_without_the_lab(tmp_path):
    # a fresh interpreter with the core alone (no lab module imported): one step, no evaluation
    code = ("import sys, grpo; grpo.main(sys.argv[1:]); "
            "assert not any(m.startswith('lab') for m in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, "--reward", "pair", "--steps", "1",
                        "--no-eval", "--out", str(tmp_path / "run")], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), PAIR_CACHE=str(tmp_path / "c")))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"probes: {POLICY / 'probes'}" in r.stdout or "probes: data/shop-policy/probes" \
        in r.stdout, r.stdout
    (rec,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert rec["step"] == 1 and rec["probe_auroc"] is not None
    assert not (tmp_path / "c" / "grpo-probes").exists()        # nothing fitted


def test_a_shipped_probe_below_chance_at_a_slip_is_warned_about(capsys):
    # the long world's PAIR ranks its divided slip above the same turn made right
    where = ROOT / "data" / "shop-long-policy" / "probes"
    report = json.loads((where / "probes.json").read_text())
    assert report["heldout"]["pair"]["slip=divided"] < 0.5
    pair.read_report(where, "pair", print)
    assert "warning: the pair probe ranks the divided slip above the same turn made right" in \
        capsys.readouterr().out
