"""A hand-written Qwen2-family decoder that reports its own hidden states and attention statistics.

PAIR reads its reward from the policy's internals (METHOD.md §4); this model returns them natively:
  * `hidden_states`: L+1 tensors in the Hugging Face convention (embedding output, the output of
    blocks 1..L-1, then the final-normed output of block L);
  * `attn_stats`: for every layer l and query head h, six statistics of the softmax row p_i of
    every query row i of the evaluation-turn span [span_start, span_end), averaged over those
    rows (keys j <= i are the causal keys; a sliding window's masked keys count as zeros):
        max      = max_j p_ij
        std      = population std of p_i0..p_ii
        prefix   = sum_{j < span_start} p_ij
        self     = sum_{span_start <= j <= i} p_ij
        entropy  = -log sum_j p_ij^2                     (Renyi-2, the Head Entropy baseline)
        lookback = m_ctx / (m_ctx + m_new), m_ctx = mean_{j<span_start} p_ij,
                   m_new = mean_{span_start<=j<=i} p_ij  (Lookback Lens; 0 when span_start = 0)
    All six follow from three numbers per row: max_j p_ij, sum_j p_ij^2 and the prefix mass
    (sum_j p_ij = 1, so self = 1 - prefix, and std^2 = sum_j p_ij^2 / (i+1) - 1/(i+1)^2);
    the code carries self as a fourth (`stats_from`). They are computed only for the
    span rows (a block of span rows x keys per head, in float32), never as a T x T matrix, in a
    teacher-forced forward and while generating with the KV cache. Without a span the forward is
    a plain forward.

Architectures: Qwen2ForCausalLM (QKV bias, GQA, tied or untied embeddings), LlamaForCausalLM and
MistralForCausalLM (no bias; Mistral's sliding window). Modules carry the Hugging Face weight
names, so loading a checkpoint is a strict `load_state_dict`; weights.py reads and checks the
directory it comes from (config.json, the safetensors tensors, a Hub download).

Positions are explicit and every attention mask is built from them: key slot j is visible to the
query at position p iff j <= p (and p - j < window). The KV cache is indexed by absolute position,
so several rows can append ragged blocks of tokens, each at its own offset (multi-turn rollouts
append observations mid-conversation). Pad queries of a ragged append get positions past the row's
real tokens; their cache slots hold garbage that no real query can see (slot <= position) until the
row's next real token overwrites it.

Generation follows gpt-fast's small functions (`prefill`, `decode_one_token`, `sample`). Every
generated token, the final <|im_end|> included, is fed through the model once: the cache holds it,
and `accumulate` adds its statistics and hidden states to its turn's running sums (`TurnStats`),
so no second forward pass is run. As in gpt-fast, the decoding step runs compiled
(`torch.compile`) where that pays: a small model on the CPU, and any model on one GPU, where it
is also captured as a CUDA graph (compiled_step). The GRPO update's log-probabilities
(`token_logprobs`) recompute each block and the head in chunks, so that a long rollout's update
holds little more than one (T, d) tensor per block.
Departure from the authors' release (METHOD.md §4): std is over the i+1 causal keys, not the whole
padded row, and the statistics come from the generation pass instead of a second eager forward.

Top to bottom: RoPE, the KV cache, the span statistics, the transformer, its compiled decoding
step, `load_model`, the tokenizer and the chat format, generation and teacher-forced traces, LoRA
(its files, in PEFT's layout, are adapters.py's), the layer split across devices, and the
`generate` command line.
"""
import argparse
import contextlib
import inspect
import math
import os
import sys
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

import common
import weights
from weights import CheckpointError, Config

STATS = ("max", "std", "prefix", "self", "entropy", "lookback")
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Span rows are scored in chunks of at most this many float32 scores (8 MB): the few temporaries
# of a chunk stay below what the MLP of the same block holds anyway, so peak memory is unchanged.
STATS_CHUNK = 1 << 21
# On a GPU the chunk's launches cost more than its memory: 256 MB of scores, a 256-row span over
# 8,192 keys of the 7B's 28 heads in one product per layer.
STATS_CHUNK_GPU = 1 << 26
# --dtype of every script takes these names, torch's, and only these
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------
# RoPE, written as Hugging Face writes it for Qwen (rotate_half), so no weight permutation


def rope_inv_freq(config: Config) -> Tensor:
    d = config.head_size
    # Explicit CPU device: the model may be built under torch.device("meta") for loading.
    return 1.0 / config.rope_base ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d)


