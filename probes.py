"""The policy generating, read (METHOD.md §4, §5, §8): a turn and an episode generated
with the statistics the rewards read, the features built from them, and the probes.

- `generate` samples a turn per row on the KV cache in numbered phases (prefill, then
  sample and decode_one_token per token) -> a TurnTrace: its tokens, their log pi, its
  mean statistics and hidden states.
- `raw_features(trace)` keeps per turn what any probe needs; `feature(name, raw)` builds
  the feature sets of METHOD.md §4 from a batch.
- `rollout` plays G rollouts of an episode on one cache -> Trajectories of Steps;
  `evaluate` plays held-out episodes greedily and scores them.
- `Probe` is StandardScaler + L2 logistic regression (C = 0.01), fitted in float64 with
  torch's LBFGS: scikit-learn's model, which the tests check to 1e-4.
- The probe and features files, and AUROC (grpo.py's drift monitor reads it); METHOD.md
  §8's other metrics are lab/probing/detection.py's, the probe CLI lab/study.py's.

The statistics are read from the generation pass itself (model.py's decoding step): no
second forward runs to score a turn, so a per-turn reward costs what accumulating a few
sums per decoded token costs. Generation lives here, beside the statistics it collects
and the features made of them, so that a turn's features are read in one file.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save as safetensors_bytes

import model as mdl

# The four attention statistics of the attention probes and of PAIR's stage 2, in
# feature order.
ATTN_STATS = ("max", "std", "prefix", "self")
# Supervised feature sets (METHOD.md §4 table); each is a `Probe` input.
FEATURES = ("last_token", "mean_pooled", "multi_layer", "attention", "multi_attn",
            "hidden_attn", "lookback", "head_entropy")
# Keys of `raw_features`; a features file stacks them over records.
RAW_KEYS = ("h_last4", "h_mean", "attn_max", "attn_std", "attn_prefix", "attn_self",
            "attn_entropy", "attn_lookback")


# ---- A turn generated with its statistics (gpt-fast's prefill, decode_one_token) ------
# A batch row is one rollout, and its row of the KV cache holds the rollout so far.
# `generate` runs a turn of every row in numbered phases: 1. `prefill` appends, in one
# forward, the tokens the row's cache lacks (the prompt at the first turn, later
# turn_opening's: the observation and the next assistant header); 2. the turn's buffers
# are set up; 3. one token at a time, `sample` draws it from the last logits and
# `decode_one_token` feeds it (model.compiled_decode) and returns the next logits with
# the fed token's hidden states and attention statistics, which `accumulate` adds to the
# turn's running sums (TurnStats); 4. `turn_traces` divides the sums by the turn's
# length: a turn's statistic is its mean over the turn's tokens, as METHOD.md §4 averages
# it over the span's rows, with no second forward and no T x T attention matrix.

@dataclass
class TurnTrace:
    """One assistant turn as a reward reads it (CPU, float32): generated, or teacher-forced."""
    tokens: list[int]          # the turn's tokens (ends with a stop token when finished)
    span: tuple[int, int]               # absolute positions [start, end) in the sequence
    attn_stats: dict[str, torch.Tensor]  # STATS -> (L, H), the span's mean ({} without stats)
    h_last: torch.Tensor | None        # (L+1, d) hidden_states[l] at the last span token
    h_mean: torch.Tensor | None         # (L+1, d) the span's mean of hidden_states[l]
    finished: bool                      # stopped on a stop token (vs max_new_tokens)
    # log pi(token) at the sampling temperature (1 when greedy); empty when teacher-forced
    logprobs: list[float] = field(default_factory=list)


# A temperature below this is greedy in all but name; far below it, logits / T
# overflows float32.
MIN_TEMPERATURE = 1e-3


def valid_temperature(t: float) -> bool:
    """0 (greedy), or a finite temperature of at least MIN_TEMPERATURE (nan is neither)."""
    return t == 0 or MIN_TEMPERATURE <= t < math.inf


@torch.no_grad()
def generate(model: mdl.Transformer, cache, new_tokens: list[list[int]], max_new_tokens: int,
             temperature=1.0, top_p=1.0, stop_ids=None, generator=None,
             stats=True, active=None) -> list[TurnTrace | None]:
    """Append each row's new tokens to the cache, then sample up to
    max_new_tokens a row -> one TurnTrace a row (with stats, its mean statistics
    and hidden states); empty: no new tokens, None: active[i] False. Every
    sampled token, the stop token included, is fed (the cache holds it, its
    statistics count); idle rows ride along as pads (decoding reads the weights
    anyway). stop_ids: the tokens that end a turn (default: the model's)."""
    B = len(new_tokens)
    if not valid_temperature(temperature):
        raise ValueError(f"temperature {temperature}: 0 (greedy) or in [{MIN_TEMPERATURE}, inf)")
    alive = [True] * B
    if active is not None:
        alive = [bool(a) for a in active]
    # what each row appends: nothing for a row not playing
    appended = [[] for _ in range(B)]
    for i in range(B):
        if alive[i]:
            appended[i] = list(new_tokens[i])
    if stop_ids is None:
        stop_ids = model.config.stop_ids
    stop_ids = sorted(set(stop_ids))

    # 1. prefill: the rows' new tokens in one forward; the turn starts where they end
    logits = prefill(model, cache, appended)                            # (B, V) or None
    span_start = cache[0].lengths.clone()                               # (B,)

    # 2. the turn's buffers, on the head's device; room in the cache for the whole turn
    running = torch.tensor([len(t) > 0 and max_new_tokens > 0 for t in appended])
    dev = mdl.input_device(model)
    if logits is not None:
        dev = logits.device
    steps = 0
    if running.any():
        steps = max_new_tokens
    running = running.to(dev)                   # rows whose turn goes on
    tokens = torch.zeros(B, max(steps, 1), dtype=torch.long, device=dev)   # (B, steps)
    logps = torch.zeros(B, max(steps, 1), device=dev)                      # (B, steps)
    count = torch.zeros(B, dtype=torch.long, device=dev)       # tokens sampled a row
    finished = torch.zeros(B, dtype=torch.bool, device=dev)    # sampled a stop token
    stop = torch.tensor(stop_ids, dtype=torch.long, device=dev)
    acc = None                  # the turn's running sums; None: no statistics
    stats_start = None          # the span to read statistics for; None: logits only
    if stats:
        acc = TurnStats.zeros(model.config, B, dev)
        stats_start = span_start
    if cache[0].k.is_cuda and steps:
        reserve_slots(cache, steps)
    w = model.decode_weights()  # no_grad: the weights cannot change in the loop

    # 3. decode: each step samples a token a row, feeds it where the row's turn goes
    # on and ends that turn on a stop token; the loop ends when no turn goes on
    for t in range(steps):
        token = sample(logits, temperature, top_p, generator)                # (B,)
        # log pi at the sampling temperature, before top_p's truncation: the policy's own
        # probability of the token, as token_logprobs computes it for the update
        logp = torch.log_softmax(logits / (temperature or 1.0), -1).gather(1, token[:, None])
        tokens[:, t] = token
        logps[:, t] = logp[:, 0]
        fed = running
        count += fed
        stopped = torch.isin(token, stop) & fed
        finished |= stopped
        running = fed & ~stopped
        logits, hidden, attn_stats = decode_one_token(model, cache, token, fed, stats_start, w)
        if stats:
            accumulate(acc, attn_stats, hidden, fed)
        if not running.any():
            break

    # 4. read back: each row's tokens, log-probabilities and mean statistics
    return turn_traces(tokens, logps, count, finished, span_start, acc, alive)


def prefill(model: mdl.Transformer, cache, new_tokens: list[list[int]]) -> torch.Tensor | None:
    """Append each row's new tokens at that row's own offset -> logits (B, V)
    after its last one (zeros for a row with none), or None where no row has any."""
    n = torch.tensor([len(t) for t in new_tokens])                          # (B,)
    if not len(n) or n.max() == 0:
        return None
    h = prefill_last(model, cache, new_tokens)                              # (B, d)
    rows = (n > 0).nonzero().squeeze(-1).to(h.device)
    logits = torch.zeros(len(new_tokens), model.config.vocab_size, device=h.device)
    logits[rows] = model.lm_head(h[rows]).float()                   # the head: rows only
    return logits


def prefill_last(model: mdl.Transformer, cache, new_tokens: list[list[int]]) -> torch.Tensor:
    """prefill up to the head: the final-normed state of each row's last new token
    (B, d), garbage in a row with none. An empty cache whose rows repeat a prompt
    (GRPO's group) computes each distinct prompt once and copies it, bit-identical:
    a row does not depend on its neighbours. Rows of different lengths are padded
    on the right with token 0, after the row's real tokens: none attends to it, and
    the row's length stops before it (the next tokens overwrite it)."""
    lengths = cache[0].lengths.clone()                                 # (B,) tokens held
    n = torch.tensor([len(t) for t in new_tokens])                    # (B,) tokens added
    T = int(n.max())
    if not lengths.any():
        first = {}                                      # tokens -> their row in `once`
        index = torch.tensor([first.setdefault(tuple(t), len(first)) for t in new_tokens])
        if len(first) < len(new_tokens):
            once = model.new_cache(len(first), capacity=T)    # each distinct prompt once
            h = prefill_last(model, once, [list(t) for t in first])
            # each row copies its prompt's keys and values
            for c, o in zip(cache, once):
                c.grow(T)
                i = index.to(c.k.device)
                c.k[:, :, :T] = o.k[i, :, :T]
                c.v[:, :, :T] = o.v[i, :, :T]
            mdl.set_lengths(cache, n)
            return h[index.to(h.device)]
    ids = torch.tensor([list(t) + [0] * (T - len(t)) for t in new_tokens])     # (B, T)
    positions = lengths[:, None] + torch.arange(T)                              # (B, T)
    h = model.trunk(ids, positions, cache)                                    # (B, T, d)
    mdl.set_lengths(cache, lengths + n)
    return h[torch.arange(len(n), device=h.device), (n - 1).clamp_min(0).to(h.device)]


def reserve_slots(cache: list[mdl.KVCache], steps: int):
    """Room for `steps` more tokens a row and one past the last KEY_BLOCK before
    generating on a GPU: the captured step keeps its addresses; a full cache
    would compile a new graph (minutes). The capacity needed is the longest row
    plus steps, rounded up to whole KEY_BLOCKs, plus 1."""
    need = -(-(int(cache[0].lengths.max()) + steps) // mdl.KEY_BLOCK) * mdl.KEY_BLOCK + 1
    for c in cache:
        c.grow(need)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator=None) -> torch.Tensor:
    """(B, V) float32 logits -> (B,) token ids, one per row, drawn from
    softmax(logits / T) at T = temperature, within the top_p nucleus when top_p < 1;
    temperature 0 is greedy (the argmax: evaluation decodes so). Each row is drawn by
    inverting its CDF at one uniform number of `generator` (torch.multinomial draws
    one per vocabulary entry). A rollout given its own generator (grpo.sampler: one
    per prompt, seeded by the prompt's number) draws the same tokens whatever else
    uses torch's global random stream, and on any number of processes."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        # nucleus: the most likely tokens until their mass reaches top_p (at
        # least one); the rest get probability 0, and the CDF below is not
        # renormalized: u is scaled instead
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    cdf = probs.cumsum(-1)                                                  # (B, V)
    total = cdf[:, -1:]                                                     # (B, 1)
    u = torch.rand(total.shape, generator=generator, device=cdf.device, dtype=cdf.dtype)
    # strictly below the total, so a token of probability 0 at the end is never drawn
    u = torch.minimum(u * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True)[:, 0]   # the first token whose cdf > u


def decode_one_token(model: mdl.Transformer, cache, tokens: torch.Tensor, fed: torch.Tensor,
                     span_start: torch.Tensor | None, w=None):
    """Feed tokens (B,) of the rows where fed (B,) is True, each at its row's
    length -> model.compiled_decode's (logits (B, V), hidden (L+1, B, d),
    attn_stats (B, L, H, 6)). A row not fed (its turn ended, or it plays no more)
    writes a pad to a free slot and keeps its length. span_start (B,): each row's
    first position of the turn, where `prefix` and `self` part (METHOD.md §4);
    None: logits only. w: the blocks' decoding weights, fetched once a turn."""
    lengths = cache[0].lengths.clone()
    out = mdl.compiled_decode(model, torch.where(fed, tokens, 0), cache, span_start, w)
    mdl.set_lengths(cache, lengths + fed.long().cpu())
    return out


