"""lab/bench.py tells a CPU user the truth: a target judged only where it was set, the parameter
count of a small model readable, no profiler lines on stderr."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab import bench

ROOT = Path(__file__).resolve().parents[1]


def test_parameter_counts():
    assert bench.count_text(291_456) == "0.29M"           # the built-in policy
    assert bench.count_text(494_032_768) == "494.03M"
    assert bench.count_text(7_615_616_512) == "7.62B"


def test_a_target_set_elsewhere_is_shown_not_judged(capsys):
    bench.report("stats / plain", 1.56, "<=1.15", False, "set for widths of 896 and up")
    bench.report("stats / plain", 1.56, "<=1.15", False)
    bench.report("stats / plain", 1.10, "<=1.15", True)
    here, missed, ok = capsys.readouterr().out.splitlines()
    assert here.endswith("1.56x  target <=1.15  n/a (set for widths of 896 and up)")
    assert missed.endswith("MISSED") and ok.endswith("ok")


def test_profiler_lines_kept_off_stderr_and_the_rest_passed_on(capfd):
    def fn():
        os.write(2, b"a line of the measured call\n")
        return torch.ones(1000) + 1
    assert bench.peak_bytes(fn, torch.device("cpu")) > 0
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err
    assert "a line of the measured call" in err


def test_a_new_user_s_command_on_the_cpu():
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, "-m", "lab.bench", "--model", "data/shop-policy",
                        "--threads", "1", "--sections", "forward", "generation",
                        "--seq-lens", "256", "--span", "64", "--new-tokens", "8", "--repeats", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "data/shop-policy: 0.29M parameters, bfloat16" in r.stdout
    assert "USDT" not in r.stderr + r.stdout
    scoped = [line for line in r.stdout.splitlines()
              if re.search(r"forward with stats / plain|generation with stats / without|"
                           r"ours \(with stats\) / transformers", line)]
    assert len(scoped) == 6             # 2 of the forward, 2 x 2 of generation
    for line in scoped[:2]:
        assert line.endswith("n/a (set for widths of 896 and up)"), line
    for line in scoped[2:]:
        assert line.endswith("n/a (the CPU's are set for --dtype float32)"), line
