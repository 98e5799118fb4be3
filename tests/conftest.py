"""Shared test fixtures: the ../shared material (skipped cleanly when absent), the 0.5B model."""
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHARED = Path(os.environ.get("PAIR_SHARED", ROOT.parent / "shared"))
RELEASE = SHARED / "data" / "pair-release"
QWEN_TOKENIZER = SHARED / "data" / "qwen2.5-tokenizer"
QWEN05B = Path(os.environ.get("PAIR_QWEN05B",
                              Path.home() / ".cache" / "pair-models" / "qwen2.5-0.5b"))


@pytest.fixture
def release_dir():
    if not RELEASE.is_dir():
        pytest.skip(f"released splits not found at {RELEASE}")
    return RELEASE


@pytest.fixture
def qwen_tokenizer_dir():
    if not (QWEN_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"Qwen2.5 tokenizer not found at {QWEN_TOKENIZER}")
    return QWEN_TOKENIZER


@pytest.fixture
def qwen05b_dir():
    if not (QWEN05B / "model.safetensors").is_file():
        pytest.skip(f"0.5B checkpoint not found at {QWEN05B} (build it with "
                    "../shared/tools/make_qwen05b.sh)")
    return QWEN05B


@pytest.fixture
def one_thread():
    # Tiny matrices on a shared 2-core machine: thread hand-offs cost more than the math.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