@dataclass
class TurnStats:
    """Per row, the running sums over the turn being decoded (float32, on the head's device)."""
    attn_sum: torch.Tensor      # (B, L, H, len(STATS)) statistics summed over the tokens
    h_sum: torch.Tensor         # (L+1, B, d) hidden states summed over the turn's tokens
    h_last: torch.Tensor                # (L+1, B, d) hidden states of the latest token

    @classmethod
    def zeros(cls, config: mdl.Config, B: int, device=None) -> "TurnStats":
        """Zero sums for B rows of a model of this config."""
        L, H, d = config.num_hidden_layers, config.num_attention_heads, config.hidden_size
        return cls(torch.zeros(B, L, H, len(mdl.STATS), device=device),
                   torch.zeros(L + 1, B, d, device=device),
                   torch.zeros(L + 1, B, d, device=device))


def accumulate(acc: TurnStats, attn_stats: torch.Tensor, hidden: torch.Tensor, fed: torch.Tensor):
    """Add one decoded token's statistics (B, L, H, 6) and hidden states (L+1,
    B, d) to the rows that fed a real token (fed (B,) bool); where, not
    multiply: a pad row's numbers are garbage, and 0 times an infinite number is
    NaN. Every fed token counts, the stop token included (a turn's statistics
    are read up to its <|im_end|>); h_last keeps the last fed token's states."""
    acc.attn_sum += torch.where(fed[:, None, None, None], attn_stats, 0.0)
    hidden = hidden.float()
    acc.h_sum += torch.where(fed[None, :, None], hidden, 0.0)
    acc.h_last = torch.where(fed[None, :, None], hidden, acc.h_last)


