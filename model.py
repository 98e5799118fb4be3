"""The policy: a hand-written Qwen2-family decoder reporting its own hidden states and attention
statistics; its config and checkpoint loading (a directory or a Hub name), KV cache, compiled
decoding step, tokenizer and chat template, the update's log-probabilities, LoRA in PEFT's layout.

Each decoding step returns, besides the logits, the L+1 hidden states and per layer and head the
six statistics of its softmax row (STATS, stats_from; METHOD.md §4). Departure from the authors'
release: std is over the i+1 causal keys of row i, not the padded row. Masks come from positions:
key slot j is visible to the query at position p iff j <= p (and p - j < window); the cache is
indexed by absolute position, so a pad past a row's tokens is invisible until overwritten.
"""
import contextlib
import hashlib
import json
import math
import os
import re
import struct
import sys
import threading
from bisect import bisect_right
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

import requests
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import nn, Tensor

STATS = ("max", "std", "prefix", "self", "entropy", "lookback")
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------
# The config and loading a checkpoint: a local directory or a Hugging Face Hub name

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM"}      # model_type -> architecture
# transformers < 5 saves only the keys that differ from its class defaults; these differ from ours
ARCH_DEFAULTS = {"Qwen2ForCausalLM": {"max_window_layers": 28},
                 "MistralForCausalLM": {"sliding_window": 4096}}
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
         "sliding_window")      # positive integers
INDEX = "model.safetensors.index.json"


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded exactly; the message names file and tensor."""


@dataclass
class Config:
    """config.json: field names are its keys (others are dropped); a None default: may be null."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    architectures: list[str] = field(default_factory=lambda: ["Qwen2ForCausalLM"])
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: float | None = None         # transformers < 5 writes the RoPE base here,
    rope_parameters: dict | None = None     # transformers >= 5 writes {"rope_theta", "rope_type"}
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False            # Llama's switch; Qwen2 always has a QKV bias
    mlp_bias: bool = False
    sliding_window: int | None = None
    use_sliding_window: bool = False        # Qwen2: windows only when set, from max_window_layers
    max_window_layers: int = 0
    layer_types: list[str] | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        arch = d.get("architectures") or [ARCHITECTURES.get(d.get("model_type"))]
        if not (isinstance(arch, list) and arch[0] in ARCHITECTURES.values()):
            raise ValueError(f"architectures {arch!r}: unsupported (supported: "
                             f"{', '.join(ARCHITECTURES.values())})")
        d = {**ARCH_DEFAULTS.get(arch[0], {}), **d, "architectures": arch}
        cfg = cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})   # missing: TypeError
        cfg.validate()
        return cfg

    def validate(self):
        """What would break the build or run wrong silently; a check may read the ones before."""
        def number(v):
            return type(v) in (int, float) and 0 < v < math.inf

        n, vocab = self.num_hidden_layers, self.vocab_size
        checks = [  # (keys, test of a value, what it must be)
            (SIZES, lambda v: type(v) is int and v >= 1, "a positive integer"),
            (("eos_token_id",), lambda v: all(type(i) is int and 0 <= i < vocab for i in (
                v if isinstance(v, list) else [v])),    # an eos never drawn would never stop
             f"a token id below vocab_size {vocab}, or a list of them"),
            (("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"),
             lambda v: isinstance(v, bool), "true or false"),
            (("rms_norm_eps", "rope_theta"), number, "a positive number"),
            (("rope_parameters", "rope_scaling"), lambda v: isinstance(v, dict)
             and (v.get("rope_theta") is None or number(v["rope_theta"]))
             and v.get("rope_type", v.get("type", "default")) == "default",
             "a JSON object of default RoPE with a positive rope_theta"),
            (("hidden_act",), lambda v: v == "silu", "silu (the only activation here)"),
            (("layer_types",), lambda v: isinstance(v, list) and len(v) == n
             and all(isinstance(t, str) for t in v), f"a list of {n} names"),
            (("hidden_size",), lambda v: self.head_dim or v % self.num_attention_heads == 0,
             "a multiple of num_attention_heads (or head_dim given)"),
            (("num_attention_heads",), lambda v: v % self.n_kv_heads == 0,
             "a multiple of num_key_value_heads")]
        nullable = {f.name for f in fields(self) if f.default is None}
        for keys, ok, want in checks:
            for key in keys:
                if not ((v := getattr(self, key)) is None and key in nullable or ok(v)):
                    raise ValueError(f"{key} must be {want}, got {v!r}")

    @property
    def arch(self) -> str:
        return self.architectures[0]

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rope_base(self) -> float:
        default = 10000.0 if self.rope_theta is None else self.rope_theta
        return float((self.rope_parameters or {}).get("rope_theta", default))

    def window(self, layer: int) -> int | None:
        """Sliding-window size of one layer (None = full causal attention), as transformers does."""
        if self.arch == "MistralForCausalLM":
            return self.sliding_window
        if self.arch == "Qwen2ForCausalLM" and self.use_sliding_window and self.sliding_window:
            sliding = (self.layer_types[layer] == "sliding_attention" if self.layer_types
                       is not None else layer >= self.max_window_layers)
            return self.sliding_window if sliding else None
        return None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:    # deep nesting: RecursionError
        raise CheckpointError(f"{path}: not readable JSON ({type(e).__name__}: {e})") from None


