"""Teacher-forced traces: the statistics and hidden states of a span of a given sequence, from one
forward over the model's own modules (model.py computes them only while decoding).

For every layer and query head, the six statistics of METHOD.md §4 (model.STATS, model.stats_from)
of each span row's softmax, averaged over the span rows. Only the span rows are scored, a chunk
of rows at a time (a block of rows x keys per head, in float32), never a T x T matrix; the rest of
the forward is the plain one. The tests check these against transformers' eager attentions and
against the statistics decoding accumulates, which study.py's features and the probes rely on.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import model
from model import STATS
import probes

# Span rows are scored in chunks of at most this many float32 scores (8 MB): below what the MLP
# of the same block holds anyway, so peak memory is unchanged.
STATS_CHUNK = 1 << 21
# On a GPU launches cost more than memory: 256 MB of scores (a 256-row span over 8,192 keys of
# the 7B's 28 heads) in one product per layer.
STATS_CHUNK_GPU = 1 << 26


@dataclass
class SpanRows:
    """Which query rows of one forward lie in the span, and where each row's span starts."""
    lo: int                 # query indices [lo, hi) cover every span row of the batch
    hi: int
    is_row: Tensor          # (B, hi - lo) bool
    start: Tensor           # (B,) span_start per row (absolute position)
    count: Tensor           # (B,) number of span rows per row

    def to(self, device) -> "SpanRows":
        return SpanRows(self.lo, self.hi, self.is_row.to(device), self.start.to(device),
                        self.count.to(device))


@dataclass
class Traced:
    logits: Tensor | None                       # (B, T, V) float32, when asked for
    hidden_states: tuple[Tensor, ...] | None    # L+1 x (B, T, d), Hugging Face convention
    attn_stats: dict[str, Tensor] | None        # STATS -> (B, L, H), span rows averaged


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
    """(B, 1, S, 2): per key slot [j < span_start, j >= span_start]. p times it gives the prefix
    and self masses at once: masked keys j > i hold p = 0, so "not before" is start <= j <= i."""
    before = (key_pos < start[:, None]).float()                 # (B, S) keys j < span_start
    return torch.stack((before, 1 - before), -1)[:, None]


def row_stats(p: Tensor, pos: Tensor, key_pos: Tensor, start: Tensor) -> dict[str, Tensor]:
    """The six statistics of each row of p (B,H,c,S); pos (B,c), key_pos (B,S), start (B,)."""
    masses = p @ masses_matrix(key_pos, start)                  # (B, H, c, 2)
    return model.stats_from(p.amax(-1), torch.linalg.vecdot(p, p), *masses.unbind(-1),
                            pos[:, None], start[:, None, None])


def add_row_stats(sums: Tensor, p, pos, key_pos, rows: SpanRows, a: int, b: int):
    """Add the statistics of query rows [a, b) that lie in the span to sums (B, H, len(STATS))."""
    stats = row_stats(p, pos, key_pos, rows.start)
    values = torch.stack([stats[name] for name in STATS], -1)   # (B, H, c, 6)
    keep = rows.is_row[:, None, a - rows.lo:b - rows.lo, None]  # (B, 1, c, 1)
    # where, not multiply: rows outside the span may hold inf/nan (e.g. m_new of i < start).
    sums += torch.where(keep, values, 0.0).sum(2)


def span_stats(attn: model.Attention, sums, q, k, mask, positions, rows: SpanRows):
    """q k^T again for the span rows only, a chunk of rows at a time: (B, H, c, S). mask None:
    the fused causal forward; the span rows' masks are built here."""
    B, H, _, _ = q.shape
    k = k.float()
    budget = STATS_CHUNK if q.device.type == "cpu" else STATS_CHUNK_GPU
    step = max(1, budget // (B * H * k.shape[2]))
    for a in range(rows.lo, rows.hi, step):
        b = min(a + step, rows.hi)
        m = model.attention_mask(positions[:, a:b], positions, None) if mask is None \
            else mask[:, :, a:b]
        p = attention_probs(q[:, :, a:b], k, m, attn.scale)
        add_row_stats(sums, p, positions[:, a:b], positions, rows, a, b)


def attention(attn: model.Attention, x, cos, sin, mask, positions, rows):
    """Attention.forward, and the per-head sums of the span rows' statistics (B, H, len(STATS))
    (None when no row of this call is in the span)."""
    B, T, _ = x.shape
    dev = x.device                              # the block may live on any device
    cos, sin, positions, rows = cos.to(dev), sin.to(dev), positions.to(dev), rows.to(dev)
    mask = mask.to(dev) if mask is not None else None
    q = attn.q_proj(x).view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)  # (B, H, T, D)
    k = attn.k_proj(x).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    q, k = model.apply_rope(q, cos, sin), model.apply_rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=True)
    sums = None
    if rows.hi > rows.lo:
        sums = x.new_zeros(B, attn.n_heads, len(STATS), dtype=torch.float32)
        span_stats(attn, sums, q, k, mask, positions, rows)
    out = out.transpose(1, 2).reshape(B, T, attn.n_heads * attn.head_dim)
    return attn.o_proj(out), sums