def turn_traces(tokens, logps, count, finished, span_start, acc, alive) -> list[TurnTrace | None]:
    """generate's traces, read back at once: row r sampled tokens[r, :count[r]] from
    span_start[r] on; acc: its TurnStats (None: no statistics), divided by count[r]."""
    # one copy from the device each, not one a row
    token_rows = tokens.cpu().tolist()
    logp_rows = logps.cpu().tolist()
    counts = count.cpu().tolist()
    finished_rows = finished.cpu().tolist()
    sums = None
    if acc is not None:
        sums = TurnStats(acc.attn_sum.cpu(), acc.h_sum.cpu(), acc.h_last.cpu())
    traces = []
    for r, s in enumerate(span_start.tolist()):
        n = counts[r]
        trace = TurnTrace(tokens=token_rows[r][:n], span=(s, s + n), attn_stats={},
                          h_last=None, h_mean=None, finished=finished_rows[r],
                          logprobs=logp_rows[r][:n])
        if sums is not None and n > 0:
            # STATS -> (L, H)
            trace.attn_stats = dict(zip(mdl.STATS, (sums.attn_sum[r] / n).unbind(-1)))
            trace.h_last = sums.h_last[:, r].clone()  # (L+1, d), not a view of the batch
            trace.h_mean = sums.h_sum[:, r] / n             # (L+1, d)
        if alive[r]:
            traces.append(trace)
        else:
            traces.append(None)
    return traces


