"""model.py on a CUDA device (skipped without one): the decoding step compiled and captured as a
CUDA graph gives the eager step's tokens and statistics, and the update's recomputed, chunked
log-probabilities give the plain path's gradients."""
import pytest
import torch

import model as M
from test_model import check_decoding, check_update_logprobs, random_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("fused", [True, False])
def test_cuda_graph_decoding_equals_the_straightforward_loop(monkeypatch, fused):
    """Compiled with COMPILE_OPTIONS["cuda"] (one compiled step, a CUDA graph recorded for each
    shape, the cache written in place at fixed addresses) over two greedy generations whose
    shapes change; fused: the small model's fused weights, else the modules (as a bfloat16 7B
    decodes)."""
    torch._dynamo.reset()
    monkeypatch.setattr(M, "COMPILE", True)
    monkeypatch.setattr(M, "_compiled", {})
    monkeypatch.setattr(M, "KEY_BLOCK", 4)
    if not fused:
        monkeypatch.setattr(M, "FUSE_MAX_ELEMENTS", 0)
    model = random_model("qwen2-gqa-tied", seed=11).cuda()
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (6, 3, 9)]
    check_decoding(model, prompts, 0.0, seed=5, h_atol=1e-4)
    check_decoding(model, prompts[:2], 0.0, seed=6, h_atol=1e-4)
    assert "cuda" in M._compiled and "failed" not in M._compiled
    skips = torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0)
    assert skips == 0, f"CUDA graphs skipped {skips} times (TORCH_LOGS=perf_hints says why)"


def test_cuda_update_logprobs_equal_the_plain_path(monkeypatch):
    """The update's recomputed, chunked log-probabilities against the plain path, on CUDA."""
    check_update_logprobs(monkeypatch, "qwen2-gqa-tied", "cuda", 5)
    check_update_logprobs(monkeypatch, "qwen2-gqa-tied", "cuda", None)