def forward(net: model.Transformer, input_ids: Tensor, span=None, output_hidden_states=False,
            logits=False) -> Traced:
    """Transformer.forward from position 0, teacher-forced, and the statistics of the span rows:
    span (start, end) or one per row. The plain forward's arithmetic, op for op."""
    B, T = input_ids.shape
    dev = model.input_device(net)
    # Right-padded rows from position 0: PyTorch's fused causal kernel needs no mask (no real
    # token sees a pad); the span rows' statistics build their own.
    fused_causal = T > 1 and all(w is None for w in net.windows)
    positions = (torch.zeros(B, dtype=torch.long)[:, None] + torch.arange(T)).to(dev)
    masks = {w: None if fused_causal else model.attention_mask(positions, positions, w)
             for w in set(net.windows)}
    cos, sin = model.rope_tables(net.inv_freq, positions, net.model.embed_tokens.weight.dtype)
    rows = span_rows(span if span is not None else (0, 0), positions)

    x = net.model.embed_tokens(input_ids.to(dev))                           # (B, T, d)
    hidden_states, layer_sums = [x], []
    for i, layer in enumerate(net.model.layers):
        x = x.to(layer.input_layernorm.weight.device)       # a split model's blocks
        a, sums = attention(layer.self_attn, layer.input_layernorm(x), cos, sin,
                            masks[net.windows[i]], positions, rows)
        x = x + a
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        layer_sums.append(sums)
        if i < len(net.model.layers) - 1:
            hidden_states.append(x)
    x = net.model.norm(x)
    hidden_states.append(x)            # Hugging Face: the last hidden state is after the norm

    attn_stats = None
    if span is not None:
        H = net.config.num_attention_heads
        per_layer = [s.to(dev) if s is not None else torch.zeros(B, H, len(STATS), device=dev)
                     for s in layer_sums]
        count = rows.count.to(dev).float()[:, None, None, None]      # 0 span rows -> nan
        means = torch.stack(per_layer, 1) / count                     # (B, L, H, 6)
        attn_stats = dict(zip(STATS, means.unbind(-1)))
    return Traced(net.lm_head(x).float() if logits else None,
                  tuple(hidden_states) if output_hidden_states else None, attn_stats)


@torch.no_grad()
def trace_forward(net: model.Transformer, ids: list[int], span, stop_ids=None) -> probes.TurnTrace:
    """The TurnTrace of tokens ids[start:end] of one sequence, teacher-forced."""
    return trace_batch(net, [ids], [span], stop_ids)[0]


@torch.no_grad()
def trace_batch(net: model.Transformer, seqs: list[list[int]], spans, stop_ids=None,
                rows_per_forward: int = 16) -> list[probes.TurnTrace]:
    """trace_forward of many (sequence, span) pairs, a few rows per forward. Rows are
    right-padded: a real token never attends to a pad after it, so each row's trace is the one
    its sequence gives alone. Only the span tokens' hidden states are kept."""
    stop_ids = net.config.stop_ids if stop_ids is None else tuple(stop_ids)
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
        out = forward(net, batch, [tuple(spans[i]) for i in chunk], output_hidden_states=True)
        for r, i in enumerate(chunk):
            (start, end), ids = spans[i], seqs[i]
            h = torch.stack([hs[r, start:end].float().cpu() for hs in out.hidden_states])
            traces[i] = probes.TurnTrace(
                tokens=list(ids[start:end]), span=(start, end),
                attn_stats={k: v[r].float().cpu() for k, v in out.attn_stats.items()},
                h_last=h[:, -1], h_mean=h.mean(1), finished=ids[end - 1] in stop_ids)
    return traces