def rope_tables(inv_freq: Tensor, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
    freqs = positions[..., None].float() * inv_freq.to(positions.device)   # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                 # (B, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    cos, sin = cos[:, None], sin[:, None]                                   # (B, 1, T, D)
    return x * cos + rotate_half(x) * sin


def attention_mask(positions: Tensor, key_positions: Tensor, window: int | None) -> Tensor:
    """(B, 1, T, S) bool: key j is visible to query t iff kpos_j <= pos_t (and within window)."""
    q, k = positions[:, :, None], key_positions[:, None, :]
    mask = k <= q
    if window is not None:
        mask &= q - k < window
    return mask[:, None]


# ----------------------------------------------------------------------------------------------
# KV cache: one per layer, on that layer's device, slot index = absolute position


def static_address(t: Tensor) -> Tensor:
    """t, marked as a tensor a CUDA graph may write into in place: the compiled decoding step is
    replayed with the addresses it was captured with, and torch.compile captures no graph that
    mutates an input unless that input keeps its address."""
    if t.is_cuda:
        torch._dynamo.mark_static_address(t, guard=False)
    return t


class KVCache:
    def __init__(self, batch_size, n_kv_heads, head_dim, capacity, dtype, device):
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        self.k = static_address(torch.zeros(shape, dtype=dtype, device=device))
        self.v = static_address(torch.zeros(shape, dtype=dtype, device=device))
        # Number of real tokens per row, kept on the CPU: where each row's next token goes (the
        # trunk's default positions, the decoding step's positions and the key slots it reads).
        self.lengths = torch.zeros(batch_size, dtype=torch.long)

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def grow(self, size: int):
        if size <= self.capacity:
            return
        # Double (rounded to 256) so that decoding one token at a time reallocates rarely.
        new = max(size, 2 * self.capacity)
        new = (new + 255) // 256 * 256
        for name in ("k", "v"):
            old = getattr(self, name)
            t = old.new_zeros(old.shape[0], old.shape[1], new, old.shape[3])
            t[:, :, :old.shape[2]] = old
            setattr(self, name, static_address(t))

    def write(self, k: Tensor, v: Tensor, positions: Tensor, size: int) -> tuple[Tensor, Tensor]:
        """Store k, v (B, KV, T, D) at slots `positions` (B, T); return slots [0, size)."""
        self.grow(size)
        positions = positions.to(self.k.device)
        rows = torch.arange(k.shape[0], device=self.k.device)[:, None]
        self.k[rows, :, positions] = k.transpose(1, 2).to(self.k.dtype)   # (B, T, KV, D)
        self.v[rows, :, positions] = v.transpose(1, 2).to(self.v.dtype)
        return self.k[:, :, :size], self.v[:, :, :size]


def set_lengths(cache: list[KVCache], lengths: Tensor):
    """Declare how many real tokens each row holds (slots past them are free to overwrite)."""
    for layer_cache in cache:
        layer_cache.lengths = lengths.detach().to("cpu", torch.long).clone()


def copy_rows(src: list[KVCache], src_row: int, dst: list[KVCache], dst_row: int, n: int):
    """Row dst_row of dst holds the first n slots of row src_row of src, and n tokens.

    A branch of a rollout tree continues from its parent's prefix this way instead of
    prefilling it again: slot = position, so the copied keys are exactly what a fresh prefill of
    those n tokens would write (RoPE already applied at the same positions)."""
    for s, d in zip(src, dst):
        d.grow(n)
        d.k[dst_row, :, :n] = s.k[src_row, :, :n].to(d.k.device)
        d.v[dst_row, :, :n] = s.v[src_row, :, :n].to(d.v.device)
        d.lengths[dst_row] = n


# ----------------------------------------------------------------------------------------------
# Attention statistics of the span rows (METHOD.md §4)


@dataclass
class SpanRows:
    """Which query rows of one forward call lie in the span, and where each row's span starts."""
    lo: int                 # query indices [lo, hi) cover every span row of the batch
    hi: int
    is_row: Tensor          # (B, hi - lo) bool
    start: Tensor           # (B,) span_start per row (absolute position)
    count: Tensor           # (B,) number of span rows per row

    def to(self, device) -> "SpanRows":
        return SpanRows(self.lo, self.hi, self.is_row.to(device), self.start.to(device),
                        self.count.to(device))


def span_rows(span, positions: Tensor) -> SpanRows:
    """span: (start, end) for every row, or one (start, end) per row; positions: (B, T)."""
    B = positions.shape[0]
    bounds = torch.as_tensor(span, dtype=torch.long, device=positions.device)
    bounds = bounds.expand(B, 2) if bounds.dim() == 1 else bounds
    start, end = bounds[:, 0], bounds[:, 1]
    is_row = (positions >= start[:, None]) & (positions < end[:, None])    # (B, T)
    hit = is_row.any(0).nonzero()
    lo, hi = (int(hit[0]), int(hit[-1]) + 1) if len(hit) else (0, 0)
    return SpanRows(lo, hi, is_row[:, lo:hi], start, is_row.sum(1))


def attention_probs(q: Tensor, k: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale) in float32 for a few query rows: (B,H,c,D), (B,KV,S,D) -> (B,H,c,S)"""
    B, H, c, D = q.shape
    kv = k.shape[1]
    # Query head h uses key head h // (H/KV): group the query heads instead of repeating keys.
    # Scale the few queries rather than the many scores; mask in place: one (B,H,c,S) temporary.
    q = (q.float() * scale).reshape(B, kv, (H // kv) * c, D)
    scores = (q @ k.float().transpose(-1, -2)).view(B, H, c, -1)
    return torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1)


def masses_matrix(key_pos: Tensor, start: Tensor) -> Tensor:
    """(B, 1, S, 2): for each key slot, [j < span_start, j >= span_start]; key_pos (B, S) or
    (S,), start (B,). A row of probabilities times it gives the prefix and the self mass at once:
    masked keys j > i hold p = 0, so "not before" is exactly span_start <= j <= i."""
    before = (key_pos < start[:, None]).float()                 # (B, S) keys j < span_start
    return torch.stack((before, 1 - before), -1)[:, None]


def row_stats(p: Tensor, pos: Tensor, key_pos: Tensor, start: Tensor) -> dict[str, Tensor]:
    """The six statistics of each row of p (B,H,c,S); pos (B,c), key_pos (B,S), start (B,)."""
    masses = p @ masses_matrix(key_pos, start)                  # (B, H, c, 2)
    return stats_from(p.amax(-1), torch.linalg.vecdot(p, p), *masses.unbind(-1),
                      pos[:, None], start[:, None, None])


def stats_from(mx, sum_sq, prefix, self_, pos, start) -> dict[str, Tensor]:
    """The six statistics from the four numbers of each softmax row (its max, its sum of squares,
    its prefix and self masses); pos (the row's position) and start broadcast against them."""
    n = (pos + 1).float()                                       # causal keys j <= i
    s0 = start.float()
    m_ctx = prefix / s0.clamp(min=1)
    m_new = self_ / (pos - start + 1).float()
    return {
        "max": mx,
        "std": (sum_sq / n - 1 / n.square()).clamp(min=0).sqrt(),
        "prefix": prefix,
        "self": self_,
        "entropy": -sum_sq.log(),
        "lookback": torch.where(s0 > 0, m_ctx / (m_ctx + m_new), torch.zeros_like(m_ctx)),
    }


def add_row_stats(sums: Tensor, p, pos, key_pos, rows: SpanRows, a: int, b: int):
    """Add the statistics of query rows [a, b) that lie in the span to sums (B, H, len(STATS))."""
    stats = row_stats(p, pos, key_pos, rows.start)
    values = torch.stack([stats[name] for name in STATS], -1)   # (B, H, c, 6)
    keep = rows.is_row[:, None, a - rows.lo:b - rows.lo, None]  # (B, 1, c, 1)
    # where, not multiply: rows outside the span may hold inf/nan (e.g. m_new of i < start).
    sums += torch.where(keep, values, 0.0).sum(2)


# ----------------------------------------------------------------------------------------------
# The transformer; module names are the Hugging Face weight keys


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        # Normalise in float32 and cast back before the weight, in Hugging Face's order.
        xf = x.float()
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
        self.n_heads, self.n_kv_heads, self.head_dim = H, KV, D
        self.scale = D ** -0.5
        self.q_proj = nn.Linear(d, H * D, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, KV * D, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, KV * D, bias=config.qkv_bias)
        # Llama's attention_bias also puts a bias on o_proj; Qwen2's QKV bias does not.
        self.o_proj = nn.Linear(H * D, d, bias=config.attention_bias)

    def forward(self, x, cos, sin, mask, positions, key_pos, cache=None, rows=None):
        """x (B,T,d) -> (B,T,d) and, when rows is given, the per-head sums of the span-row
        statistics (B, H, len(STATS)) in STATS order."""
        B, T, _ = x.shape
        dev = x.device                              # the block may live on any device
        cos, sin = cos.to(dev), sin.to(dev)
        mask = mask.to(dev) if mask is not None else None     # None: plain causal (see trunk)
        positions, key_pos = positions.to(dev), key_pos.to(dev)
        rows = rows.to(dev) if rows is not None else None
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B,H,T,D)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(k, v, positions, mask.shape[-1])   # (B, KV, S, D)

        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=True)
        sums = None
        if rows is not None and rows.hi > rows.lo:
            sums = x.new_zeros(B, self.n_heads, len(STATS), dtype=torch.float32)
            self.span_stats(sums, q, k, mask, positions, key_pos, rows)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(out), sums

    def decode(self, x, cos, sin, bias, pos, kv, before=None, w=None):
        """One new token per row, x (B, 1, d) at positions pos (B,), its k and v written into
        this layer's cache tensors kv = (k, v) (B, KV, capacity, D) at slots pos: the attention
        output and, given before (B, 1, 1, S), 1 on the key slots before each row's span, the
        four numbers of each head's softmax row (stats_from): its max, sum of squares, prefix
        and self masses, each (B, H, 1). A softmax row sums to 1 over the visible keys, so
        self = 1 - prefix.

        The attention is computed by hand, in float32 (its probabilities are the statistics),
        over key slots [0, S): query head h uses key head h // (H/KV), so the query heads are
        grouped, not the keys repeated; `bias` (B, 1, 1, S) is 0 on visible key slots and -inf
        elsewhere. w: the fused projections (Block.decode_weights), or None for the modules."""
        B, H, KV, D = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        if w is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = apply_rope(q.view(B, 1, H, D).transpose(1, 2), cos, sin)   # (B, H, 1, D)
            k = apply_rope(k.view(B, 1, KV, D).transpose(1, 2), cos, sin)
        else:       # q and k side by side from one matmul: rotated together, in one pass
            qk, v = F.linear(x, *w[0]).split(((H + KV) * D, KV * D), -1)
            q, k = apply_rope(qk.view(B, 1, H + KV, D).transpose(1, 2), cos, sin).split((H, KV), 1)
        k_cache, v_cache = kv
        rows = torch.arange(B, device=pos.device)
        k_cache[rows, :, pos] = k[:, :, 0].to(k_cache.dtype)                 # (B, KV, D)
        v_cache[rows, :, pos] = v.view(B, KV, D).to(v_cache.dtype)
        S = bias.shape[-1]
        k, v = k_cache[:, :, :S], v_cache[:, :, :S]                         # (B, KV, S, D)
        q = (q.float() * self.scale).reshape(B, KV, H // KV, D)             # (B, KV, G, D)
        p = torch.softmax(q @ k.float().transpose(-1, -2) + bias, dim=-1)  # (B, KV, G, S)
        out = (p @ v.float()).view(B, 1, H * D).to(x.dtype)
        numbers = None
        if before is not None:
            p = p.view(B, H, 1, -1)                                         # (B, H, 1, S)
            prefix = torch.linalg.vecdot(p, before)
            numbers = (p.amax(-1), torch.linalg.vecdot(p, p), prefix, 1 - prefix)
        return (self.o_proj(out) if w is None else F.linear(out, *w[1])), numbers

    def span_stats(self, sums, q, k, mask, positions, key_pos, rows: SpanRows):
        """Recompute q k^T for the span rows only, a chunk of rows at a time: (B, H, c, S).
        mask None: the plain causal forward, whose span rows' masks are built here."""
        B, H, _, _ = q.shape
        k = k.float()
        budget = STATS_CHUNK if q.device.type == "cpu" else STATS_CHUNK_GPU
        step = max(1, budget // (B * H * k.shape[2]))
        for a in range(rows.lo, rows.hi, step):
            b = min(a + step, rows.hi)
            m = attention_mask(positions[:, a:b], key_pos, None) if mask is None \
                else mask[:, :, a:b]
            p = attention_probs(q[:, :, a:b], k, m, self.scale)
            add_row_stats(sums, p, positions[:, a:b], key_pos, rows, a, b)


class Block(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, positions, key_pos, cache=None, rows=None,
                mlp_chunk=None):
        """mlp_chunk: the MLP over at most this many tokens at a time, each chunk recomputed in
        the backward pass (the update of a long rollout: its (T, intermediate) activations,
        most of what a recomputed block holds, then never exist for the whole sequence)."""
        a, sums = self.self_attn(self.input_layernorm(x), cos, sin, mask, positions, key_pos,
                                 cache, rows)
        x = x + a
        h = self.post_attention_layernorm(x)
        if mlp_chunk is None or x.shape[1] <= mlp_chunk:
            return x + self.mlp(h), sums
        return x + torch.cat([torch.utils.checkpoint.checkpoint(
            self.mlp, h[:, i:i + mlp_chunk], use_reentrant=False)
            for i in range(0, x.shape[1], mlp_chunk)], 1), sums

    def decode(self, x, cos, sin, bias, pos, kv, before=None, w=None):
        """forward for one new token per row (Attention.decode): (B, 1, d) -> (B, 1, d).
        w: decode_weights(), or None for the modules."""
        a, numbers = self.self_attn.decode(self.input_layernorm(x), cos, sin, bias, pos, kv,
                                           before, w)
        x = x + a
        h = self.post_attention_layernorm(x)
        if w is None:
            return x + self.mlp(h), numbers
        gate, up = F.linear(h, *w[2]).chunk(2, -1)
        return x + F.linear(F.silu(gate) * up, *w[3]), numbers

    def decode_weights(self) -> list[tuple] | None:
        """(weight, bias) of q/k/v, o, gate/up and down as decoding applies them: an enabled
        adapter merged in, q/k/v and gate/up concatenated - four matmuls a token instead of seven
        (21 with adapters), each of which costs its call, not its arithmetic, at a small model's
        size. Rebuilt when a tensor's version changes (optimizer steps, copy_) or an adapter is
        switched. None, for the modules themselves, where merging would change the numbers (not
        float32: an adapter merged into bfloat16 is rounded away; adapter dropout on), where a
        gradient is wanted (the fused weights are detached), or where a second copy of the
        weights buys nothing (a block over FUSE_MAX_ELEMENTS)."""
        a, m = self.self_attn, self.mlp
        groups = ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate_proj, m.up_proj),
                  (m.down_proj,))
        linears = [lin for group in groups for lin in group]
        if torch.is_grad_enabled() or sum(lin.weight.numel() for lin in linears) > \
                FUSE_MAX_ELEMENTS or any(
                lin.weight.dtype != torch.float32 or getattr(lin, "dropout", 0) and lin.training
                for lin in linears):
            return None
        key = [(id(t), t.data_ptr(), t._version) for lin in linears for t in _lora_reads(lin)]
        if getattr(self, "_fused", (None,))[0] != key:
            with torch.no_grad():
                self._fused = key, [_fuse(group) for group in groups]
        return self._fused[1]