# ---- A turn's features (METHOD.md §4) --------------------------------------------------
# Per turn, with d the hidden size, L layers and H query heads; p_ij is the
# softmax probability of the turn's query row i on causal key j <= i, and each
# statistic is a mean over the turn's rows:
#   last_token    the last hidden state (after the final norm) at the turn's last token  d
#   mean_pooled   the last hidden state averaged over the turn                          d
#   multi_layer   the last four hidden states at the last token, concatenated          4d
#   attention     the last layer's [max, std, prefix, self], each over the H heads     4H
#   multi_attn    the same for every layer, layer-major                               4HL
#   hidden_attn   [last_token; attention]                                          d + 4H
#   lookback      m_ctx / (m_ctx + m_new) of every layer and head (Lookback Lens)      HL
#   head_entropy  -log sum_j p_ij^2 of every layer and head (Renyi-2, Head Entropy)    HL
# with max = max_j p_ij, std their population std over the i + 1 keys, prefix =
# sum_{j < start} p_ij (the context before the turn), self = sum_{start <= j <= i}
# p_ij (the turn itself), and m_ctx, m_new the mean p_ij over those two key ranges.
# PAIR's stage 1 reads last_token, its stage 2 [multi_attn; s_bc] (pair.py).


def raw_features(trace) -> dict[str, torch.Tensor]:
    """What any probe needs of one TurnTrace, float32 on the CPU: the last four
    hidden states at the last token, the last one's turn mean, the six
    statistics of every layer and head."""
    raw = {"h_last4": trace.h_last[-4:].float(),                        # (4, d)
           "h_mean": trace.h_mean[-1].float()}                          # (d,)
    for stat in ("max", "std", "prefix", "self", "entropy", "lookback"):
        raw[f"attn_{stat}"] = trace.attn_stats[stat].float()                  # (L, H)
    return raw


def stack_raw(raws: list[dict]) -> dict[str, torch.Tensor]:
    """raw_features of N turns -> one dict of tensors with a leading N axis."""
    return {k: torch.stack([r[k] for r in raws]) for k in raws[0]}


def attn_features(raw: dict, stats=ATTN_STATS, last_layer_only=False) -> torch.Tensor:
    """The statistics `stats` of every layer (multi_attn) or of the last one
    (attention), layer-major: for each layer the statistics one after the
    other, each over all heads. PAIR's stage 2 passes the statistics it was
    fitted on: all four, or a subset (the ablation of METHOD.md §8)."""
    parts = [raw[f"attn_{s}"] for s in stats]                           # k x (N, L, H)
    if last_layer_only:
        parts = [p[:, -1:] for p in parts]                              # k x (N, 1, H)
    return torch.stack(parts, dim=-2).flatten(-3).double()         # (N, L, k, H) -> flat


def feature_width(name: str, d: int, L: int, H: int) -> int:
    """The width of feature set `name` for a model of hidden size d, L layers and H heads."""
    # multi_layer: h_last4, as many as the model has
    return {"last_token": d, "mean_pooled": d, "multi_layer": min(4, L + 1) * d,
            "attention": 4 * H, "multi_attn": 4 * H * L, "hidden_attn": d + 4 * H,
            "lookback": H * L, "head_entropy": H * L}[name]


def feature(name: str, raw: dict[str, torch.Tensor]) -> torch.Tensor:
    """Feature set `name` (METHOD.md §4) of a batch of raw features -> (N, D) float64."""
    n = raw["h_mean"].shape[0]
    build = {"last_token": lambda: raw["h_last4"][:, -1].double(),               # (N, d)
             "mean_pooled": lambda: raw["h_mean"].double(),                      # (N, d)
             "multi_layer": lambda: raw["h_last4"].reshape(n, -1).double(),     # (N, 4d)
             "attention": lambda: attn_features(raw, last_layer_only=True),     # (N, 4H)
             "multi_attn": lambda: attn_features(raw),                         # (N, 4HL)
             "hidden_attn": lambda: torch.cat([build["last_token"](), build["attention"]()], 1),
             "lookback": lambda: raw["attn_lookback"].reshape(n, -1).double(),  # (N, HL)
             "head_entropy": lambda: raw["attn_entropy"].reshape(n, -1).double()}   # (N, HL)
    if name not in build:
        raise ValueError(f"unknown feature set {name!r}; expected one of {FEATURES}")
    return build[name]()