def read_config(directory) -> Config:
    path = Path(directory) / "config.json"
    try:
        return Config.from_dict(read_json(path))
    except (TypeError, ValueError, AttributeError) as e:     # AttributeError: not an object
        raise CheckpointError(f"{path}: {e}") from None


def weight_files(directory: Path) -> list[str]:
    """model.safetensors, or the shards the index maps tensors to: files beside it, never above."""
    if not (index := directory / INDEX).is_file():
        return ["model.safetensors"]
    weight_map = read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no weight_map")
    for file in weight_map.values():
        if not (isinstance(file, str) and file == Path(file).name and
                file.endswith(".safetensors") and not file.startswith(".")):
            raise CheckpointError(f"{index}: {file!r} is not a safetensors file beside the index")
    return sorted(set(weight_map.values()))


def read_state_dict(directory: Path, expected: dict, tied: bool, dtype, device) -> dict:
    """Every tensor of `expected` (name -> shape) as dtype on device; a missing, unexpected or
    misshapen tensor, or NaN (a stop token forever), is an error naming it. Tied: no lm_head."""
    state = {}
    for path in (directory / file for file in weight_files(directory)):
        try:
            f = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:      # safetensors' own error names no file
            raise CheckpointError(f"{path}: missing, truncated or corrupt safetensors file "
                                  f"({e})") from None
        with f:
            for name in sorted(k for k in f.keys() if not (tied and k == "lm_head.weight")):
                if name not in expected or name in state:
                    raise CheckpointError(f"{path}: unexpected tensor {name} (or twice)")
                if (shape := tuple(f.get_slice(name).get_shape())) != expected[name]:
                    raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)}, "
                                          f"expected {list(expected[name])}")
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    raise CheckpointError(f"{path}: tensor {name} holds NaN or infinite values")
                state[name] = tensor.to(device=device, dtype=dtype)
    if missing := sorted(set(expected) - set(state)):
        raise CheckpointError(f"{directory}: missing tensor {missing[0]} ({len(missing)} missing)")
    return state