def _fuse(linears) -> tuple[Tensor, Tensor | None]:
    """One (weight, bias) applying the given projections side by side (a missing bias is 0)."""
    weight = torch.cat([merged_weight(lin) for lin in linears])
    if all(lin.bias is None for lin in linears):
        return weight, None
    return weight, torch.cat([lin.bias if lin.bias is not None else
                              lin.weight.new_zeros(lin.out_features) for lin in linears])


FUSE_MAX_ELEMENTS = 1 << 22       # 16 MB of float32 per block: the built-in policy, not 0.5B


class Decoder(nn.Module):
    """The `model.` prefix of the checkpoint keys."""
    def __init__(self, config: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class Output:
    logits: Tensor | None                       # (B, T, V) float32; None when logits=False
    hidden_states: tuple[Tensor, ...] | None    # L+1 x (B, T, d), Hugging Face convention
    attn_stats: dict[str, Tensor] | None        # STATS -> (B, L, H), span rows averaged


class Transformer(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.inv_freq = rope_inv_freq(config)   # a plain tensor: not a weight of the checkpoint
        self.windows = [config.window(i) for i in range(config.num_hidden_layers)]

    def new_cache(self, batch_size: int, capacity: int = 256) -> list[KVCache]:
        """One empty KV cache per layer, on that layer's device and in its dtype."""
        c = self.config
        return [KVCache(batch_size, c.n_kv_heads, c.head_size, capacity,
                        layer.input_layernorm.weight.dtype, layer.input_layernorm.weight.device)
                for layer in self.model.layers]

    def forward(self, input_ids, positions=None, cache=None, span=None,
                output_hidden_states=False, logits=True) -> Output:
        h, hidden_states, attn_stats = self.trunk(input_ids, positions, cache, span,
                                                  output_hidden_states)
        return Output(self.lm_head(h).float() if logits else None, hidden_states, attn_stats)

    def trunk(self, input_ids, positions=None, cache=None, span=None, output_hidden_states=False,
              recompute=False):
        """Everything up to the final norm: (B,T,d) normed output, hidden states, span stats.

        input_ids (B, T); positions (B, T) absolute positions (default: right after the cache's
        tokens, else 0..T-1); span (start, end) or one per row, in absolute positions.
        With a cache, K/V are written at `positions` and each row's length grows to cover them.
        recompute: activation checkpointing where a gradient is wanted: each block keeps only its
        input and runs again in the backward pass, its MLP in chunks of MLP_CHUNK tokens (the
        update of a long rollout).
        """
        B, T = input_ids.shape
        dev = self.model.embed_tokens.weight.device
        # A causal forward from position 0 (the GRPO update, teacher-forced traces) lets
        # PyTorch's fused causal kernel skip the mask: upper-left causal is right there, and in a
        # right-padded batch no real token sees a pad. The span rows' statistics build their own.
        fused_causal = (positions is None and cache is None and T > 1
                        and all(w is None for w in self.windows))
        if positions is None:
            start = cache[0].lengths if cache is not None else torch.zeros(B, dtype=torch.long)
            positions = start[:, None] + torch.arange(T)
        positions = positions.to(dev)
        if cache is not None:
            size = int(positions.max()) + 1             # keys are slots [0, size) of the cache
            key_pos = torch.arange(size, device=dev).expand(B, size)
        else:
            key_pos = positions
        masks = {w: None if fused_causal else attention_mask(positions, key_pos, w)
                 for w in set(self.windows)}
        cos, sin = rope_tables(self.inv_freq, positions, self.model.embed_tokens.weight.dtype)
        rows = span_rows(span, positions) if span is not None else None

        x = self.model.embed_tokens(input_ids.to(dev))                          # (B, T, d)
        hidden_states = [x] if output_hidden_states else None
        layer_sums = []
        for i, layer in enumerate(self.model.layers):
            inputs = (x, cos, sin, masks[self.windows[i]], positions, key_pos,
                      cache[i] if cache is not None else None, rows)
            if recompute and torch.is_grad_enabled():
                x, sums = torch.utils.checkpoint.checkpoint(
                    layer, *inputs, mlp_chunk=max(1, MLP_CHUNK // B), use_reentrant=False)
            else:
                x, sums = layer(*inputs)
            layer_sums.append(sums)
            if output_hidden_states and i < len(self.model.layers) - 1:
                hidden_states.append(x)
        x = self.model.norm(x)
        if output_hidden_states:
            hidden_states.append(x)        # Hugging Face: the last hidden state is after the norm
        if cache is not None:
            set_lengths(cache, torch.maximum(cache[0].lengths, positions.max(1).values.cpu() + 1))

        attn_stats = None
        if rows is not None:
            H = self.config.num_attention_heads
            per_layer = [s.to(dev) if s is not None else torch.zeros(B, H, len(STATS), device=dev)
                         for s in layer_sums]
            count = rows.count.to(dev).float()[:, None, None, None]      # 0 span rows -> nan
            means = torch.stack(per_layer, 1) / count                     # (B, L, H, 6)
            attn_stats = dict(zip(STATS, means.unbind(-1)))
        return x, tuple(hidden_states) if output_hidden_states else None, attn_stats

    def decode(self, tokens, cache, span_start=None, w=None):
        """One token per row, tokens (B,), appended at each row's cache length (its position;
        the caller advances the lengths). Returns the logits (B, V) in float32 and, given
        span_start (B,), where each row's turn began: the hidden states of the new token
        (L+1, B, d), Hugging Face's convention, and its six statistics (B, L, H, 6), STATS
        order, all three on the head's device (a split model's last). w: self.decode_weights(),
        read once by a caller that decodes many tokens with the same weights (checking that they
        are current costs a fair part of a small model's step).

        A small model's decoding step on the CPU costs its number of operations, not their
        arithmetic, and a GPU's step waits on the CPU to launch its kernels one by one, so the
        step runs compiled where it can: one graph, and on a GPU one captured CUDA graph
        (compiled_step). That graph attends over the slots in use rounded up to a whole
        number of KEY_BLOCKs (at most the capacity), the slots past each row's position masked
        out, so that its shapes change once every KEY_BLOCK tokens, not at each; the eager step
        attends over the slots in use."""
        lengths = cache[0].lengths                          # (B,) on the CPU: no device sync
        size = int(lengths.max()) + 1                       # key slots [0, size) are in use
        for layer_cache in cache:
            layer_cache.grow(size)
        w = self.decode_weights() if w is None else w
        args = (tokens, lengths, span_start, [c.k for c in cache], [c.v for c in cache], w)
        step = compiled_step(w, cache)
        if step is not None:
            try:
                blocks = min(cache[0].capacity, -(-size // KEY_BLOCK) * KEY_BLOCK)
                if not cache[0].k.is_cuda:
                    return step(self, *args, blocks)
                # A CUDA graph reads device tensors only, and its outputs live in memory that its
                # next replay overwrites: the caller gets copies.
                dev = cache[0].k.device
                self.inv_freq = self.inv_freq.to(dev)
                on_dev = [None if t is None else t.to(dev) for t in args[:3]]
                torch.compiler.cudagraph_mark_step_begin()
                out = step(self, *on_dev, *args[3:], blocks)
                return tuple(None if t is None else t.clone() for t in out)
            except compile_errors() as e:
                compile_failed(e)
        return self.decode_step(*args, size)

    def decode_weights(self) -> list:
        """Each block's decode_weights(), current for the weights as they are now."""
        return [layer.decode_weights() for layer in self.model.layers]

    def decode_step(self, tokens, lengths, span_start, ks, vs, w, size):
        """decode on the cache tensors ks, vs (one (B, KV, capacity, D) each per layer),
        attending over key slots [0, size); w: each block's decode_weights().

        The decoding counterpart of trunk, with nothing that depends on a row's length done
        per layer: the masks, RoPE tables and the before-span vector are built once per step,
        and the statistics of every layer are derived from their four numbers in one pass at
        the end."""
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
        hidden, numbers, moved = [x], [], {}
        for i, layer in enumerate(self.model.layers):
            # a split model: each device gets the step's tables once
            key = (ks[i].device, self.windows[i])
            if key not in moved:
                moved[key] = [t.to(key[0]) if t is not None else None
                              for t in (cos, sin, bias[key[1]], pos, before)]
            cos_i, sin_i, bias_i, pos_i, before_i = moved[key]
            x, n = layer.decode(x.to(key[0]), cos_i, sin_i, bias_i, pos_i, (ks[i], vs[i]),
                                before_i, w[i])
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


# ----------------------------------------------------------------------------------------------
# The compiled decoding step

# PAIR_COMPILE=0 decodes eagerly everywhere (the test suite does, but where it compares the two).
COMPILE = os.environ.get("PAIR_COMPILE", "1") != "0"
# The compiled step attends over key slots in blocks of this many. Over the whole capacity instead
# (a cache is made for several turns, and doubles as it grows) the attention's products, most of
# a long episode's step, did up to twice the work: shop-long's greedy episodes took 1.5x longer.
KEY_BLOCK = 128
# torch specializes a graph on the relations it meets among its sizes: whether span_start is
# given, whether the batch is one row, whether the slots attended fill the cache (then its keys
# are contiguous). That makes 8 graphs once every size is symbolic, after the first call's static
# graph and one more at the first change of each size (key slots, batch, capacity): up to 11, 9
# in a shop-long `pair` run, over torch's default limit of 8, past which the step decoded
# eagerly for the rest of the process.
RECOMPILE_LIMIT = 32
# a CUDA graph per step, every size symbolic from the first compile (compiled_step)
COMPILE_OPTIONS = {"cpu": {}, "cuda": {"mode": "reduce-overhead", "dynamic": True}}
_compiled = {}          # device kind: Transformer.decode_step compiled; "failed": why given up


def compile_errors() -> tuple:
    """Compiling failed: no working C++ compiler, or past the limit (named FailOnCacheLimitHit
    before torch 2.7), which fullgraph=True raises instead of running the step eagerly. torch's
    compiler is imported here, when a step was compiled, not with this module: it is seconds of
    every command's start, `--help` included."""
    exc = torch._dynamo.exc
    return (exc.TorchDynamoException, *(getattr(exc, name) for name in (
        "FailOnRecompileLimitHit", "FailOnCacheLimitHit") if hasattr(exc, name)))


def compiled_step(w: list, cache: list[KVCache]):
    """Transformer.decode_step compiled (called with the model first), or None where compiling
    does not pay or is not wanted: PAIR_COMPILE=0, an earlier failure, a model split over several
    devices, or on the CPU a block decoding with its modules (bfloat16, a gradient, a model bound
    by reading its weights rather than by its operations: Block.decode_weights).

    On the CPU (a small model: its step costs its number of operations) inductor compiles it for
    the shapes of its first call and, at the first change, once more with the sizes that changed
    left symbolic (the batch, the key slots, the capacity), and once per relation among them
    (RECOMPILE_LIMIT): a third size reuses a graph. Everything else (the weights' shapes, the
    norms' epsilon) stays a constant of the graph.

    On a GPU it is also captured as a CUDA graph (mode="reduce-overhead", gpt-fast's recipe): a
    step is one launch instead of a few thousand kernels, each waiting on the CPU. The graph
    writes the cache in place at the addresses it was captured with (static_address, and
    generate reserves a whole generation's slots first); every size is symbolic from the first
    call, so one compile serves each batch and key-slot count, a graph recorded for each."""
    if not COMPILE or "failed" in _compiled or len({c.k.device for c in cache}) > 1:
        return None
    kind = cache[0].k.device.type
    if kind == "cpu" and any(x is None for x in w) or kind not in ("cpu", "cuda"):
        return None
    if kind not in _compiled:
        print("model.py: compiling the decoding step (under a minute the first time on a machine, "
              "seconds later; PAIR_COMPILE=0 decodes eagerly)", file=sys.stderr, flush=True)
        limit = {}
        if "recompile_limit" in inspect.signature(torch.compile).parameters:
            limit["recompile_limit"] = RECOMPILE_LIMIT          # this function's own
        else:               # older torch: the process's, named cache_size_limit before 2.7
            config = torch._dynamo.config
            name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        if COMPILE_OPTIONS[kind].get("dynamic"):
            # Every size symbolic, each its own symbol: "duck" sizing would take two sizes equal
            # at the first call (4 rows, 4 key heads) for one, and compile again when they part.
            torch.fx.experimental._config.use_duck_shape = False
        _compiled[kind] = torch.compile(Transformer.decode_step, fullgraph=True, **limit,
                                        **COMPILE_OPTIONS[kind])
    return _compiled[kind]


def compile_failed(error: Exception):
    """Decode eagerly from now on, and say so once."""
    _compiled["failed"] = error
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    print(f"model.py: decoding eagerly, torch.compile failed: {type(error).__name__}: {first}",
          file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Loading a Hugging Face checkpoint directory (read and checked by weights.py)


def load_model(path_or_repo, dtype=torch.float32, devices=None) -> tuple["Transformer",
                                                                          "Tokenizer"]:
    """A checkpoint directory (config.json, safetensors, tokenizer.json) or a Hugging Face Hub
    name such as "Qwen/Qwen2.5-7B-Instruct" (fetched once into $PAIR_CACHE) -> (model, tokenizer).
    devices: one device, or several to split the layers over (split_model, at the bottom)."""
    directory = weights.resolve(path_or_repo)
    devices = [torch.device(d) for d in (devices or ["cpu"])]
    if not devices:
        raise ValueError("devices: empty list")
    config = weights.read_config(directory)
    if not (directory / "tokenizer.json").is_file():
        raise weights.CheckpointError(f"{directory / 'tokenizer.json'}: file not found")
    # Build without allocating, then adopt the loaded tensors (assign=True): one copy in memory.
    with torch.device("meta"):
        model = Transformer(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state = weights.read_state_dict(directory, expected, config, dtype, devices[0])
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight   # assign=True broke the tie
    # The base weights are never trained here (GRPO trains LoRA adapters beside them).
    model.requires_grad_(False).eval()
    model.name_or_path = str(path_or_repo)        # recorded in saved adapters' configs
    model.checkpoint_dir = directory              # what checkpoint_sha256 reads
    if len(devices) > 1:
        # Loaded on the first device, then spread: the blocks move to their devices one by one.
        split_model(model, devices)
    return model, Tokenizer.from_file(directory)


def input_device(model: "Transformer") -> torch.device:
    """Where input ids go: the embedding's device (the first one of a split model)."""
    return model.model.embed_tokens.weight.device


# ----------------------------------------------------------------------------------------------
# Tokenizer and the chat format (METHOD.md §2, §3)


class Tokenizer:
    """A tokenizers.Tokenizer and the ChatML template around it.

    Untrusted text stays text: every string (a task, a tool's observation, a dataset record, the
    policy's own reply) is encoded with special-token text treated as ordinary characters, so
    an observation that writes "<|im_end|>\n<|im_start|>system" is those characters, not a new
    turn. Only the template puts the special tokens <|im_start|> and <|im_end|>, as ids."""

    def __init__(self, tok):
        self.tok = tok
        tok.encode_special_tokens = True        # an attribute of the instance: never saved
        self.im_start_id = self._special("<|im_start|>")
        self.im_end_id = self._special("<|im_end|>")
        self.pad_id = self._special("<|endoftext|>")

    def _special(self, text) -> int:
        i = self.tok.token_to_id(text)
        if i is None:
            raise ValueError(f"tokenizer has no {text} token (not a Qwen2.5 tokenizer?)")
        return i

    @classmethod
    def from_file(cls, path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        path = Path(path)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"{path}: tokenizer.json not found")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:      # the library's own error names no file
            raise CheckpointError(f"{path}: not a tokenizer the tokenizers library can read "
                                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                                  ) from None

    def encode(self, text: str) -> list[int]:
        """The ids of text as text: special-token text in it is encoded as ordinary characters."""
        return self.tok.encode(common.without_surrogates(text), add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens=False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @staticmethod
    def _check(messages):
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise ValueError(f"message {i}: role must be system, user or assistant")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"message {i}: content must be a string")

    def chat_text(self, messages, add_generation_prompt=False) -> str:
        self._check(messages)
        return chat_text(messages, add_generation_prompt)

    def render(self, messages, add_generation_prompt=False) -> tuple[list[int], list[tuple]]:
        """Token ids of the chat and, per assistant message, its span [start, end) (METHOD.md §3):
        start = first token of the content, end = its closing <|im_end|> + 1.

        The template's special tokens are inserted as ids and the text between them is encoded as
        text, piece by piece: the ids a tokenizer gives the whole ChatML string (special tokens
        split it into these same pieces), except that a message cannot open or close a turn."""
        self._check(messages)
        if not messages or messages[0]["role"] != "system":
            messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
        ids, spans = [], []
        for m in messages:
            head = f"{m['role']}\n"
            enc = self.tok.encode(common.without_surrogates(head + m["content"]),
                                  add_special_tokens=False)
            ids.append(self.im_start_id)
            if m["role"] == "assistant":        # first token reaching past the head
                start = len(ids) + bisect_right([e for _, e in enc.offsets], len(head))
                spans.append((start, len(ids) + len(enc.ids) + 1))
            ids += enc.ids + [self.im_end_id] + self.encode("\n")
        if add_generation_prompt:
            ids += [self.im_start_id] + self.encode("assistant\n")
        return ids, spans


def chat_text(messages, add_generation_prompt=False) -> str:
    """The ChatML text of a chat, as the chat template writes it (the text a tokenizer is trained
    on; Tokenizer.render gives the ids, with the template's special tokens as ids)."""
    system = [] if messages and messages[0]["role"] == "system" else \
        [f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"]
    return "".join(system + [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                             for m in messages]) + \
        ("<|im_start|>assistant\n" if add_generation_prompt else "")


def keep_last(ids: list[int], spans: list[tuple], max_len: int):
    """Keep the last max_len tokens (METHOD.md §3); spans shift with them, a span cut in part is
    clipped at 0 and one cut entirely becomes (0, 0). Returns (ids, spans, n_cut)."""
    cut = max(0, len(ids) - max_len)
    if not cut:
        return ids, list(spans), 0
    shifted = [(max(0, s - cut), max(0, e - cut)) for s, e in spans]
    return ids[cut:], shifted, cut


# ----------------------------------------------------------------------------------------------
# Generation (gpt-fast style small functions) and teacher-forced traces


@dataclass
class TurnTrace:
    """Everything a reward needs from one assistant turn (CPU, float32)."""
    tokens: list[int]                   # the turn's tokens (ends with a stop token when finished)
    span: tuple[int, int]               # absolute positions [start, end) in the sequence
    attn: dict[str, Tensor]             # STATS -> (L, H), averaged over span rows ({} if no stats)
    h_last: Tensor | None               # (L+1, d) hidden_states[l] at the last span token
    h_mean: Tensor | None               # (L+1, d) mean over span rows of hidden_states[l]
    finished: bool                      # stopped on a stop token (vs max_new_tokens)
    # log pi(token) of each sampled token at the sampling temperature (T = 1 when greedy), from
    # the logits it was drawn from; empty for teacher-forced traces
    logprobs: list[float] = field(default_factory=list)


@torch.no_grad()
def trace_forward(model: Transformer, ids: list[int], span, stop_ids=None) -> TurnTrace:
    """The TurnTrace of tokens ids[start:end] of one sequence, teacher-forced."""
    return trace_batch(model, [ids], [span], stop_ids)[0]


@torch.no_grad()
def trace_batch(model: Transformer, seqs: list[list[int]], spans, stop_ids=None,
                rows_per_forward: int = 16) -> list[TurnTrace]:
    """trace_forward of many (sequence, span) pairs, a few rows per forward.

    Rows are right-padded: a real token never attends to a pad after it, so each row's trace is
    the one its sequence gives alone. Only the span tokens' hidden states are kept."""
    stop_ids = model.config.stop_ids if stop_ids is None else tuple(stop_ids)
    for ids, (start, end) in zip(seqs, spans):
        if not 0 <= start < end <= len(ids):
            raise ValueError(f"span {(start, end)} is not inside a sequence of {len(ids)} tokens")
    # rows of similar length share a forward (less padding); traces come back in input order
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    traces = [None] * len(seqs)
    for a in range(0, len(order), rows_per_forward):
        chunk = order[a:a + rows_per_forward]
        T = max(len(seqs[i]) for i in chunk)
        batch = torch.tensor([list(seqs[i]) + [0] * (T - len(seqs[i])) for i in chunk])  # (b, T)
        _, hidden, stats = model.trunk(batch, span=[tuple(spans[i]) for i in chunk],
                                       output_hidden_states=True)
        for r, i in enumerate(chunk):
            (start, end), ids = spans[i], seqs[i]
            h = torch.stack([hs[r, start:end].float().cpu() for hs in hidden])  # (L+1, n, d)
            traces[i] = TurnTrace(tokens=list(ids[start:end]), span=(start, end),
                                  attn={k: v[r].float().cpu() for k, v in stats.items()},
                                  h_last=h[:, -1], h_mean=h.mean(1),
                                  finished=ids[end - 1] in stop_ids)
    return traces


# A recomputed block runs its MLP over at most this many tokens (rows x positions) at a time.
MLP_CHUNK = 4096
# The head's float32 logits over a 152k vocabulary take 0.58 GiB per 1,000 tokens, and the update
# would hold several such copies (the logits, / T, the log-softmax, their gradients): it scores
# at most this many logits at a time (64 MB), and scores them again in the backward pass.
LOGITS_CHUNK = 1 << 24


def token_logprobs(policy, ids: torch.Tensor, mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """log pi(x_j | x_<j) at the masked positions j, in row-major order -> (N,) float32.

    Sized for the update of a long multi-turn rollout: the head runs only on the N positions
    that count, LOGITS_CHUNK // V of them at a time, and where a gradient is wanted each block,
    each MLP_CHUNK tokens of its MLP and each chunk of the head are recomputed in the backward
    pass instead of kept (activation checkpointing), so what the call holds is about one (T, d)
    input per block: neither the (N, V) logits nor the MLPs' (T, intermediate) activations ever
    exist for the whole rollout."""
    h, _, _ = policy.trunk(ids, recompute=True)                 # (B, T, d) after the final norm
    h = h[:, :-1]                                               # position j predicts x_{j+1}
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


# The smallest sampling temperature: below it sampling is greedy decoding in all but name, and far
# below it logits / T overflows float32 and the softmax turns to NaN (use 0 for greedy).
MIN_TEMPERATURE = 1e-3


def valid_temperature(t: float) -> bool:
    """0 (greedy), or a finite temperature of at least MIN_TEMPERATURE (nan is neither)."""
    return t == 0 or MIN_TEMPERATURE <= t < math.inf


def sample(logits: Tensor, temperature: float, top_p: float, generator=None) -> Tensor:
    """(B, V) float32 logits -> (B,) token ids; temperature 0 is greedy.

    Sampled by the inverse of each row's cumulative distribution at one uniform number: the
    draw torch.multinomial makes for a single sample costs one random number per vocabulary
    entry, which at a small model's size is most of a decoding step."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        # Nucleus: keep the most likely tokens until their mass reaches top_p (at least one).
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    cdf = probs.cumsum(-1)                                                  # (B, V)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=cdf.device, dtype=cdf.dtype)
    # strictly below the total, so a token of probability 0 at the end is never drawn
    u = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)[:, 0]


def prefill(model: Transformer, cache, new_tokens: list[list[int]]) -> Tensor | None:
    """Append each row's new tokens at that row's own offset; logits (B, V) after its last one
    (rows with no new tokens get zeros). Pads sit past each row's real tokens (see the top)."""
    n = torch.tensor([len(t) for t in new_tokens])
    if not len(n) or n.max() == 0:
        return None
    h = prefill_last(model, cache, new_tokens)
    rows = (n > 0).nonzero().squeeze(-1).to(h.device)
    logits = torch.zeros(len(new_tokens), model.config.vocab_size, device=h.device)
    logits[rows] = model.lm_head(h[rows]).float()
    return logits


def prefill_last(model: Transformer, cache, new_tokens: list[list[int]]) -> Tensor:
    """prefill up to the head: the final-normed hidden state of each row's last new token (B, d)
    (garbage in a row with none).

    An empty cache whose rows start alike (GRPO's group: G copies of one prompt) computes each
    distinct prompt once and copies its keys, values and last state to the rows that repeat it:
    a row's numbers do not depend on the rows beside it, so the copies are what computing them
    would give, to the bit (the head is then applied to every row, as it would be)."""
    lengths = cache[0].lengths.clone()
    n = torch.tensor([len(t) for t in new_tokens])
    T = int(n.max())
    if not lengths.any():
        first = {}                                      # tokens -> their row in `once`
        index = torch.tensor([first.setdefault(tuple(t), len(first)) for t in new_tokens])
        if len(first) < len(new_tokens):
            once = model.new_cache(len(first), capacity=T)
            h = prefill_last(model, once, [list(t) for t in first])
            for c, o in zip(cache, once):
                c.grow(T)
                i = index.to(c.k.device)
                c.k[:, :, :T], c.v[:, :, :T] = o.k[i, :, :T], o.v[i, :, :T]
            set_lengths(cache, n)
            return h[index.to(h.device)]
    ids = torch.tensor([list(t) + [0] * (T - len(t)) for t in new_tokens])     # (B, T)
    positions = lengths[:, None] + torch.arange(T)
    h, _, _ = model.trunk(ids, positions, cache)
    set_lengths(cache, lengths + n)
    return h[torch.arange(len(n), device=h.device), (n - 1).clamp_min(0).to(h.device)]


def decode_one_token(model: Transformer, cache, tokens: Tensor, fed: Tensor,
                     span_start: Tensor | None, w=None):
    """Feed tokens (B,) of the rows where fed (B,) is True, each at its row's length; (logits
    (B, V), hidden states, statistics), the last two given span_start (Transformer.decode).
    A row not fed gets a pad in its first free slot, which stays free."""
    lengths = cache[0].lengths.clone()
    out = model.decode(torch.where(fed, tokens, 0), cache, span_start, w)
    set_lengths(cache, lengths + fed.long().cpu())
    return out


@dataclass
class TurnStats:
    """Per row, the running sums of the statistics of the turn being decoded (float32, on the
    model's device until the turn ends)."""
    attn: Tensor                        # (B, L, H, len(STATS)) summed over the turn's tokens
    h_sum: Tensor                       # (L+1, B, d) hidden states summed over the turn's tokens
    h_last: Tensor                      # (L+1, B, d) hidden states of the latest token

    @classmethod
    def zeros(cls, config: Config, B: int, device=None) -> "TurnStats":
        L, H, d = config.num_hidden_layers, config.num_attention_heads, config.hidden_size
        return cls(torch.zeros(B, L, H, len(STATS), device=device),
                   torch.zeros(L + 1, B, d, device=device), torch.zeros(L + 1, B, d, device=device))

    def means(self, r: int, n: int) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """Row r's turn of n tokens: attention statistics (STATS -> (L, H)), h_last, h_mean."""
        return (dict(zip(STATS, (self.attn[r] / n).unbind(-1))), self.h_last[:, r].clone(),
                self.h_sum[:, r] / n)


def accumulate(acc: TurnStats, attn: Tensor, hidden: Tensor, fed: Tensor):
    """Add one decoded token's statistics (B, L, H, 6) and hidden states (L+1, B, d) to the
    rows that fed a real token (fed (B,) bool). The other rows' numbers are garbage (they were
    fed a pad): where, not a multiply."""
    acc.attn += torch.where(fed[:, None, None, None], attn, 0.0)
    hidden = hidden.float()
    acc.h_sum += torch.where(fed[None, :, None], hidden, 0.0)
    acc.h_last = torch.where(fed[None, :, None], hidden, acc.h_last)


def reserve_slots(cache: list[KVCache], steps: int):
    """Room for `steps` more tokens a row, and past the last block of key slots a decoding step
    attends over, reserved before a generation on a GPU: the captured step then writes at the
    same addresses to its end, and its key slots never fill the cache, a relation between the
    sizes that torch would compile a graph of its own for (at 7B, a minute and more)."""
    need = -(-(int(cache[0].lengths.max()) + steps) // KEY_BLOCK) * KEY_BLOCK + 1
    for c in cache:
        c.grow(need)


@torch.no_grad()
def generate(model: Transformer, cache, new_tokens: list[list[int]], max_new_tokens: int,
             temperature=1.0, top_p=1.0, stop_ids=None, generator=None,
             stats=True, active=None) -> list[TurnTrace | None]:
    """Append each row's new tokens to the cache, then sample up to max_new_tokens per row.

    A row with no new tokens generates nothing (empty trace); a row with active[i] False (an
    episode that has ended) gets nothing appended and None as its trace. With max_new_tokens=0
    the call only appends. Every sampled token, the stop token included, is fed through the
    model, so the cache holds it and (stats=True) its attention statistics and hidden states are
    accumulated: the returned traces cover exactly the generated tokens. Idle rows still ride
    along in the batch as pads (decoding is bound by reading the weights, so they cost little).
    The decoding loop keeps every row's state in tensors on the model's device; each step it
    reads back which rows were fed (the cache's lengths live on the CPU) and whether any row is
    still running.
    """
    B = len(new_tokens)
    if B != cache[0].k.shape[0]:
        raise ValueError(f"{B} rows of new tokens for a cache of batch size {cache[0].k.shape[0]}")
    if active is not None and len(active) != B:
        raise ValueError(f"active has {len(active)} entries for {B} rows")
    if not valid_temperature(temperature):
        raise ValueError(f"temperature {temperature}: 0 (greedy) or in [{MIN_TEMPERATURE}, inf)")
    alive = [True] * B if active is None else [bool(a) for a in active]
    new_tokens = [list(t) if a else [] for t, a in zip(new_tokens, alive)]
    stop_ids = sorted(set(model.config.stop_ids if stop_ids is None else stop_ids))

    logits = prefill(model, cache, new_tokens)
    span_start = cache[0].lengths.clone()                                    # (B,)
    running = torch.tensor([len(t) > 0 and max_new_tokens > 0 for t in new_tokens])
    dev = logits.device if logits is not None else input_device(model)
    steps = max_new_tokens if running.any() else 0
    running = running.to(dev)
    tokens = torch.zeros(B, max(steps, 1), dtype=torch.long, device=dev)
    logps = torch.zeros(B, max(steps, 1), device=dev)
    count = torch.zeros(B, dtype=torch.long, device=dev)
    finished = torch.zeros(B, dtype=torch.bool, device=dev)
    stop = torch.tensor(stop_ids, dtype=torch.long, device=dev)
    acc = TurnStats.zeros(model.config, B, dev) if stats else None
    if cache[0].k.is_cuda and steps:
        reserve_slots(cache, steps)
    w = model.decode_weights()                  # no_grad: the weights cannot change in the loop
    for t in range(steps):
        token = sample(logits, temperature, top_p, generator)                # (B,)
        # log pi at the sampling temperature, before top_p's truncation: the policy's own
        # probability of the token, as token_logprobs computes it for the update
        logp = torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, token[:, None])
        tokens[:, t], logps[:, t] = token, logp[:, 0]
        fed = running
        count += fed
        stopped = torch.isin(token, stop) & fed
        finished |= stopped
        running = fed & ~stopped
        logits, hidden, attn = decode_one_token(model, cache, token, fed,
                                                span_start if stats else None, w)
        if stats:
            accumulate(acc, attn, hidden, fed)
        if not running.any():
            break

    tokens, logps = tokens.cpu().tolist(), logps.cpu().tolist()
    count, finished = count.cpu().tolist(), finished.cpu().tolist()
    if stats:
        acc = TurnStats(acc.attn.cpu(), acc.h_sum.cpu(), acc.h_last.cpu())
    traces = []
    for r, s in enumerate(span_start.tolist()):
        n = count[r]
        trace = TurnTrace(tokens=tokens[r][:n], span=(s, s + n), attn={}, h_last=None,
                          h_mean=None, finished=finished[r], logprobs=logps[r][:n])
        if stats and n > 0:
            trace.attn, trace.h_last, trace.h_mean = acc.means(r, n)
        traces.append(trace if alive[r] else None)
    return traces


# ----------------------------------------------------------------------------------------------
# LoRA (Hu et al., 2021), by hand, laid out as PEFT lays it out

# A targeted nn.Linear becomes a LoRALinear that keeps the base Parameters under their own keys
# (`q_proj.weight`, `q_proj.bias`) and adds `q_proj.lora_A.weight` (r, d_in) and
# `q_proj.lora_B.weight` (d_out, r) beside them:   y = x W^T + b + (alpha / r) * B A dropout(x).
# B starts at zero, so a fresh adapter leaves the model unchanged. The adapter is kept in float32
# (as PEFT does by default) even when the base weights are bfloat16: the updates are tiny.

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
        # lora_A and lora_B are applied as functions, not called as modules: decoding calls this
        # once per projection per token, where a module call costs more than its tiny matmul
        x = x.to(self.lora_A.weight.dtype)
        if self.dropout > 0:
            x = self.lora_dropout(x)
        a = F.linear(x, self.lora_A.weight)                                    # (..., r)
        return y + (F.linear(a, self.lora_B.weight) * self.scaling).to(y.dtype)

    def extra_repr(self):
        return (f"{self.in_features}, {self.out_features}, r={self.lora_A.out_features}, "
                f"scaling={self.scaling:g}")


def merged_weight(linear: nn.Module) -> Tensor:
    """The weight an nn.Linear or LoRALinear applies now: W + scaling * B A with its adapter
    enabled (float32 throughout; without dropout, forward computes exactly this map)."""
    if isinstance(linear, LoRALinear) and linear.enabled:
        return linear.weight + linear.scaling * (linear.lora_B.weight @ linear.lora_A.weight)
    return linear.weight


def _lora_reads(linear: nn.Module) -> list[Tensor]:
    """The tensors merged_weight and the bias read now (the adapter's only while enabled)."""
    out = [linear.weight] + ([linear.bias] if linear.bias is not None else [])
    if isinstance(linear, LoRALinear) and linear.enabled:
        out += [linear.lora_A.weight, linear.lora_B.weight]
    return out


def apply_lora(model: nn.Module, r=16, alpha=32.0, dropout=0.05, targets=LORA_TARGETS,
               use_rslora=False, dtype=torch.float32) -> nn.Module:
    """Freeze `model` and wrap every nn.Linear child named in `targets` with a LoRA adapter."""
    if not (isinstance(r, int) and r > 0) or alpha <= 0 or not 0 <= dropout < 1:
        raise ValueError(f"LoRA needs an integer r > 0, alpha > 0 and 0 <= dropout < 1; got "
                         f"r={r!r}, alpha={alpha!r}, dropout={dropout!r}")
    if getattr(model, "lora_settings", None) is not None:
        raise ValueError(f"the model already has a LoRA adapter ({model.lora_settings})")
    s = LoraSettings(r, float(alpha), float(dropout), tuple(targets), bool(use_rslora))
    sites = [(module, name, child) for module in model.modules()
             for name, child in module.named_children()
             if name in s.targets and type(child) is nn.Linear]
    if missing := sorted(set(s.targets) - {name for _, name, _ in sites}):
        raise ValueError(f"LoRA targets {missing} match no nn.Linear module of the model")
    for p in model.parameters():
        p.requires_grad_(False)
    for module, name, child in sites:
        # A new module starts in training mode; keep the model's mode (dropout off in eval).
        setattr(module, name, LoRALinear(child, s, dtype).train(child.training))
    model.lora_settings = s
    return model


def lora_modules(model):
    return ((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


def lora_parameters(model):
    """(name, Parameter) of every adapter weight, names as in model.state_dict()."""
    return ((n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n)


def lora_state_dict(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in lora_parameters(model)}


@contextlib.contextmanager
def lora_disabled(model):
    """`with lora_disabled(model):` runs the base model (GRPO's pi_ref) without copying weights."""
    was = {name: m.enabled for name, m in lora_modules(model)}
    for _, m in lora_modules(model):
        m.enabled = False
    try:
        yield model
    finally:
        for name, m in lora_modules(model):
            m.enabled = was[name]


def lora_state(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lora_parameters(policy)}


def load_lora_state(policy, state: dict[str, torch.Tensor]):
    with torch.no_grad():
        for n, p in lora_parameters(policy):
            p.copy_(state[n])


@contextlib.contextmanager
def lora_swapped(policy, state: dict[str, torch.Tensor]):
    """Run with other adapter weights (the lagged teacher of tips), then put the policy's back."""
    own = lora_state(policy)
    load_lora_state(policy, state)
    try:
        yield policy
    finally:
        load_lora_state(policy, own)


# ----------------------------------------------------------------------------------------------
# Layers split across devices (pipeline placement, no pipelining), applied to a built model

# The model code stays single-device. split_model moves contiguous ranges of blocks to the given
# devices and adds a forward pre-hook to each block that moves its tensor inputs there. Only one
# device computes at a time (placement, not pipelining): the point is memory, as a 7B policy with
# its LoRA state and KV caches does not fit on one 48 GB GPU. Embeddings sit on the first device,
# the final norm and lm_head on the last; new_cache puts each block's KV cache on its device.

def balance_layers(block_sizes: list[int], n_devices: int, first_extra=0, last_extra=0):
    """Layers per device: contiguous ranges whose loads (parameter counts, with the embedding on
    the first device and the head on the last) come closest to an even share each."""
    n_layers = len(block_sizes)
    if not 1 <= n_devices <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers over {n_devices} devices")
    total = first_extra + sum(block_sizes) + last_extra
    load_before = [first_extra + sum(block_sizes[:b]) for b in range(n_layers + 1)]
    cuts = [0]
    for k in range(1, n_devices):
        # Cut k where the load so far is nearest k/n of the total, leaving every device a layer.
        lo, hi = cuts[-1] + 1, n_layers - (n_devices - k)
        share = k * total / n_devices
        cuts.append(min(range(lo, hi + 1), key=lambda b: abs(load_before[b] - share)))
    cuts.append(n_layers)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _move_inputs(device):
    def to(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)     # blocking: a copy to the CPU must have landed
        if isinstance(x, (tuple, list)):
            return type(x)(to(v) for v in x)
        if isinstance(x, dict):
            return {k: to(v) for k, v in x.items()}
        return x            # caches and flags stay as they are: a block's cache lives with it

    def hook(module, args, kwargs):
        return to(args), to(kwargs)
    return hook


def parse_devices(text: str) -> list[torch.device]:
    """A --devices value ("cuda:0,cuda:1", "cpu") -> the devices; a ValueError whose message is
    the command line's one line for a value that is not a list of this machine's devices."""
    try:
        devices = [torch.device(d.strip()) for d in text.split(",")]
    except RuntimeError:                                # "", "foo", "cuda:x"
        devices = []
    if not devices or any(d.type not in ("cpu", "cuda") for d in devices):
        raise ValueError(f"--devices {text!r}: a comma-separated list of devices such as "
                         "cuda:0,cuda:1 (or cpu)")
    if any(d.type == "cuda" for d in devices) and not torch.cuda.is_available():
        raise ValueError(f"--devices {text}: this PyTorch sees no CUDA device (a CPU build, or no "
                         "GPU visible); leave --devices out to run on the CPU")
    missing = [str(d) for d in devices if d.type == "cuda" and d.index is not None
               and d.index >= torch.cuda.device_count()]
    if missing:
        raise ValueError(f"--devices {text}: no {', '.join(missing)} here (this machine has "
                         f"{torch.cuda.device_count()} GPUs)")
    return devices


def split_model(model, devices, layer_counts=None):
    """Place model.model.layers on `devices` (e.g. ["cuda:0", "cuda:1"]) in contiguous ranges.

    layer_counts: layers per device (sums to the number of layers); default balances parameters.
    """
    if hasattr(model, "layer_devices"):
        raise ValueError(f"the model is already split over {sorted(set(model.layer_devices))}")
    devices = [torch.device(d) for d in devices]
    inner, layers = model.model, model.model.layers
    head = model.lm_head
    tied = head.weight is inner.embed_tokens.weight
    if layer_counts is None:
        layer_counts = balance_layers([_n_params(b) for b in layers], len(devices),
                                      first_extra=_n_params(inner.embed_tokens),
                                      last_extra=_n_params(inner.norm) + head.weight.numel())
    layer_counts = [int(n) for n in layer_counts]
    if (len(layer_counts) != len(devices) or min(layer_counts) < 1
            or sum(layer_counts) != len(layers)):
        raise ValueError(f"layer_counts={layer_counts}: need one count >= 1 per device "
                         f"({len(devices)}) summing to the model's {len(layers)} layers")
    if tied and devices[0] != devices[-1]:
        # The head needs the embedding matrix on the last device: a second copy, which stays
        # equal to the first only while it is not trained (true under LoRA).
        if inner.embed_tokens.weight.requires_grad:
            raise ValueError("tied embeddings are copied to the last device; freeze them first "
                             "(apply_lora does) or split over one device")
        head.weight = nn.Parameter(inner.embed_tokens.weight.detach().to(devices[-1]),
                                   requires_grad=False)
    inner.embed_tokens.to(devices[0])
    inner.embed_tokens.register_forward_pre_hook(_move_inputs(devices[0]), with_kwargs=True)
    first = 0
    for device, n in zip(devices, layer_counts):
        for block in layers[first:first + n]:
            block.to(device)
            block.register_forward_pre_hook(_move_inputs(device), with_kwargs=True)
        first += n
    for module in (inner.norm, head):
        module.to(devices[-1])
        module.register_forward_pre_hook(_move_inputs(devices[-1]), with_kwargs=True)
    model.layer_devices = [d for d, n in zip(devices, layer_counts) for _ in range(n)]
    return model


# ----------------------------------------------------------------------------------------------
# CLI


def prompt_messages(prompt: str, system: str | None, tools: str | None) -> list[dict]:
    """The chat `generate` renders: the prompt as the user message or, for a model trained on a
    world, as that world renders a task: the task, a blank line, then the tool list and the
    reply format the checkpoint records (weights.checkpoint_world), exactly what the model saw
    in training and sees in rollouts."""
    content = f"{prompt.strip()}\n\n{tools}" if tools else prompt
    return ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": content}]


def main(argv=None):
    ap = argparse.ArgumentParser(description="A Qwen2-family model with native internal signals.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="chat-format a prompt and print the model's reply")
    g.add_argument("--model", required=True, help="checkpoint directory (config.json, "
                   "model.safetensors[.index.json], tokenizer.json) or a Hugging Face Hub name "
                   "such as Qwen/Qwen2.5-7B-Instruct (downloaded once into $PAIR_CACHE)")
    g.add_argument("--devices", default="cpu", help="comma-separated devices to split the "
                   "layers over, e.g. cuda:0,cuda:1 (default: cpu)")
    g.add_argument("--prompt", required=True,
                   help="the user message; for a model trained on a world, the task (--world)")
    g.add_argument("--world", default="auto", choices=("auto", "none", "shop"),
                   help="how the prompt is rendered: shop = as the shop world renders a task "
                   "(the task, then the tool list and the reply format: what the built-in "
                   "policy is trained and rolled out on; the checkpoint's config.json records "
                   f"them, {weights.WORLD_KEY} and {weights.TOOLS_KEY}, written by `shop.py "
                   "sft`); none = the prompt alone; auto (default) = the world the checkpoint "
                   "records, else none")
    g.add_argument("--system", default=None, help="system message (default: Qwen's default, "
                   "which the built-in policy is trained with too)")
    g.add_argument("--max-new-tokens", type=int, default=256,
                   help="most tokens to generate (default: 256)")
    g.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="weight dtype (default: float32)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 (default) decodes greedily")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass (default: 1, all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    args = ap.parse_args(argv)

    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be at least 1")
    if not valid_temperature(args.temperature):
        ap.error(f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                 f"got {args.temperature}")
    if not 0 < args.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not -2**63 <= args.seed < 2**64:                 # what torch.Generator takes
        ap.error(f"--seed must be in [-2**63, 2**64), got {args.seed}")
    try:
        devices = parse_devices(args.devices)
    except ValueError as e:
        ap.error(str(e))
    try:
        model, tok = load_model(args.model, dtype=DTYPES[args.dtype], devices=devices)
        world, tools = weights.checkpoint_world(model.checkpoint_dir)
    except (weights.CheckpointError, FileNotFoundError, ValueError) as e:
        sys.exit(f"--model: {e}")
    if args.world == "none":
        world, tools = None, None
    elif args.world != "auto" and world != args.world:
        sys.exit(f"--world {args.world}: {args.model} records no {args.world} task rendering "
                 f"(its config.json has {weights.WORLD_KEY} {world!r})")
    ids, _ = tok.render(prompt_messages(args.prompt, args.system, tools),
                        add_generation_prompt=True)
    context = model.config.max_position_embeddings     # the cache is made for all of it at once
    if len(ids) + args.max_new_tokens > context:
        sys.exit(f"--max-new-tokens {args.max_new_tokens}: with the prompt's {len(ids)} tokens "
                 f"that is past the model's context, {context} tokens (max_position_embeddings)")
    mode = "greedy" if args.temperature == 0 else \
        f"sampled (temperature {args.temperature}, top-p {args.top_p}, seed {args.seed})"
    print(f"[{mode} decoding, {args.dtype}; the prompt rendered "
          f"{f'as a {world} task, with its tool list' if world else 'as the user message'}, "
          f"{len(ids)} tokens]", file=sys.stderr)
    gen = torch.Generator().manual_seed(args.seed)
    trace = generate(model, model.new_cache(1, capacity=len(ids) + args.max_new_tokens), [ids],
                     args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                     stop_ids=[tok.im_end_id], generator=gen, stats=False)[0]
    tokens = trace.tokens[:-1] if trace.finished else trace.tokens
    print(tok.decode(tokens))


if __name__ == "__main__":
    main()