# ---- An episode's rollout: G rollouts of one prompt on one KV cache; evaluation -------
# A multi-turn episode is played as one growing token sequence per rollout, held in its
# row of the KV cache: the chat template's prompt (the task, the tool list and the
# reply format), then turn after turn the assistant's tokens as sampled and the opening
# of the next turn (the observation as a user message, then the assistant header). A
# turn prefills only what is new, so it costs its own tokens, never the whole history
# again. The environment reads each turn's text, answers a tool call with an
# observation, and ends the episode at a final answer or at its turn limit; the rollout
# then gets the episode's task score. GRPO's group is G rows of the same episode.

@dataclass
class Step:
    """One assistant turn of one rollout: the tokens the update trains on, the
    statistics the reward reads, and the text the environment saw and answered."""
    tokens: list[int]      # what the policy generated (ends with <|im_end|> if finished)
    segment: int                    # which of Trajectory.segments holds it ...
    span: tuple[int, int]           # ... at these positions [start, end)
    text: str                       # the assistant text handed to the environment
    trace: TurnTrace | None   # statistics from the generation pass (None: not collected)
    observation: str | None     # the environment's answer (None: the episode ended here)
    nll: float | None = None        # mean -log pi of its tokens as sampled
    history: list[dict] = field(default_factory=list)   # the chat up to this turn


@dataclass
class Trajectory:
    """One rollout of one episode: its token sequences, its turns in order, its
    task score. Most rollouts have one segment; an environment that rewrites
    earlier messages (a history cap, StepResult.rewritten_from) starts a new one,
    rendered again from the chat, and the turns after it sit in the new segment."""
    episode: object            # an envs.Episode: step(text), messages, score(), labels()
    segments: list[list[int]] = field(default_factory=lambda: [[]])
    steps: list[Step] = field(default_factory=list)
    score: float = 0.0              # task score in [0, 1]
    truncated: bool = False         # stopped by --max-len, not by the episode


def turn_opening(tok, finished: bool, observation: str | None) -> list[int]:
    """The tokens Tokenizer.render puts between two assistant turns (METHOD.md
    §2): <|im_end|> if the turn hit max_new_tokens, "\\n", the observation as a
    user message, the next prompt."""
    ids = []
    if not finished:        # the template closes a turn cut off at max_new_tokens
        ids.append(tok.im_end_id)
    ids += tok.encode("\n")
    if observation is not None:      # text, not template: it cannot open or close a turn
        ids += [tok.im_start_id] + tok.encode(f"user\n{observation}") + [tok.im_end_id] + \
            tok.encode("\n")
    return ids + [tok.im_start_id] + tok.encode("assistant\n")


@torch.no_grad()
def rollout(policy, tok, episodes: list, args, greedy=False, generator=None,
            stats=True, caches: list | None = None) -> list[Trajectory]:
    """Play each episode (one batch row each) to its end; `caches` gets the
    batch's KV cache (room for the longest prompt and four turns, at most
    args.max_len; it grows when needed). args: max_turns, max_new_tokens,
    max_len, temperature, top_p; greedy: temperature 0 (evaluation);
    stats=False: no statistics (a reward that reads none, or evaluation)."""
    trajs = [Trajectory(ep) for ep in episodes]
    new = [tok.render(ep.messages, add_generation_prompt=True)[0] for ep in episodes]
    # room for the prompt and four turns at first; the cache grows if needed
    cache = policy.new_cache(len(episodes), capacity=min(
        args.max_len, max(map(len, new)) + 4 * args.max_new_tokens))
    play(policy, tok, trajs, cache, new, args, greedy, generator, stats)
    if caches is not None:
        caches.append(cache)
    return trajs


