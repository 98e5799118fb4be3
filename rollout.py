"""Multi-turn rollouts: a policy plays tool-use episodes, one KV cache per batch kept across turns.

    trajs = rollout(policy, tok, [env.episode(i) for _ in range(G)], args, generator=g)

One batch row per episode. The rendered prompt is prefilled once; each later turn appends only
the new tokens (the "\\n" after the <|im_end|> the model wrote, the observation as a user
message, `<|im_start|>assistant\\n`) at the row's own offset, then samples again, until the
episode ends, `args.max_turns` are played, or the next turn might not fit in `args.max_len`.
With stats=True the per-turn internal signals every internal reward reads (hidden states and
the attention statistics of METHOD.md §4) come out of that same generation pass
(`model.generate` accumulates them): no second forward for PAIR or the probes.

A `Trajectory` keeps the tokens exactly as the model saw them, and a `Step` per assistant turn:
its tokens, where they sit, the text handed to the environment, the statistics, the
observation. GRPO (grpo.py), its evaluations, the tree-search baselines (baselines.py), the
probes fitted on a policy's own turns (onpolicy.py) and the built-in policy's recipe (shop.py)
all play episodes through this file.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

import model


@dataclass
class Step:                         # one assistant turn of one rollout
    tokens: list[int]               # what the policy generated (ends with <|im_end|> if finished)
    segment: int                    # which of Trajectory.segments holds it ...
    span: tuple[int, int]           # ... at these positions [start, end)
    text: str                       # the assistant text handed to the environment
    trace: model.TurnTrace | None   # statistics from the generation pass (None: not collected)
    observation: str | None         # the environment's answer (None: the episode ended here)
    nll: float | None = None        # mean -log pi of its tokens as sampled (AT²PO's entropy H)
    # the chat up to and including this turn as the policy saw it: an environment may rewrite
    # earlier messages later (ToolBench's history cap), and a judge rates the turn in its context
    history: list[dict] = field(default_factory=list)


@dataclass
class Trajectory:                   # one rollout of one episode
    episode: object                 # an envs.Episode: step(text), messages, score(), labels()
    # The tokens exactly as the model saw them. One sequence, unless the environment rewrote
    # earlier messages (ToolBench's history cap): then the cache is refilled with the new history
    # and a new segment starts, so that every turn is later scored in the context it came from.
    segments: list[list[int]] = field(default_factory=lambda: [[]])
    steps: list[Step] = field(default_factory=list)
    score: float = 0.0              # task score in [0, 1]
    truncated: bool = False         # stopped by --max-len, not by the episode


def turn_opening(tok, finished: bool, observation: str | None) -> list[int]:
    """The tokens between one assistant turn and the next: what a later turn appends to the cache.

    Exactly what the chat template puts there (METHOD.md §2): the newline after <|im_end|> (plus
    the <|im_end|> itself when the turn hit max_new_tokens), the observation as a user message,
    and the next generation prompt. Special tokens split the text, so these tokens are the ones
    Tokenizer.render gives for the whole conversation."""
    ids = ([] if finished else [tok.im_end_id]) + tok.encode("\n")
    if observation is not None:         # text, not template: it cannot open or close a turn
        ids += [tok.im_start_id] + tok.encode(f"user\n{observation}") + [tok.im_end_id] + \
            tok.encode("\n")
    return ids + [tok.im_start_id] + tok.encode("assistant\n")


@torch.no_grad()
def rollout(policy, tok, episodes: list, args, greedy=False, generator=None,
            stats=True, caches: list | None = None) -> list[Trajectory]:
    """Play each episode (one batch row each) to its end; returns one Trajectory per row.
    With `caches`, the KV cache of the batch is appended to it, row i holding trajectory i's
    last segment (tree search branches from it)."""
    trajs = [Trajectory(ep) for ep in episodes]
    new = [tok.render(ep.messages, add_generation_prompt=True)[0] for ep in episodes]
    cache = policy.new_cache(len(episodes), capacity=min(
        args.max_len, max(map(len, new)) + 4 * args.max_new_tokens))     # it grows if needed
    play(policy, tok, trajs, cache, new, args, greedy, generator, stats)
    if caches is not None:
        caches.append(cache)
    return trajs


@torch.no_grad()
def play(policy, tok, trajs: list[Trajectory], cache, new: list[list[int]], args, greedy=False,
         generator=None, stats=True):
    """Continue every row to the end of its episode. Row i's cache holds traj.segments[-1]; it
    appends new[i] before its next turn (the prompt, or the rest of a branch's prefix)."""
    active = [True] * len(trajs)
    refill = [False] * len(trajs)
    for _ in range(args.max_turns - min(len(t.steps) for t in trajs)):
        for i, traj in enumerate(trajs):
            if len(traj.steps) >= args.max_turns:       # a branch that started deep in a tree
                active[i] = False
            # a turn that might not fit ends the rollout (it is scored as it stands)
            seen = 0 if refill[i] else len(traj.segments[-1])
            if active[i] and seen + len(new[i]) + args.max_new_tokens > args.max_len:
                active[i], traj.truncated = False, True
        if not any(active):
            break
        if any(a and r for a, r in zip(active, refill)):
            lengths = cache[0].lengths.clone()
            for i, traj in enumerate(trajs):
                if active[i] and refill[i]:
                    lengths[i] = 0           # the row's old slots are free: overwrite them
                    traj.segments.append([])
                    refill[i] = False
            model.set_lengths(cache, lengths)
        # a row no longer playing gets nothing appended (its cache row stays) and no trace
        traces = model.generate(policy, cache, new, max_new_tokens=args.max_new_tokens,
                                temperature=0.0 if greedy else args.temperature,
                                top_p=args.top_p, stop_ids=[tok.im_end_id],
                                generator=generator, stats=stats, active=active)
        for i, (traj, tr) in enumerate(zip(trajs, traces)):
            if tr is None:
                continue
            seq = traj.segments[-1]
            seq += new[i]
            start = len(seq)
            assert tuple(tr.span) == (start, start + len(tr.tokens)), (tr.span, start)
            seq += tr.tokens
            text = tok.decode(tr.tokens[:-1] if tr.finished else tr.tokens)
            before = [dict(m) for m in traj.episode.messages]   # as this turn saw them
            result = traj.episode.step(text)
            obs = None if result.done else traj.episode.messages[-1]["content"]
            # step appends the assistant message after the ones it had (a rewrite changes
            # messages, it does not move them)
            history = before + [dict(traj.episode.messages[len(before)])]
            traj.steps.append(Step(list(tr.tokens), len(traj.segments) - 1, (start, len(seq)),
                                   text, tr if stats else None, obs,
                                   nll=-sum(tr.logprobs) / max(len(tr.logprobs), 1),
                                   history=history))
            if result.done:
                active[i], new[i] = False, []
            elif getattr(result, "rewritten_from", None) is not None:
                new[i] = tok.render(traj.episode.messages, add_generation_prompt=True)[0]
                refill[i] = True
            else:
                new[i] = turn_opening(tok, tr.finished, obs)
    for traj in trajs:
        score = traj.episode.score()
        traj.score = 0.0 if score is None else float(score)