def checkpoint_sha256(directory) -> str:
    """A sha256 of what a checkpoint computes with, keying what is made from it. Files up to 64
    MiB are hashed whole; a larger safetensors file gives its size, header and the first and last
    4 KiB of every tensor (under a second at 7B): fine-tuning or merging changes those ends."""
    directory, block = Path(directory), 4096
    h = hashlib.sha256(b"checkpoint/1")
    names = ["config.json", "tokenizer.json"] + [INDEX] * (directory / INDEX).is_file()
    for name in names + weight_files(directory):
        try:
            with open(path := directory / name, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(f"{name}\0{size}\0".encode())
                if size <= 64 << 20 or not name.endswith(".safetensors"):
                    h.update(f.read())
                    continue
                n = struct.unpack("<Q", f.read(8))[0]
                h.update(header := f.read(min(n, size)))
                for key, entry in sorted(json.loads(header).items()):
                    if key != "__metadata__":
                        start, end = (8 + n + int(o) for o in entry["data_offsets"])
                        for at in sorted({start, max(start, end - block)}):
                            f.seek(at)
                            h.update(f.read(min(block, end - at)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
            raise CheckpointError(f"{path}: missing, truncated or corrupt "
                                  f"({type(e).__name__}: {e})") from None
    return h.hexdigest()


HUB_MANIFEST = ".pair-complete.json"    # written last: the copy is complete


def resolve(path_or_repo) -> Path:
    """A checkpoint directory, or the local copy of a Hub model name (fetched once)."""
    directory = Path(path_or_repo)
    if directory.is_dir():
        return directory
    if directory.exists() or not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*",
                                              str(path_or_repo)):
        raise CheckpointError(f"{directory}: no such directory (nor a Hub model name like "
                              "Qwen/Qwen2.5-7B-Instruct)")
    if Path(first := directory.parts[0]).is_dir():      # a misspelt path, not a Hub name
        raise CheckpointError(f"{directory}: no such directory ({first}/ is a local directory)")
    return fetch_from_hub(str(path_or_repo))


def fetch_from_hub(repo_id: str) -> Path:
    """config.json, tokenizer.json and the weights of a Hub model, downloaded once into
    $PAIR_CACHE/<org>--<name>; HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE as huggingface_hub has them."""
    folder = cache_root() / repo_id.replace("/", "--")
    if (folder / HUB_MANIFEST).is_file():
        return folder
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise CheckpointError(f"cannot fetch model {repo_id!r}: HF_HUB_OFFLINE is set; no complete "
                              f"copy in {folder} (copy the files there, or give a local directory)")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    token = os.environ.get("HF_TOKEN")  # requests drops it on the redirect to the CDN
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    import fcntl                        # POSIX only, so imported where it is needed
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # torchrun's ranks: one downloads, the others wait
        if not (folder / HUB_MANIFEST).is_file():
            base = f"{endpoint}/{repo_id}/resolve/main/"
            for name in ("config.json", "tokenizer.json", INDEX):
                _download(base, folder / name, headers, required=name != INDEX)
            for name in weight_files(folder):
                _download(base, folder / name, headers)
            write_atomic(folder / HUB_MANIFEST, json.dumps({"repo": repo_id, "endpoint": endpoint}))
    return folder


def _download(base: str, dest: Path, headers: dict, required=True):
    """base + dest.name into dest via a .part file (requests refuses a short body)."""
    if dest.is_file():
        return
    url, part = base + quote(dest.name), dest.with_name(dest.name + ".part")
    denied = "access denied (private or gated?); set HF_TOKEN to a token that has access"
    try:
        with requests.get(url, headers=headers, stream=True, timeout=(10, 60)) as r:
            if r.status_code == 404 and not required:
                return
            if r.status_code >= 400:
                why = {401: denied, 403: denied, 404: "not found"}.get(r.status_code, r.reason)
                raise CheckpointError(f"{url}: HTTP {r.status_code}: {why}")
            with open(part, "wb") as f:
                for chunk in r.iter_content(chunk_size=1 << 20):
                    f.write(chunk)
    except requests.RequestException as e:
        part.unlink(missing_ok=True)
        raise CheckpointError(f"cannot fetch {url}: network unreachable or connection lost "
                              f"({type(e).__name__}); no complete copy in {dest.parent}") from None
    os.replace(part, dest)


def load_model(path_or_repo, dtype=torch.float32,
               device="cpu") -> tuple["Transformer", "Tokenizer"]:
    """A checkpoint directory or Hub model name -> (model, tokenizer) on `device`, model frozen."""
    directory = resolve(path_or_repo)
    config = read_config(directory)
    tokenizer = Tokenizer.from_file(directory)
    with torch.device("meta"):      # built without memory; adopts the loaded tensors (assign)
        model = Transformer(config)
    tied = config.tie_word_embeddings
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()
                if not (tied and name == "lm_head.weight")}
    state = read_state_dict(directory, expected, tied, dtype, torch.device(device))
    model.load_state_dict(state, strict=not tied, assign=True)     # names checked as read
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight   # assign=True broke the tie
    model.requires_grad_(False).eval()
    model.name_or_path = str(path_or_repo)        # recorded in saved adapters' configs
    model.checkpoint_dir = directory              # what checkpoint_sha256 reads
    return model, tokenizer


def input_device(model: "Transformer") -> torch.device:
    """Where input ids go: the embedding's device (the first one of a split model)."""
    return model.model.embed_tokens.weight.device


# ----------------------------------------------------------------------------------------------
# The transformer, its decoding step and the update's log-probabilities; module names are the
# Hugging Face weight keys, RoPE is written as theirs for Qwen (rotate_half: no permutation).

def rope_tables(inv_freq: Tensor, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
    freqs = positions[..., None].float() * inv_freq.to(positions.device)   # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                 # (B, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)                                             # rotate_half
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]   # (B, 1, T, D)


def attention_mask(positions: Tensor, key_positions: Tensor, window: int | None) -> Tensor:
    """(B, 1, T, S) bool: key j is visible to query t iff kpos_j <= pos_t (and within window)."""
    q, k = positions[:, :, None], key_positions[:, None, :]
    mask = k <= q
    if window is not None:
        mask &= q - k < window
    return mask[:, None]


def static_address(t: Tensor) -> Tensor:
    """t, marked as one a captured CUDA graph may write in place (at the same address)."""
    if t.is_cuda:
        torch._dynamo.mark_static_address(t, guard=False)
    return t


class KVCache:
    """One layer's keys and values (B, KV, capacity, D) on its device; slot = absolute position."""

    def __init__(self, batch_size, n_kv_heads, head_dim, capacity, dtype, device):
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        self.k = static_address(torch.zeros(shape, dtype=dtype, device=device))
        self.v = static_address(torch.zeros(shape, dtype=dtype, device=device))
        self.lengths = torch.zeros(batch_size, dtype=torch.long)   # real tokens a row, on the CPU

    def grow(self, size: int):
        if size <= self.k.shape[2]:
            return
        new = (max(size, 2 * self.k.shape[2]) + 255) // 256 * 256
        self.k, self.v = (static_address(torch.cat((t, t.new_zeros(
            *t.shape[:2], new - t.shape[2], t.shape[3])), 2)) for t in (self.k, self.v))

    def write(self, k: Tensor, v: Tensor, positions: Tensor, size: int) -> tuple[Tensor, Tensor]:
        """Store k, v (B, KV, T, D) at slots `positions` (B, T); return slots [0, size)."""
        self.grow(size)
        rows = torch.arange(k.shape[0], device=self.k.device)[:, None]
        self.k[rows, :, positions] = k.transpose(1, 2).to(self.k.dtype)   # (B, T, KV, D)
        self.v[rows, :, positions] = v.transpose(1, 2).to(self.v.dtype)
        return self.k[:, :, :size], self.v[:, :, :size]


def set_lengths(cache: list[KVCache], lengths: Tensor):
    """Declare how many real tokens each row holds (slots past them are free)."""
    for layer_cache in cache:
        layer_cache.lengths = lengths.detach().to("cpu", torch.long).clone()


def stats_from(mx, sum_sq, prefix, self_, pos, start) -> dict[str, Tensor]:
    """The six statistics (METHOD.md §4) of softmax rows p_i, i = pos, from mx = max_j p_ij,
    sum_sq = sum_j p_ij^2, prefix = sum_{j < start} p_ij, self_ = sum_{start <= j <= i} p_ij:
        std = sqrt(sum_sq / n - 1 / n^2), n = i + 1 causal keys (sum_j p_ij = 1)
        entropy = -log sum_sq
        lookback = m_ctx / (m_ctx + m_new), m_ctx = prefix / start, m_new = self_ / (i - start + 1)
    (lookback 0 where start = 0); max, prefix and self as given. Arguments broadcast."""
    n = (pos + 1).float()                                       # causal keys j <= i
    s0 = start.float()
    m_ctx = prefix / s0.clamp(min=1)
    m_new = self_ / (pos - start + 1).float()
    return {"max": mx, "std": (sum_sq / n - 1 / n.square()).clamp(min=0).sqrt(),
            "prefix": prefix, "self": self_, "entropy": -sum_sq.log(),
            "lookback": torch.where(s0 > 0, m_ctx / (m_ctx + m_new), torch.zeros_like(m_ctx))}


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()                  # cast back before the weight, in Hugging Face's order
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        d, H, KV, D = (config.hidden_size, config.num_attention_heads, config.n_kv_heads,
                       config.head_size)
        self.n_heads, self.n_kv_heads, self.head_dim, self.scale = H, KV, D, D ** -0.5
        bias = config.arch == "Qwen2ForCausalLM" or config.attention_bias    # Qwen2: always
        self.q_proj = nn.Linear(d, H * D, bias=bias)
        self.k_proj = nn.Linear(d, KV * D, bias=bias)
        self.v_proj = nn.Linear(d, KV * D, bias=bias)
        self.o_proj = nn.Linear(H * D, d, bias=config.attention_bias)

    def forward(self, x, cos, sin, mask, positions, cache=None):
        """x (B, T, d) -> (B, T, d); mask (B, 1, T, S) or None (causal); a cache gets k, v."""
        B, T, _ = x.shape                       # (a split model's hooks moved the inputs here)
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)   # (B, H or KV, T, D)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(k, v, positions, mask.shape[-1])   # (B, KV, S, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FusedWeights(NamedTuple):     # a block's projections as decoding applies them
    qkv: tuple[Tensor, Tensor | None]       # (weight, bias) of q, k and v side by side
    o: tuple[Tensor, Tensor | None]
    gate_up: tuple[Tensor, Tensor | None]   # gate and up side by side
    down: tuple[Tensor, Tensor | None]