@torch.no_grad()
def play(policy, tok, trajs: list[Trajectory], cache, new: list[list[int]], args, greedy=False,
         generator=None, stats=True):
    """Continue every row to the end of its episode. Row i's cache holds
    traj.segments[-1]; it appends new[i] before its next turn (the prompt, or the
    rest of a branch's prefix). Each round generates one turn for every row still
    playing, hands each turn's text to its episode and records a Step; the
    observation's tokens are the row's next new[i]. A row stops at the end of its
    episode, at args.max_turns, or when its next turn might pass args.max_len
    (truncated: scored as it stands); then each rollout gets its episode's score."""
    active = [True] * len(trajs)        # rows still playing
    refill = [False] * len(trajs)      # rows that start a new segment at their next turn
    for _ in range(args.max_turns - min(len(t.steps) for t in trajs)):
        for i, traj in enumerate(trajs):
            if len(traj.steps) >= args.max_turns:  # a branch that started deep in a tree
                active[i] = False
            # a turn that might not fit ends the rollout (it is scored as it stands)
            seen = len(traj.segments[-1])
            if refill[i]:
                seen = 0                # the new segment is written over the row's slots
            if active[i] and seen + len(new[i]) + args.max_new_tokens > args.max_len:
                active[i] = False
                traj.truncated = True
        if not any(active):
            break
        if any(a and r for a, r in zip(active, refill)):
            lengths = cache[0].lengths.clone()
            for i, traj in enumerate(trajs):
                if active[i] and refill[i]:
                    lengths[i] = 0         # the row's old slots are free: overwrite them
                    traj.segments.append([])
                    refill[i] = False
            mdl.set_lengths(cache, lengths)
        temperature = args.temperature
        if greedy:
            temperature = 0.0
        traces = generate(policy, cache, new, max_new_tokens=args.max_new_tokens,
                          temperature=temperature, top_p=args.top_p, stop_ids=[tok.im_end_id],
                          generator=generator, stats=stats, active=active)
        for i, (traj, tr) in enumerate(zip(trajs, traces)):
            if tr is None:                  # a row no longer playing
                continue
            seq = traj.segments[-1]
            seq += new[i]
            start = len(seq)
            assert tuple(tr.span) == (start, start + len(tr.tokens)), (tr.span, start)
            seq += tr.tokens
            said = tr.tokens
            # the environment reads the turn without its closing <|im_end|>
            if tr.finished:
                said = tr.tokens[:-1]
            text = tok.decode(said)
            before = [dict(m) for m in traj.episode.messages]   # as this turn saw them
            result = traj.episode.step(text)
            obs = None
            if not result.done:
                obs = traj.episode.messages[-1]["content"]
            history = before + [dict(traj.episode.messages[len(before)])]
            kept = None                 # the trace a Step keeps: none without statistics
            if stats:
                kept = tr
            traj.steps.append(Step(list(tr.tokens), len(traj.segments) - 1, (start, len(seq)),
                                   text, kept, obs,
                                   nll=-sum(tr.logprobs) / max(len(tr.logprobs), 1),
                                   history=history))
            if result.done:
                active[i] = False
                new[i] = []
            elif getattr(result, "rewritten_from", None) is not None:
                # earlier messages changed: the next turn starts a segment from the whole chat
                new[i] = tok.render(traj.episode.messages, add_generation_prompt=True)[0]
                refill[i] = True
            else:
                new[i] = turn_opening(tok, tr.finished, obs)
    for traj in trajs:
        score = traj.episode.score()
        traj.score = 0.0            # a skipped episode (it cannot be scored) counts 0
        if score is not None:
            traj.score = float(score)


def evaluate(policy, tok, env, pool, n: int, args, procs, name: str = "held-out") -> dict:
    """Greedy rollouts on the first n episodes of `pool` (0: all): mean task
    score, mean turns, and every episode's score in pool order (for paired
    comparisons). Each process plays its share of the episodes (my_episodes),
    args.eval_batch at a time; the scores are gathered back in pool order."""
    count = len(pool)                   # the episodes evaluated
    if n:
        count = min(n, len(pool))
    mine = my_episodes(count, procs)
    policy.eval()
    my_scores = []                     # this process's episodes' scores, in `mine` order
    my_turns = 0
    t0 = time.perf_counter()
    for i in range(0, len(mine), args.eval_batch):
        episodes = [env.episode(pool[j]) for j in mine[i:i + args.eval_batch]]
        for traj in rollout(policy, tok, episodes, args, greedy=True, stats=False):
            my_scores.append(traj.score)
            my_turns += len(traj.steps)
        if procs.main:
            say_progress(len(my_scores), len(mine), t0, f"{name} episodes")
    turns = procs.all_sum([my_turns])[0]
    scores = in_pool_order(my_scores, mine, count, procs)
    return {"success": sum(scores) / max(count, 1), "episodes": count, "decoding": "greedy",
            "turns": turns / max(count, 1), "scores": scores}


def my_episodes(count: int, procs) -> list[int]:
    """This process's share of `count` held-out episodes: every procs.size-th, from its rank."""
    return list(range(procs.rank, count, procs.size))


def in_pool_order(my_values: list[float], mine: list[int], count: int, procs) -> list[float]:
    """Every process's per-episode values (this one's, in `mine` order) gathered back into
    pool order: the same list on every process, whatever their number."""
    order = procs.gather([float(j) for j in mine], count)
    return [v for _, v in sorted(zip(order, procs.gather(my_values, count)))]


def say_progress(done: int, total: int, t0: float, what: str) -> None:
    """One line of how far an evaluation is (at 7B one takes minutes), the time left
    extrapolated from the time since t0 (time.perf_counter())."""
    left = (time.perf_counter() - t0) / done * (total - done)
    print(f"  evaluating: {done}/{total} {what}, {duration(left)} left", flush=True)


def evaluate_all(step: int, policy, tok, held: dict, args, procs) -> dict:
    """The validation split (which picks the checkpoint) and the test split (which reports it)."""
    return {"step": step, "val": evaluate(policy, tok, *held["val"], args.val_episodes, args,
                                          procs, "validation"),
            "test": evaluate(policy, tok, *held["test"], args.eval_episodes, args, procs, "test")}


def duration(seconds: float) -> str:
    """"42s" or "3m07s"."""
    seconds = int(round(seconds))
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


# ---- The probe (METHOD.md §5) ---------------------------------------------------------

class Probe:
    """StandardScaler + L2-regularized logistic regression; it predicts
    P(label 1) = P(correct):
        z = (x - mean) / scale,     P(correct | x) = sigmoid(w . z + b)."""

    def __init__(self, mean=None, scale=None, w=None, b=None, info=None):
        self.mean = mean                        # (D,) StandardScaler's mean ...
        self.scale = scale               # (D,) ... and its std (1 for a constant column)
        self.w = w                              # (D,) on the standardized features
        self.b = b                              # () the intercept
        self.info = dict(info or {})            # C, n, convergence, feature name, ...

    def fit(self, X, y, C: float = 0.01, tol: float = 1e-8, max_iter: int = 5000) -> "Probe":
        """Fit on X (n, D) and labels y (n,) in {0, 1}, both classes present:
        the scaler's mean and population std of each column, then w and b
        minimizing, on the standardized rows z_i,
            sum_i logloss(sigmoid(w . z_i + b), y_i) + ||w||^2 / (2C)
        (b is not penalized; a smaller C pulls w harder to 0; METHOD.md §5 fixes
        C = 0.01). Standardizing first makes one C mean the same for features of
        any scale, as in scikit-learn's StandardScaler + LogisticRegression(C),
        whose optimum this is."""
        X = torch.as_tensor(X, dtype=torch.float64)
        y = torch.as_tensor(y, dtype=torch.float64).flatten()
        n, d = X.shape
        if y.shape[0] != n:
            raise ValueError(f"X has {n} rows but y has {y.shape[0]} labels")
        if not torch.isfinite(X).all():
            bad = (~torch.isfinite(X)).any(dim=0).nonzero().flatten()[:5].tolist()
            raise ValueError(f"non-finite feature values (columns {bad}...)")
        if not ((y == 0) | (y == 1)).all():
            raise ValueError("labels must be 0 or 1")
        if y.min() == y.max():
            raise ValueError(f"labels hold a single class ({int(y[0])}); a probe needs both")
        t0 = time.perf_counter()
        # StandardScaler: population std; a near-constant column (its variance
        # within the rounding error of the two-pass computation, as scikit-learn
        # decides) keeps scale 1
        self.mean = X.mean(dim=0)
        var = X.var(dim=0, correction=0)
        eps = torch.finfo(torch.float64).eps
        constant = var <= n * eps * var + (n * self.mean * eps) ** 2
        self.scale = torch.where(constant, torch.ones_like(var), var.sqrt())
        Z = (X - self.mean) / self.scale                                # (n, d)

        self.w, self.b, report = _fit_logistic(Z, y, C, tol, max_iter)
        self.info.update(C=C, n=n, d=d, n_pos=int(y.sum()), fit_seconds=time.perf_counter() - t0,
                         **report)
        return self

    def decision_function(self, X) -> torch.Tensor:
        """The logit w.((x - mean) / scale) + b -> (N,) float64."""
        X = torch.as_tensor(X, dtype=torch.float64)
        if X.shape[1] != self.w.shape[0]:
            raise ValueError(f"probe expects {self.w.shape[0]} features, got {X.shape[1]}")
        return ((X - self.mean) / self.scale) @ self.w + self.b

    def predict_proba(self, X) -> torch.Tensor:
        """P(correct) = P(label 1) -> (N,) float64."""
        return torch.sigmoid(self.decision_function(X))

    def save(self, path) -> None:
        """Write the probe to a safetensors file: mean, scale, w, b, and info as metadata."""
        tensors = {"mean": self.mean, "scale": self.scale, "w": self.w, "b": self.b.reshape(1)}
        save_safetensors(tensors, path, {"probe": json.dumps(self.info)})

    @classmethod
    def load(cls, path) -> "Probe":
        """A probe Probe.save wrote, in float64; a FormatError naming the file if not."""
        tensors, meta = read_safetensors(path, "probe")
        missing = {"mean", "scale", "w", "b"} - set(tensors)
        if missing:
            raise FormatError(f"{path}: not a probe file (missing tensors {sorted(missing)})")
        info = json_entry(meta, "probe", path) or {}
        check_finite(tensors, path)       # a NaN weight would turn every reward into NaN
        # Copied into fresh memory: read in place, alignment follows the header's length, and
        # float64 products change in the last bit with it.
        t = {k: v.to(torch.float64, copy=True) for k, v in tensors.items()}
        return cls(t["mean"], t["scale"], t["w"], t["b"].reshape(()), info)