class Block(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, positions, cache=None, mlp_chunk=None):
        """mlp_chunk: the MLP this many tokens at a time, each chunk recomputed in backward."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, positions, cache)
        h = self.post_attention_layernorm(x)
        if mlp_chunk is None or x.shape[1] <= mlp_chunk:
            return x + self.mlp(h)
        return x + torch.cat([torch.utils.checkpoint.checkpoint(
            self.mlp, h[:, i:i + mlp_chunk], use_reentrant=False)
            for i in range(0, x.shape[1], mlp_chunk)], 1)

    def decode(self, x, cos, sin, bias, pos, kv, before=None, w=None):
        """The block on one token per row, x (B, 1, d) at positions i = pos (B,) -> (x, numbers).
        k, v go to slots pos of kv = (k cache, v cache); the query attends over slots [0, S):
            p_ij = softmax_j(q_i . k_j / sqrt(D) + bias_j)   (bias (B, 1, 1, S): 0 or -inf)
        By hand in float32, not SDPA, because p gives the statistics: numbers = (max_j p_ij,
        sum_j p_ij^2, prefix = sum_j p_ij before_j, self = 1 - prefix), each (B, H, 1), where
        before (B, 1, 1, S) is 1 on slots j < span_start. w: decode_weights(), or None."""
        a, h = self.self_attn, self.input_layernorm(x)
        B, H, KV, D = x.shape[0], a.n_heads, a.n_kv_heads, a.head_dim
        if w is None:
            q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
            q = apply_rope(q.view(B, 1, H, D).transpose(1, 2), cos, sin)   # (B, H, 1, D)
            k = apply_rope(k.view(B, 1, KV, D).transpose(1, 2), cos, sin)
        else:       # q and k side by side from one matmul: rotated together, in one pass
            qk, v = F.linear(h, *w.qkv).split(((H + KV) * D, KV * D), -1)
            q, k = apply_rope(qk.view(B, 1, H + KV, D).transpose(1, 2), cos, sin).split((H, KV), 1)
        k_cache, v_cache = kv
        rows = torch.arange(B, device=pos.device)
        k_cache[rows, :, pos] = k[:, :, 0].to(k_cache.dtype)                 # (B, KV, D)
        v_cache[rows, :, pos] = v.view(B, KV, D).to(v_cache.dtype)
        S = bias.shape[-1]
        k, v = k_cache[:, :, :S], v_cache[:, :, :S]                         # (B, KV, S, D)
        q = (q.float() * a.scale).reshape(B, KV, H // KV, D)                # (B, KV, G, D)
        p = torch.softmax(q @ k.float().transpose(-1, -2) + bias, dim=-1)  # (B, KV, G, S)
        out = (p @ v.float()).view(B, 1, H * D).to(h.dtype)
        numbers = None
        if before is not None:
            p = p.view(B, H, 1, -1)                                         # (B, H, 1, S)
            prefix = torch.linalg.vecdot(p, before)
            numbers = (p.amax(-1), torch.linalg.vecdot(p, p), prefix, 1 - prefix)
        x = x + (a.o_proj(out) if w is None else F.linear(out, *w.o))
        h = self.post_attention_layernorm(x)
        if w is None:
            return x + self.mlp(h), numbers
        gate, up = F.linear(h, *w.gate_up).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, *w.down), numbers

    def decode_weights(self) -> FusedWeights | None:
        """The projections fused, an enabled adapter merged in: 4 matmuls a token, not 7 (21 with
        adapters), rebuilt when a tensor changes. None (use the modules) where merging changes
        the numbers (not float32, dropout on), a gradient is wanted, or the copy costs too much."""
        a, m = self.self_attn, self.mlp
        groups = ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate_proj, m.up_proj),
                  (m.down_proj,))
        linears = [lin for group in groups for lin in group]
        big = sum(lin.weight.numel() for lin in linears) > FUSE_MAX_ELEMENTS
        if torch.is_grad_enabled() or big or any(lin.weight.dtype != torch.float32 or getattr(
                lin, "dropout", 0) and lin.training for lin in linears):
            return None
        key = [(getattr(lin, "enabled", None), [(id(t), t.data_ptr(), t._version)
                                                for t in lin.parameters()]) for lin in linears]
        if getattr(self, "_fused", (None,))[0] != key:
            with torch.no_grad():
                self._fused = key, FusedWeights(*[_fuse(group) for group in groups])
        return self._fused[1]


def _fuse(linears) -> tuple[Tensor, Tensor | None]:
    """One (weight, bias) for the projections side by side, adapters merged: W + scaling * B A."""
    weight = torch.cat([lin.weight + lin.scaling * (lin.lora_B.weight @ lin.lora_A.weight)
                        if isinstance(lin, LoRALinear) and lin.enabled else lin.weight
                        for lin in linears])
    return weight, None if all(lin.bias is None for lin in linears) else torch.cat(
        [lin.weight.new_zeros(lin.out_features) if lin.bias is None else lin.bias
         for lin in linears])


FUSE_MAX_ELEMENTS = 1 << 22     # 16 MB of float32: the built-in policy's blocks, not a 0.5B's


class Transformer(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.model = nn.Module()        # the `model.` prefix of the checkpoint keys
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        d = config.head_size    # a plain tensor on the CPU (the model may be built on "meta")
        self.inv_freq = 1.0 / config.rope_base ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                                device="cpu") / d)
        self.windows = [config.window(i) for i in range(config.num_hidden_layers)]

    def new_cache(self, batch_size: int, capacity: int = 256) -> list[KVCache]:
        """One empty KV cache per layer, on that layer's device and in its dtype."""
        c = self.config
        return [KVCache(batch_size, c.n_kv_heads, c.head_size, capacity,
                        layer.input_layernorm.weight.dtype, layer.input_layernorm.weight.device)
                for layer in self.model.layers]

    def forward(self, input_ids, positions=None, cache=None) -> Tensor:
        """input_ids (B, T) -> logits (B, T, V) in float32 (trunk, then the head)."""
        return self.lm_head(self.trunk(input_ids, positions, cache)).float()

    def trunk(self, input_ids, positions=None, cache=None, recompute=False) -> Tensor:
        """Up to the final norm: (B, T) -> (B, T, d) at positions (B, T) (default: after the cache's
        tokens, else 0..T-1); recompute: each block (MLP_CHUNK tokens a time) again in backward."""
        B, T = input_ids.shape
        dev = self.model.embed_tokens.weight.device
        # from position 0 SDPA's causal kernel needs no mask (no token sees a right pad)
        fused_causal = (positions is None and cache is None and T > 1
                        and all(w is None for w in self.windows))
        if positions is None:
            start = cache[0].lengths if cache is not None else torch.zeros(B, dtype=torch.long)
            positions = start[:, None] + torch.arange(T)
        positions = positions.to(dev)
        key_pos = positions if cache is None else \
            torch.arange(int(positions.max()) + 1, device=dev).expand(B, -1)   # cache slots
        masks = {w: None if fused_causal else attention_mask(positions, key_pos, w)
                 for w in set(self.windows)}
        cos, sin = rope_tables(self.inv_freq, positions, self.model.embed_tokens.weight.dtype)
        x = self.model.embed_tokens(input_ids.to(dev))                          # (B, T, d)
        for i, layer in enumerate(self.model.layers):
            inputs = (x, cos, sin, masks[self.windows[i]], positions,
                      cache[i] if cache is not None else None)
            if recompute and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    layer, *inputs, mlp_chunk=max(1, MLP_CHUNK // B), use_reentrant=False)
            else:
                x = layer(*inputs)
        if cache is not None:
            set_lengths(cache, torch.maximum(cache[0].lengths, positions.max(1).values.cpu() + 1))
        return self.model.norm(x)

    def decode(self, tokens, cache, span_start=None, w=None):
        """One token per row, tokens (B,), at each row's cache length (the caller advances it) ->
        (logits (B, V) float32, hidden (L+1, B, d), stats (B, L, H, 6) in STATS order); hidden and
        stats None without span_start (B,), each row's turn's first position. Compiled if it can."""
        lengths = cache[0].lengths                          # (B,) on the CPU: no device sync
        size = int(lengths.max()) + 1                       # key slots [0, size) are in use
        for layer_cache in cache:
            layer_cache.grow(size)
        w = self.decode_weights() if w is None else w
        args = (tokens, lengths, span_start, [c.k for c in cache], [c.v for c in cache], w)
        step = compiled_step(w, cache)
        if step is not None:
            try:
                blocks = min(cache[0].k.shape[2], -(-size // KEY_BLOCK) * KEY_BLOCK)
                if not cache[0].k.is_cuda:
                    return step(self, *args, blocks)
                # a CUDA graph reads device tensors only; its next replay overwrites its outputs
                dev = cache[0].k.device
                self.inv_freq = self.inv_freq.to(dev)
                on_dev = [None if t is None else t.to(dev) for t in args[:3]]
                torch.compiler.cudagraph_mark_step_begin()
                out = step(self, *on_dev, *args[3:], blocks)
                return tuple(None if t is None else t.clone() for t in out)
            except (torch._dynamo.exc.TorchDynamoException,   # no C++ compiler, or a limit:
                    torch._dynamo.exc.FailOnRecompileLimitHit) as e:   # eager from now on
                _compiled["failed"] = e
                print(f"model.py: decoding eagerly, torch.compile failed: {type(e).__name__}: "
                      f"{(str(e).strip().splitlines() or [''])[0]}", file=sys.stderr, flush=True)
        return self.decode_step(*args, size)

    def decode_weights(self) -> list:
        """Each block's decode_weights(), for the weights as they are."""
        return [layer.decode_weights() for layer in self.model.layers]

    def decode_step(self, tokens, lengths, span_start, ks, vs, w, size):
        """decode's computation (what compiled_step compiles) on caches ks, vs, slots [0, size)."""
        dev = self.model.embed_tokens.weight.device
        pos = lengths.to(dev)
        key_pos = torch.arange(size, device=dev)
        visible = key_pos <= pos[:, None]                                   # (B, S)
        bias = {win: torch.where(visible if win is None else
                                 visible & (pos[:, None] - key_pos < win),
                                 0.0, float("-inf"))[:, None, None] for win in set(self.windows)}
        cos, sin = rope_tables(self.inv_freq, pos[:, None], self.model.embed_tokens.weight.dtype)
        start = None if span_start is None else span_start.to(dev)
        before = None if start is None else \
            (key_pos < start[:, None]).float()[:, None, None]              # (B, 1, 1, S)
        x = self.model.embed_tokens(tokens.to(dev)[:, None])                # (B, 1, d)
        hidden, numbers = [x], []
        for i, layer in enumerate(self.model.layers):
            on = ks[i].device                   # the block's own (a split model's differ)
            x, n = layer.decode(*(t.to(on) for t in (x, cos, sin, bias[self.windows[i]], pos)),
                                (ks[i], vs[i]), before if before is None else before.to(on), w[i])
            numbers.append(n)
            if i < len(self.model.layers) - 1:
                hidden.append(x)
        x = self.model.norm(x)                  # on the head's device (a split model's hooks)
        logits = self.lm_head(x[:, 0]).float()
        if start is None:
            return logits, None, None
        out = logits.device                     # where the caller accumulates (TurnStats)
        hidden.append(x)
        four = [torch.cat([n[k].to(out) for n in numbers], -1) for k in range(4)]   # (B, H, L)
        stats = stats_from(*(t.transpose(1, 2) for t in four), pos.to(out)[:, None, None],
                           start.to(out)[:, None, None])                    # (B, L, H) each
        return (logits, torch.cat([h.to(out) for h in hidden], 1).transpose(0, 1),
                torch.stack([stats[name] for name in STATS], -1))


COMPILE = os.environ.get("PAIR_COMPILE", "1") != "0"     # 0: decode eagerly everywhere
KEY_BLOCK = 128         # key slots attended in blocks of this many, not the whole capacity
RECOMPILE_LIMIT = 32    # a graph per relation among the sizes: up to 11, over torch's default 8
COMPILE_OPTIONS = {"cpu": {}, "cuda": {"mode": "reduce-overhead", "dynamic": True}}
_compiled = {}          # device kind: Transformer.decode_step compiled; "failed": why given up


def compiled_step(w: list, cache: list[KVCache]):
    """Transformer.decode_step compiled, or None where it does not pay (a split model, on the CPU
    unfused weights) or is not wanted. On a GPU a CUDA graph too (gpt-fast: one launch)."""
    kind = cache[0].k.device.type
    if (not COMPILE or "failed" in _compiled or len({c.k.device for c in cache}) > 1
            or kind not in ("cpu", "cuda") or kind == "cpu" and any(x is None for x in w)):
        return None
    if kind not in _compiled:
        print("model.py: compiling the decoding step (under a minute the first time on a machine, "
              "seconds later; PAIR_COMPILE=0 decodes eagerly)", file=sys.stderr, flush=True)
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        if COMPILE_OPTIONS[kind].get("dynamic"):
            # each size its own symbol: "duck" sizing merges sizes equal at the first call
            torch.fx.experimental._config.use_duck_shape = False
        _compiled[kind] = torch.compile(Transformer.decode_step, fullgraph=True,
                                        **COMPILE_OPTIONS[kind])
    return _compiled[kind]


MLP_CHUNK = 4096          # tokens (rows x positions) a recomputed block's MLP runs at a time
LOGITS_CHUNK = 1 << 24    # logits at a time (64 MB): 152k float32 logits are 0.58 GiB a 1k tokens


def token_logprobs(policy, ids: Tensor, mask: Tensor, temperature: float = 1.0) -> Tensor:
    """log pi(x_j | x_<j) at the masked positions j, row-major -> (N,) float32. The head runs on
    those only, LOGITS_CHUNK // V at a time, recomputed in backward: never all (N, V) logits."""
    h = policy.trunk(ids, recompute=True)[:, :-1]               # position j predicts x_{j+1}
    target = mask[:, 1:].to(h.device)
    h, labels = h[target], ids[:, 1:].to(h.device)[target]      # (N, d), (N,)
    n = max(1, LOGITS_CHUNK // policy.config.vocab_size)
    parts = []
    for a in range(0, len(labels), n):
        inputs = (policy.lm_head, h[a:a + n], labels[a:a + n], temperature)
        parts.append(torch.utils.checkpoint.checkpoint(head_logprobs, *inputs, use_reentrant=False)
                     if torch.is_grad_enabled() else head_logprobs(*inputs))
    return torch.cat(parts) if parts else torch.zeros(0, device=h.device)


def head_logprobs(lm_head: nn.Module, h: Tensor, labels: Tensor, temperature: float) -> Tensor:
    """log softmax(lm_head(h) / T)[label] of each row: (n, d), (n,) -> (n,) float32."""
    logits = lm_head(h).float()                                 # (n, V)
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)


# ----------------------------------------------------------------------------------------------
# Tokenizer and the chat format (METHOD.md §2, §3); text kept encodable

class Tokenizer:
    """A tokenizers.Tokenizer and the ChatML template; only the template puts special tokens."""

    def __init__(self, tok):
        self.tok = tok
        tok.encode_special_tokens = True        # an attribute of the instance: never saved
        for name, text in (("im_start_id", "<|im_start|>"), ("im_end_id", "<|im_end|>"),
                           ("pad_id", "<|endoftext|>")):
            if (i := tok.token_to_id(text)) is None:
                raise ValueError(f"tokenizer has no {text} token (not a Qwen2.5 tokenizer?)")
            setattr(self, name, i)

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        path = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:      # the library's own error names no file
            why = (str(e).splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"{path}: not a readable tokenizer ({why})") from None

    def encode(self, text: str) -> list[int]:
        """The ids of text as text: special-token text in it is encoded as ordinary characters."""
        return self.tok.encode(without_surrogates(text), add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render(self, messages, add_generation_prompt=False) -> tuple[list[int], list[tuple]]:
        """Token ids of the ChatML chat and, per assistant message, its span [start, end)
        (METHOD.md §3): its content's first token to its closing <|im_end|> + 1."""
        if not messages or messages[0]["role"] != "system":
            messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
        ids, spans = [], []
        for m in messages:
            head = f"{m['role']}\n"
            enc = self.tok.encode(without_surrogates(head + m["content"]),
                                  add_special_tokens=False)
            ids.append(self.im_start_id)
            if m["role"] == "assistant":        # first token reaching past the head
                start = len(ids) + bisect_right([e for _, e in enc.offsets], len(head))
                spans.append((start, len(ids) + len(enc.ids) + 1))
            ids += enc.ids + [self.im_end_id] + self.encode("\n")
        if add_generation_prompt:
            ids += [self.im_start_id] + self.encode("assistant\n")
        return ids, spans


LONE_SURROGATE = re.compile("[\ud800-\udfff]")     # half a UTF-16 pair: not UTF-8, not encodable


def holds_lone_surrogate(value) -> bool:
    """Whether a JSON value holds one anywhere, in a key or a string."""
    return bool(LONE_SURROGATE.search(json.dumps(value, ensure_ascii=False)))


def without_surrogates(text: str) -> str:
    """text with every unpaired surrogate replaced by U+FFFD (same length), so it encodes."""
    return LONE_SURROGATE.sub("\ufffd", text)


# ----------------------------------------------------------------------------------------------
# LoRA (Hu et al., 2021) in PEFT's layout (q_proj gains q_proj.lora_A, q_proj.lora_B):
#     y = x W^T + b + (alpha / r) B A dropout(x),   A (r, d_in), B (d_out, r) = 0 at first;
# float32 (PEFT's default) under bfloat16 weights: the adapter's updates are tiny.

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSettings:
    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    use_rslora: bool = False    # PEFT's rank-stabilized variant: scaling alpha / sqrt(r)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, s: LoraSettings, dtype=torch.float32):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight                        # (d_out, d_in), frozen
        self.register_parameter("bias", base.bias)       # None for o/gate/up/down in Qwen2
        self.scaling = s.alpha / (math.sqrt(s.r) if s.use_rslora else s.r)
        self.dropout = s.dropout
        self.lora_dropout = nn.Dropout(s.dropout) if s.dropout > 0 else nn.Identity()
        kw = dict(bias=False, device=base.weight.device, dtype=dtype)
        self.lora_A = nn.Linear(self.in_features, s.r, **kw)     # (r, d_in)
        self.lora_B = nn.Linear(s.r, self.out_features, **kw)    # (d_out, r)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.enabled = True         # False: the base model (the GRPO reference policy)

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return y
        # functions, not module calls: per token a module call costs more than its tiny matmul
        x = x.to(self.lora_A.weight.dtype)
        if self.dropout > 0:
            x = self.lora_dropout(x)
        a = F.linear(x, self.lora_A.weight)                                    # (..., r)
        return y + (F.linear(a, self.lora_B.weight) * self.scaling).to(y.dtype)


def apply_lora(model: nn.Module, r=16, alpha=32.0, dropout=0.05, targets=LORA_TARGETS,
               use_rslora=False, dtype=torch.float32) -> nn.Module:
    """Freeze `model` and wrap every nn.Linear child named in `targets` with a LoRA adapter."""
    s = LoraSettings(r, float(alpha), float(dropout), tuple(targets), bool(use_rslora))
    sites = [(module, name, child) for module in model.modules()
             for name, child in module.named_children()
             if name in s.targets and type(child) is nn.Linear]
    if missing := sorted(set(s.targets) - {name for _, name, _ in sites}):
        raise ValueError(f"LoRA targets {missing} match no nn.Linear module of the model")
    model.requires_grad_(False)
    for module, name, child in sites:
        setattr(module, name, LoRALinear(child, s, dtype).train(child.training))
    model.lora_settings = s
    return model


def lora_parameters(model):
    """(name, Parameter) of every adapter weight, names as in model.state_dict()."""
    return ((n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n)


@contextlib.contextmanager
def lora_disabled(model):
    """`with lora_disabled(model):` runs the base model (GRPO's pi_ref) without copying weights."""
    was = {m: m.enabled for m in model.modules() if isinstance(m, LoRALinear)}
    for m in was:
        m.enabled = False
    try:
        yield model
    finally:
        for m, enabled in was.items():
            m.enabled = enabled


@torch.no_grad()
def load_lora_state(policy, state: dict[str, torch.Tensor]):
    for n, p in lora_parameters(policy):
        p.copy_(state[n])


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def save_adapter(model, path, base_model_name_or_path=None):
    """Write the model's adapter to the folder `path`: its config and its float32 weights."""
    s, folder = model.lora_settings, Path(path)             # (write_atomic creates it)
    tensors = {PEFT_PREFIX + n: p.detach().to("cpu").contiguous()
               for n, p in lora_parameters(model)}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path":
              base_model_name_or_path or getattr(model, "name_or_path", None),
              "revision": None, "inference_mode": True, "r": s.r,
              "lora_alpha": int(s.alpha) if s.alpha.is_integer() else s.alpha,
              "lora_dropout": s.dropout, "target_modules": sorted(s.targets),
              "use_rslora": s.use_rslora, "bias": "none", "fan_in_fan_out": False,
              "init_lora_weights": True, "use_dora": False, "lora_bias": False,
              "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
              "rank_pattern": {}, "alpha_pattern": {}}
    write_atomic(folder / ADAPTER_WEIGHTS, safetensors_bytes(tensors, {"format": "pt"}))
    write_atomic(folder / ADAPTER_CONFIG, (json.dumps(config, indent=2) + "\n").encode())


def load_adapter_weights(policy, directory):
    """policy's LoRA weights from save_adapter's `directory` (lab/adapters.py: any PEFT adapter)."""
    config, file, s = (Path(directory) / ADAPTER_CONFIG, Path(directory) / ADAPTER_WEIGHTS,
                       policy.lora_settings)
    c = json.loads(config.read_text())
    if not isinstance(c, dict) or (s.r, s.alpha, s.use_rslora, set(s.targets)) != (
            c.get("r"), c.get("lora_alpha"), c.get("use_rslora"), set(c.get("target_modules", ()))):
        raise ValueError(f"{config}: not an adapter with the settings of the model's ({s})")
    with safe_open(str(file), framework="pt") as f:
        tensors = {key[len(PEFT_PREFIX):]: f.get_tensor(key) for key in f.keys()}
    for name, p in lora_parameters(policy):
        if name not in tensors or tensors[name].shape != p.shape \
                or not torch.isfinite(tensors[name]).all():
            raise ValueError(f"{file}: {name} is missing, not of shape {list(p.shape)}, or holds "
                             "NaN or infinite values")
    load_lora_state(policy, tensors)
    return policy


# ----------------------------------------------------------------------------------------------
# Files (where fetched and fitted ones live, atomic writes) and --devices

def cache_root() -> Path:
    """Where everything fetched or fitted once is kept: $PAIR_CACHE, else ~/.cache/pair."""
    return Path(os.environ.get("PAIR_CACHE") or Path.home() / ".cache" / "pair").expanduser()


def write_atomic(path: Path, data: bytes | str) -> None:
    """Every file written here: a temporary file, then os.replace (the old file or the new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def parse_devices(text: str) -> list[torch.device]:
    """A --devices value ("cuda:0,cuda:1", "cpu") -> the devices, or a one-line ValueError."""
    try:
        devices = [torch.device(d.strip()) for d in text.split(",")]
    except RuntimeError:                                # "", "foo", "cuda:x"
        devices = []
    if not devices or any(d.type not in ("cpu", "cuda") for d in devices):
        raise ValueError(f"--devices {text!r}: not a list of devices like cuda:0,cuda:1 or cpu")
    n_gpus = torch.cuda.device_count()
    if any(d.type == "cuda" and (d.index or 0) >= n_gpus for d in devices):
        raise ValueError(f"--devices {text}: this PyTorch sees {n_gpus or 'no'} CUDA device(s)")
    return devices