def _fit_logistic(Z, y, C, tol, max_iter):
    """min_{w,b} sum_i logloss(z_i . w + b, y_i) + ||w||^2 / (2C), over n so that the tolerances
    do not depend on n; strongly convex, so LBFGS reaches scikit-learn's optimum. It stops at max
    |grad| <= tol or an objective change < 1e-14 (|grad| ~1e-8): not converged is |grad| > 1e-6.
    logloss(s, y) = -y log sigmoid(s) - (1 - y) log(1 - sigmoid(s)), from the logits (stable).
    -> (w, b, {iterations, grad_max, converged, objective}), the objective not divided by n."""
    n, d = Z.shape
    w = torch.zeros(d, dtype=torch.float64, requires_grad=True)
    p = y.mean().item()         # b starts at the base rate's log-odds: the optimum at w = 0
    b = torch.tensor(math.log(p / (1 - p)), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, max_eval=2 * max_iter,
                            tolerance_grad=tol, tolerance_change=1e-14, history_size=20,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logits = Z @ w + b                                              # (n,)
        loss = F.binary_cross_entropy_with_logits(logits, y, reduction="sum")
        loss = (loss + w.dot(w) / (2 * C)) / n
        loss.backward()
        return loss

    opt.step(closure)
    state = opt.state[opt._params[0]]
    # the objective and the gradient at the final point (step returns the first's)
    loss = closure()
    grad = torch.cat([w.grad.flatten(), b.grad.flatten()]).abs().max().item()
    converged = grad <= max(tol, 1e-6)
    if not converged:
        print(f"probes: LBFGS stopped at max |grad| = {grad:.2e} after "
              f"{state['n_iter']} iterations", file=sys.stderr)
    return w.detach(), b.detach(), {"iterations": state["n_iter"], "grad_max": grad,
                                    "converged": converged, "objective": loss.item() * n}


# ---- The probe and features files: safetensors, and the model they were read from -----

class FormatError(ValueError):
    """A probe or features file that is unreadable, unusable, or from another model."""


# What a features file was extracted with (recorded in it and in every probe fitted on it): two
# models' features can have the same width, and nothing downstream would notice them mixed.
SOURCE_KEYS = ("model", "model_sha256", "dtype", "dims")


def source(meta: dict) -> dict:
    """The SOURCE_KEYS of a file's metadata that it records."""
    return {k: meta[k] for k in SOURCE_KEYS if meta.get(k) is not None}


def check_same_source(a: dict, a_name, b: dict, b_name) -> None:
    """Refuse to combine inputs of different models (a key one side lacks is not compared)."""
    for key in ("model_sha256", "dtype", "dims"):
        if key in a and key in b and a[key] != b[key]:
            raise FormatError(f"{a_name} was made from {describe_source(a)} but {b_name} from "
                              f"{describe_source(b)} ({key} differs): they do not belong together")


def describe_source(src: dict) -> str:
    """"model NAME (sha256 0123456789ab), bfloat16, d=896 L=24 H=14", with what `src` holds."""
    dims = src.get("dims") or {}
    text = f"model {src.get('model', '?')}"
    if "model_sha256" in src:
        text += f" (sha256 {src['model_sha256'][:12]})"
    if "dtype" in src:
        text += f", {src['dtype']}"
    if dims:
        text += f", d={dims.get('d')} L={dims.get('L')} H={dims.get('H')}"
    return text


def read_safetensors(path, what: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, string metadata) of a safetensors file; corrupt: a FormatError naming it."""
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            return tensors, dict(f.metadata() or {})
    except FileNotFoundError:
        raise
    except Exception as e:      # SafetensorError: header, offsets or length do not add up
        raise FormatError(f"{path}: truncated or corrupt {what} file ({e})") from None


def json_entry(meta: dict, key: str, path):
    """The JSON value a safetensors file's metadata holds under `key` (None when absent);
    FormatError naming the file and the key when it is not JSON."""
    try:
        return json.loads(meta.get(key, "null") or "null")
    except ValueError as e:
        raise FormatError(f"{path}: metadata {key!r} is not JSON ({e})") from None


def save_safetensors(tensors: dict, path, metadata: dict) -> None:
    """Write tensors and string metadata to a safetensors file, atomically."""
    mdl.write_atomic(path, safetensors_bytes({k: v.contiguous() for k, v in tensors.items()},
                                             metadata))


def check_finite(tensors: dict, path) -> None:
    """FormatError naming the file, the tensor and the first index where a floating-point
    tensor of `tensors` holds NaN or an infinity."""
    for key, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            bad = (~torch.isfinite(t)).nonzero()[0].tolist()
            raise FormatError(f"{path}: {key} holds NaN or infinite values (first at {bad})")


# ---- AUROC (METHOD.md §8); y = 1 for a correct turn, s = a score or P(correct) ---------

def labels_scores(y, s):
    """Labels and scores as flat float64 tensors, or a ValueError if their counts differ."""
    y = torch.as_tensor(y, dtype=torch.float64).flatten()
    s = torch.as_tensor(s, dtype=torch.float64).flatten()
    if y.shape != s.shape:
        raise ValueError(f"{y.numel()} labels but {s.numel()} scores")
    return y, s


def auroc(y, s) -> float:
    """P(score of a random positive > that of a random negative), ties counting 1/2
    (Mann-Whitney U with average ranks): (R_pos - n_pos (n_pos + 1) / 2) / (n_pos n_neg),
    R_pos the sum of the positives' ranks among all scores. NaN when one class is absent."""
    y, s = labels_scores(y, s)
    n_pos = y.sum().item()
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    values, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    # average 1-based rank of each distinct value: the middle of its run in sorted order
    avg_rank = counts.cumsum(0).double() - (counts.double() - 1) / 2
    rank_sum = avg_rank[inverse][y == 1].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
