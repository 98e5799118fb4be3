"""The paper's other reward sources and training algorithms, beside PAIR (pair.py holds the
outcome, PAIR and probe rewards and the advantages; grpo.py the update and the training loop).

  * rewards read by vanilla GRPO, one per assistant turn (`--reward NAME`):
      coe         CoE-C of each turn, unsupervised (Wang et al., ICLR 2025);
      llm_judge   an LLM's 1-10 score of each step (judge_step, at lab/worlds/toolbench.py's
                  client);
      igpo        information gain of the gold answer (Wang et al. 2025);
      tips        potential-based shaping by a lagged teacher (Xie et al. 2026);
  * tree search, which changes how rollouts are drawn and how advantages are derived:
      tree_grpo   Tree-GRPO (Ji et al. 2025): intra- plus inter-tree normalized outcomes;
      at2po       AT²PO (Zong et al. 2026): entropy-guided expansion, entropy-weighted values,
                  and a turn-level importance ratio in the update (`turn_loss`).
Each is a row of this module's REWARDS, which lab/train.py's loop adds to the core's; the trees
are played by `play_trees` and AT²PO's update reads `turn_batch` and `at2po_loss`, where that
loop calls them. Each section states its exact rules and every choice made where a paper and its
release leave one open. Their cost is counted into the step's `cost` counter (teacher-forced rows
and tokens, sibling rollouts, external calls), which the cost table prices.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial

import torch

import envs
import grpo
import model
import pair
import probes
from lab.probing import detection
from lab.worlds import toolbench
from probes import play, rollout, Step, Trajectory


# ---------------------------------------------------------------------------------------------
# Rewards for vanilla GRPO: function(trajectory, ctx) -> one reward per turn (pair.Reward)
# ---------------------------------------------------------------------------------------------

@dataclass
class LabContext(pair.RewardContext):
    """What the lab's rewards read besides the core's: the run's flags (their own settings), the
    LLM judge's client (llm_judge) and the lagged teacher's LoRA snapshot (tips)."""
    args: object = None
    judge: object = None
    lagged: dict[str, torch.Tensor] | None = None


def coe_reward(traj: Trajectory, ctx) -> pair.TurnRewards:
    # CoE is unsupervised (METHOD.md §4-5): r_t = the turn's CoE-C score (the paper's baseline);
    # only its ordering within the group matters after normalization.
    raw = probes.stack_raw([detection.raw_with_coe(step.trace) for step in traj.steps])
    return pair.TurnRewards(detection.unsupervised_score("coe_c", raw).tolist())


def judge_reward(traj: Trajectory, ctx) -> pair.TurnRewards:
    """LLM-as-a-judge (paper baseline): a 1-10 score of each step given the task and the
    trajectory up to it, as the policy saw it when it took the step (Step.history), from an
    OpenAI-compatible endpoint, normalized to [0, 1]."""
    ctx.cost.update(external_calls=len(traj.steps))
    return pair.TurnRewards([judge_step(ctx.judge, step.history) for step in traj.steps])


# --- rewards from the teacher-forced probability of the gold answer (need the answer: training
# only). A state s_t is the token prefix right before turn t's content; the gold answer is
# appended there as a final turn ("Final Answer: <gold>") and its tokens are scored. Both methods
# give the final turn the task score (IGPO's rule; TIPS adds shaping to the environment reward)
# and the turns before it a per-turn change:

def igpo_reward(traj: Trajectory, ctx) -> pair.TurnRewards:
    """IGPO (Wang et al. 2025): r_t = p(gold | s_{t+1}) - p(gold | s_t), information gain of turn t,
    with p = exp(mean token log-probability) under the current policy."""
    states = traj_states(traj)
    logp, n = gold_logprobs(ctx.policy, ctx.tok, states, gold_answer(ctx, traj.episode),
                            ctx.args.micro_batch, ctx.cost)
    p = [math.exp(lp / k) for lp, k in zip(logp, n)]
    return pair.TurnRewards([p[t + 1] - p[t] for t in range(len(traj.steps) - 1)] + [traj.score])


def tips_reward(traj: Trajectory, ctx) -> pair.TurnRewards:
    """TIPS-style potential-based shaping: r_t = gamma Phi(s_{t+1}) - Phi(s_t), Phi = the mean
    token log-probability of the gold answer (length-normalized, as the TIPS release scores it:
    a summed one would weigh the shaping against the task score by the answer's length) under a
    lagged copy of the policy (a LoRA snapshot, refreshed every --tips-refresh steps). The final
    turn gets the task score and no shaping term, as in the release (a terminal potential of 0
    would, with group-normalized returns, cancel the shaping of every turn)."""
    states = traj_states(traj)
    with lora_swapped(ctx.policy, ctx.lagged):
        logp, n = gold_logprobs(ctx.policy, ctx.tok, states, gold_answer(ctx, traj.episode),
                                ctx.args.micro_batch, ctx.cost)
    phi = [lp / k for lp, k in zip(logp, n)]
    g = ctx.args.tips_gamma
    return pair.TurnRewards([g * phi[t + 1] - phi[t] for t in range(len(traj.steps) - 1)]
                            + [traj.score])


def traj_states(traj: Trajectory) -> list[list[int]]:
    """s_1 .. s_T: the prefix each turn was generated from (the first turn's is the prompt)."""
    return [traj.segments[s.segment][:s.span[0]] for s in traj.steps]


def gold_answer(ctx, episode) -> str:
    """The gold final answer of an episode: the shop world's answer, the gold dialog's last
    answer (replay environments), else the whitelist."""
    answer = getattr(getattr(episode, "task", None), "answer", None)
    if isinstance(answer, str):
        return answer
    record = getattr(ctx.env, "records", {}).get(episode.id, {})
    for m in reversed(record.get("dialogs") or []):
        if m.get("role") == "assistant" and isinstance(m.get("content"), str) and m["content"]:
            return m["content"]
    gt = getattr(episode, "gt_answer", None) or record.get("gt_answer")
    if isinstance(gt, dict) and gt.get("whitelist"):
        return ", ".join(group[0] for group in gt["whitelist"])
    raise SystemExit(f"--reward {ctx.args.reward}: episode {episode.id} has no gold answer")


@torch.no_grad()
def gold_logprobs(policy, tok, states: list[list[int]], answer: str, rows_per_forward: int,
                  cost: Counter | None = None) -> tuple[list[float], list[int]]:
    """Sum of log pi(answer tokens | state, "Final Answer:") per state, and the token count.
    The teacher-forced rows and tokens are added to `cost`."""
    full = tok.encode(envs.render_final(None, answer))
    head = tok.encode("Final Answer:")
    target = full[len(head):] if full[:len(head)] == head else full
    cond = full[:len(full) - len(target)]
    seqs = [s + cond + target for s in states]
    if cost is not None:
        cost.update(tf_rows=len(seqs), tf_tokens=sum(map(len, seqs)))
    sums, dev = [], model.input_device(policy)
    for i in range(0, len(seqs), rows_per_forward):
        chunk = seqs[i:i + rows_per_forward]
        T = max(len(x) for x in chunk)
        ids = torch.full((len(chunk), T), tok.pad_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), T, dtype=torch.bool)
        for r, x in enumerate(chunk):
            ids[r, :len(x)] = torch.tensor(x)
            mask[r, len(x) - len(target):len(x)] = True
        lp = model.token_logprobs(policy, ids.to(dev), mask).view(len(chunk), len(target))
        sums += lp.sum(1).tolist()
    return sums, [len(target)] * len(states)


# ---------------------------------------------------------------------------------------------
# Tree search: Tree-GRPO and AT²PO (the paper's tree-based baselines)
# ---------------------------------------------------------------------------------------------
# Both replace the G independent rollouts of a prompt by rollout trees whose nodes are whole
# agent turns (thought, action, and the observation that answers it), and both learn from the
# outcome alone: the task score of each leaf. A branch at a node keeps the turns above it and
# plays on from the exact context they left: the environment is replayed with those turns' texts
# (every environment here is deterministic, which is checked: the replayed observations must be
# the recorded ones), and the branch's KV cache row is a copy of the cache row of the rollout
# that played those turns (copy_rows), so the shared prefix is never prefilled again. Only
# its last token is fed once more, because its logits are where the branch's first token is
# drawn from. (A ToolBench rollout whose history was rewritten holds only its last segment in its
# cache: a branch from an earlier segment copies what the two share and prefills the rest.)
# Every root-to-leaf path is one sample of the update, the turns it shares with other paths
# included (as both releases train): make_batch gets one Trajectory per leaf.
#
# Tree-GRPO (Ji et al. 2025, arXiv 2509.21240; public code AMAP-ML/Tree-GRPO):
#   1. M trees per prompt, each grown from one chain rollout (--tree-m);
#   2. L times (--tree-l): in each tree draw N nodes (--tree-n) uniformly, with replacement, from
#      the root (the prompt: expanding it plays a fresh chain) and every turn that has a child
#      (a leaf has no turn after it to redo), and play one new branch from each, continuing
#      after that turn (the branch's first turn is the node's new child);
#   3. every leaf H gets its outcome R(H), and
#        A(H) = (R - mean_T) / (std_T + 1e-6) + (R - mean_P) / (std_P + 1e-6)
#      intra-tree over the leaves of its tree T plus inter-tree over all leaves of the prompt P
#      (the release's `adv_estimator=tree`, the paper's sum of the two). Every token of the path
#      gets A(H). Two leaves below a branching node share every turn above it, so the
#      difference of their intra-tree advantages lands on the turns below it: the siblings of that
#      node are compared (the paper shows this is step-level preference learning).
#   Choices: std is the population std, as in this file's GRPO (METHOD.md §9; the release's
#   torch.std is Bessel-corrected); a group whose leaves all scored alike gives 0 (the release
#   gives a lone leaf its raw score); every leaf is kept (the release's k samples leaves, and its
#   scripts set k to the leaf count).
#
# AT²PO (Zong et al. 2026, arXiv 2601.04767; public code zzfoutofspace/ATPO):
#   1. one tree per prompt whose root has M chain rollouts (--tree-m, the release's
#      initial_rollouts);
#   2. L times (--tree-l, expansion_iterations): score every non-leaf node n of the tree (the
#      root and every turn with a child) by its entropy minus the branching penalty,
#        score(n) = H(n) - alpha * (siblings of n),   H(n) = mean over n's tokens of -log pi,
#      (alpha = --at2po-penalty, the root's H is 0 and its "siblings" are its own children but
#      one, as in the release), take the top K (--tree-n, beam_size; fewer candidates are cycled
#      from the top), and regenerate each chosen turn: a new sibling of n, played from the
#      context n was generated in (the root: a fresh chain);
#   3. turn-wise credit assignment (the release's leaf_value_norm, node_value_mode
#      child_softmax, node_adv_mode node_value): leaf values V = (R - mean) / (std + 1e-6) over
#      the tree's leaves (population std), then bottom-up V(n) = sum_c softmax_c(H(c)) V(c) over
#      n's children c, and the advantage of every token of turn n is V(n);
#   4. the turn-level objective (the release's gspo_turn, see turn_loss): one importance ratio
#      per turn, PPO-clipped in [1 - 3e-3, 1 + 4e-3] (--at2po-clip), averaged over each
#      trajectory's tokens and then over trajectories.
#   Choices: H(n) is read from the generation pass itself (probes.generate records log pi of
#   every sampled token, at the sampling temperature); the KL term stays this pipeline's
#   (k3, token mean, --beta; the release ran with its KL coefficient at 0).
#
# Budget (flags left unset; G = --group): Tree-GRPO M = G/2, N = 2, L = 1, which at the paper's
# G = 4 is the release's script (m 2, n 2, l 1: 6 leaves, 2 whole chains + 4 partial ones);
# AT²PO M = G/2, K = G/4, L = 2, so that its leaves number G, as in the release, whose group
# size is its samples per tree (10 + 2 x 6 = 22). Per step the branches are priced like a reward:
# t_rollout is the M chains, t_reward the branches plus the advantages; `branch_rollouts` and
# `branch_tokens` count them, `mem_kv_mb` is the KV cache the trees hold at once.

TREE_GRPO, AT2PO = "tree_grpo", "at2po"


@dataclass(eq=False)                # a node is itself: compared and hashed by identity
class Node:                         # one assistant turn of a rollout tree; a root is the prompt
    parent: Node | None
    step: Step | None               # None at a root
    owner: Trajectory | None        # the rollout that played this turn (its cache row holds it)
    tree: int                       # which of the prompt's trees
    depth: int = 0                  # turns from the root
    children: list[Node] = field(default_factory=list)
    value: float = 0.0              # AT²PO's V(n)


@dataclass
class Forest:                       # the rollout trees of one prompt
    roots: list[Node]
    leaves: list[Trajectory] = field(default_factory=list)  # one per root-to-leaf path
    leaf_tree: list[int] = field(default_factory=list)      # the tree of each leaf
    node_of: dict = field(default_factory=dict)     # id(Step) -> Node
    caches: dict = field(default_factory=dict)      # id(Trajectory) -> (KV cache, row)
    branch_rollouts: int = 0        # rollouts started from a copied prefix
    branch_tokens: int = 0          # the tokens they generated


def attach(forest: Forest, traj: Trajectory, parent: Node, kept: int):
    """Hang traj's turns after its first `kept` (shared with parent's path) below parent."""
    for step in traj.steps[kept:]:
        node = Node(parent, step, traj, parent.tree, parent.depth + 1)
        parent.children.append(node)
        forest.node_of[id(step)] = node
        parent = node
    forest.leaves.append(traj)
    forest.leaf_tree.append(parent.tree)


def plant(policy, tok, fresh, args, generator) -> Forest:
    """The M chain rollouts: one tree each (Tree-GRPO) or all under one root (AT²PO)."""
    caches = []
    chains = rollout(policy, tok, [fresh() for _ in range(args.tree_m)], args,
                     generator=generator, stats=False, caches=caches)
    forest = Forest([Node(None, None, None, k)
                     for k in range(args.tree_m if args.reward == TREE_GRPO else 1)])
    for i, traj in enumerate(chains):
        forest.caches[id(traj)] = (caches[0], i)
        attach(forest, traj, forest.roots[i if args.reward == TREE_GRPO else 0], 0)
    return forest


def inner_nodes(root: Node) -> list[Node]:
    """The root and every turn with a child below it, breadth first (the expandable nodes)."""
    out, queue = [], [root]
    while queue:
        node = queue.pop(0)
        if node.children:
            out.append(node)
            queue += node.children
    return out


def branch_point(node: Node, after: bool) -> tuple[Node, Trajectory, int]:
    """(parent of the new branch, a rollout holding the context, turns it keeps) for a branch
    that continues after `node` (Tree-GRPO) or regenerates it (AT²PO). A root's context is the
    prompt, held by any of its chains."""
    if node.step is None:
        return node, node.children[0].owner, 0
    if after:
        return node, node.owner, node.depth
    return node.parent, node.owner, node.depth - 1


def tree_grpo_points(forest: Forest, args, generator) -> list:
    points = []
    for root in forest.roots:
        candidates = inner_nodes(root)
        if not candidates:          # a chain that never got to play a turn: nothing to branch
            continue
        draws = torch.randint(len(candidates), (args.tree_n,), generator=generator,
                              device=generator.device).tolist()
        points += [branch_point(candidates[k], after=True) for k in draws]
    return points


def at2po_score(node: Node, alpha: float) -> float:
    """H(n) - alpha x (branches already drawn beside n), the release's expansion score."""
    if node.step is None:
        return 0.0 - alpha * max(0, len(node.children) - 1)
    return node.step.nll - alpha * max(0, len(node.parent.children) - 1)


def at2po_points(forest: Forest, args, generator) -> list:
    (root,) = forest.roots
    candidates = inner_nodes(root)
    if not candidates:
        return []
    # a stable sort: equal scores keep breadth-first order
    ranked = sorted(candidates, key=lambda n: -at2po_score(n, args.at2po_penalty))
    chosen = [ranked[k % len(ranked)] for k in range(args.tree_n)]
    return [branch_point(n, after=False) for n in chosen]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def fork_episode(fresh, owner: Trajectory, kept: int):
    """A new episode in the state owner's was in after its first `kept` turns: replayed."""
    episode = fresh()
    for step in owner.steps[:kept]:
        result = episode.step(step.text)
        obs = None if result.done else episode.messages[-1]["content"]
        if obs != step.observation:
            raise RuntimeError(f"episode {episode.id}: replaying a turn gave another observation "
                               "than the rollout got; tree search needs a deterministic "
                               "environment")
    return episode


def grow(policy, tok, fresh, forest: Forest, points: list, args, generator, stats=False):
    """One new rollout per branch point, all in one batch, each from a copy of its context's
    cache row (see the section comment), hung below its parent node."""
    if not points:
        return
    trajs, new, sources = [], [], []
    for parent, owner, kept in points:
        at = owner.steps[kept]                          # the turn the branch replaces
        context = owner.segments[at.segment][:at.span[0]]
        cache, row = forest.caches[id(owner)]
        # the row holds owner.segments[-1]; re-feed at least the last token (its logits)
        n = min(common_prefix(context, owner.segments[-1]), len(context) - 1)
        trajs.append(Trajectory(fork_episode(fresh, owner, kept),
                                segments=[list(x) for x in owner.segments[:at.segment]]
                                + [context[:n]], steps=list(owner.steps[:kept])))
        new.append(context[n:])
        sources.append((cache, row, n))
    cache = policy.new_cache(len(trajs), capacity=min(args.max_len, max(
        len(t.segments[-1]) + len(x) for t, x in zip(trajs, new)) + 4 * args.max_new_tokens))
    for b, (src, row, n) in enumerate(sources):
        copy_rows(src, row, cache, b, n)
    play(policy, tok, trajs, cache, new, args, generator=generator, stats=stats)
    for b, (traj, (parent, _, kept)) in enumerate(zip(trajs, points)):
        forest.branch_rollouts += 1
        if len(traj.steps) == kept:     # cut by --max-len before its first turn: no new leaf
            continue
        forest.caches[id(traj)] = (cache, b)
        forest.branch_tokens += sum(len(step.tokens) for step in traj.steps[kept:])
        attach(forest, traj, parent, kept)


def expand(policy, tok, fresh, forest: Forest, args, generator):
    """The L expansion rounds of the method."""
    points_of = tree_grpo_points if args.reward == TREE_GRPO else at2po_points
    for _ in range(args.tree_l):
        grow(policy, tok, fresh, forest, points_of(forest, args, generator), args, generator)


def normalized(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / (std + 1e-6), population std; all zeros when x does not vary."""
    std = x.std(correction=0) if len(x) > 1 else torch.tensor(0.0, dtype=x.dtype)
    return torch.zeros_like(x) if std <= 1e-8 else (x - x.mean()) / (std + 1e-6)


def tree_grpo_advantages(forest: Forest) -> tuple[list[list[float]], bool]:
    """Per-turn advantages of every leaf path, and whether all the prompt's leaves scored alike."""
    R = torch.tensor([t.score for t in forest.leaves], dtype=torch.float64)
    trees = torch.tensor(forest.leaf_tree)
    A = normalized(R)                                            # inter-tree
    for k in trees.unique().tolist():
        A[trees == k] += normalized(R[trees == k])               # intra-tree
    return ([[a] * len(t.steps) for a, t in zip(A.tolist(), forest.leaves)],
            bool(normalized(R).abs().sum() == 0))


def at2po_advantages(forest: Forest) -> tuple[list[list[float]], bool]:
    R = torch.tensor([t.score for t in forest.leaves], dtype=torch.float64)
    V = normalized(R)
    for traj, v in zip(forest.leaves, V.tolist()):
        if traj.steps:
            forest.node_of[id(traj.steps[-1])].value = v

    def value(node: Node) -> float:          # bottom-up: entropy-weighted mean of the children
        if node.children:
            H = torch.tensor([c.step.nll for c in node.children], dtype=torch.float64)
            w = torch.softmax(H, 0).tolist()
            node.value = sum(wc * value(c) for wc, c in zip(w, node.children))
        return node.value
    for root in forest.roots:
        value(root)
    return ([[forest.node_of[id(s)].value for s in t.steps] for t in forest.leaves],
            bool(V.abs().sum() == 0))


TREE_SEARCH = {TREE_GRPO: tree_grpo_advantages, AT2PO: at2po_advantages}


def play_trees(g: int, run, t: dict) -> grpo.Group:
    """lab/train.py's play of a prompt under a tree search: the g-th prompt's trees (planted,
    then expanded by sibling rollouts), their leaves' rewards and the advantages the trees give."""
    policy, tok, ctx, args = run.policy, run.tok, run.ctx, run.args
    t0 = time.perf_counter()
    index = run.pool[grpo.prompt_index(args.seed, g, len(run.pool))]
    generator = grpo.sampler(policy, args.seed, g)
    forest = plant(policy, tok, lambda: run.env.episode(index), args, generator)
    t1 = time.perf_counter()
    # the sibling rollouts: the price of the trees' credit
    expand(policy, tok, lambda: run.env.episode(index), forest, args, generator)
    trajs = forest.leaves
    caches = list({id(c): c for c, _ in forest.caches.values()}.values())
    ctx.cost.update(branch_rollouts=forest.branch_rollouts, branch_tokens=forest.branch_tokens)
    rewards, p_correct = [], []
    for traj in trajs:
        r, p = pair.turn_rewards(traj, run.reward, ctx, args.outcome_weight)
        rewards.append(r)
        p_correct.append(p)
    a, all_equal = TREE_SEARCH[args.reward](forest)
    t3 = time.perf_counter()
    t["t_rollout"] += t1 - t0
    t["t_reward"] += t3 - t1
    # every turn once: a tree's shared turns count where they were generated
    played = [n.step for n in forest.node_of.values()]
    ctx.cost.update(gen_turns=len(played), gen_tokens=sum(len(st.tokens) for st in played))
    kv_bytes = sum(c.k.nbytes + c.v.nbytes for cache in caches for c in cache)
    return grpo.Group(list(trajs), rewards, p_correct, a, all_equal, kv_bytes)


def tree_defaults(args):
    """The budget of the flags left unset (see the section comment)."""
    G = args.group
    M, N, L = (G // 2, 2, 1) if args.reward == TREE_GRPO else (G // 2, G // 4, 2)
    for name, v in (("tree_m", M), ("tree_n", N), ("tree_l", L)):
        if getattr(args, name) is None:
            setattr(args, name, max(1, v))


# ---------------------------------------------------------------------------------------------
# AT²PO's turn-level objective (pair.update calls it in place of the per-token GRPO loss)
# ---------------------------------------------------------------------------------------------

def turn_loss(logp, logp_old, logp_ref, adv, turn, weight, clip: tuple[float, float],
              beta: float, n_tokens: float, n_seqs: float):
    """AT²PO's turn-level objective (the release's gspo_turn) summed over N policy tokens.

    Turn k of a trajectory has one importance ratio s_k = exp(mean_{t in k}(logp_t - logp_old_t)),
    and every token of the turn carries it with its own gradient: rho_t = sg[s_k] pi_t / sg[pi_t]
    (GSPO's construction, per turn). Per token -min(rho A, clip(rho, 1 - lo, 1 + hi) A), weighted
    by 1 / (policy tokens of its trajectory) and divided by the number of trajectories (a mean
    over each trajectory's tokens, then over trajectories); the KL term is this pipeline's (k3,
    summed and divided by n_tokens). turn (N,) labels each token's turn; weight (N,)."""
    if logp.numel() == 0:
        zero = logp.sum()
        return zero, {"kl": 0.0, "clip": 0.0, "ratio": 0.0, "pg": 0.0}
    d = (logp - logp_old).detach()
    _, k = torch.unique(turn, return_inverse=True)
    n = torch.zeros(int(k.max()) + 1, dtype=d.dtype, device=d.device)
    n.index_add_(0, k, torch.ones_like(d))
    log_s = torch.zeros_like(n).index_add_(0, k, d) / n                    # log s_k per turn
    ratio = torch.exp((log_s[k] + logp - logp.detach()).clamp(max=10.0))   # the release's clamp
    lo, hi = clip
    clipped = torch.clamp(ratio, 1 - lo, 1 + hi)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    dk = logp_ref - logp
    kl = torch.expm1(dk) - dk
    loss = (pg * weight).sum() / n_seqs + beta * kl.sum() / n_tokens
    with torch.no_grad():
        hit = ((ratio < 1 - lo) & (adv < 0)) | ((ratio > 1 + hi) & (adv > 0))
        sums = {"kl": kl.sum().item(), "clip": hit.sum().item(),
                "ratio": ratio.sum().item(), "pg": pg.sum().item()}
    return loss, sums


def judge_step(client: toolbench.ChatClient, messages: list[dict]) -> float:
    """The LLM-as-a-judge step reward in [0, 1]: (score - 1) / 9 for a 1-10 judgment of the last
    message of `messages` (METHOD.md §2 chat: task first, the assistant turn to rate last)."""
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise ValueError("judge_step needs a chat ending with the assistant turn to rate")

    def check(obj):
        s = obj.get("score")
        if type(s) is not int or not 1 <= s <= 10:
            raise ValueError("score must be an integer from 1 to 10")
    history = "\n\n".join(("Agent:\n" if m["role"] == "assistant" else "") + m["content"]
                          for m in messages[1:-1]) or "(no earlier steps)"
    user = (f"Task:\n{messages[0]['content']}\n\nTrajectory so far:\n{history}\n\n"
            f"Latest step to rate:\n{messages[-1]['content']}")
    obj, _ = client.chat_json([{"role": "system", "content": STEP_JUDGE_SYSTEM},
                               {"role": "user", "content": user}], check=check)
    return (obj["score"] - 1) / 9


STEP_JUDGE_SYSTEM = """\
You are an expert evaluator of tool-using AI agents. You see a task (with the agent's tools and
reply format), the agent's trajectory so far, and its latest step. Rate the quality of the latest
step alone, on a scale from 1 to 10:
- 9-10: correct and necessary; it clearly advances the task. Its reasoning is faithful to the
  observations and its tool call and arguments are right (or it is a correct final answer).
- 7-8: correct and useful, with a minor inefficiency or imprecision.
- 5-6: partly useful: plausible but redundant, vague, or weakly justified.
- 3-4: mostly wrong: it misreads an observation, picks a wrong tool or wrong arguments, or
  reasons in a flawed way.
- 1-2: harmful or invalid: invented facts, a contradiction of the observations, a malformed
  action, or a wrong final answer.
Do not reward length or confident tone. Reply with a JSON object only: {"score": <integer 1-10>}"""


# ---------------------------------------------------------------------------------------------
# What lab/train.py's loop reads from here: the rewards, the tree searches' budget and their
# plays, AT²PO's batch and loss, and what they need around the run (the judge's client, the
# lagged teacher); with their flags
# ---------------------------------------------------------------------------------------------

REWARDS = {"coe": pair.Reward(coe_reward, needs_stats=True), "llm_judge": pair.Reward(judge_reward),
           "igpo": pair.Reward(igpo_reward), "tips": pair.Reward(tips_reward),
           # tree search: the leaves' outcome; the advantages come from the trees
           TREE_GRPO: pair.Reward(pair.outcome_reward), AT2PO: pair.Reward(pair.outcome_reward)}


@dataclass
class TurnBatch(pair.Batch):        # pair.Batch with what AT²PO's turn-level loss reads
    turn: torch.Tensor = None       # (B, T) long: a policy token's turn id, -1 elsewhere
    weight: torch.Tensor = None     # (B, T) float32: 1 / its trajectory's policy tokens
    n_seqs: int = 0                 # trajectories with a policy token

    def counts(self) -> dict[str, int]:
        return {**super().counts(), "seqs": self.n_seqs}


def turn_batch(trajs: list[Trajectory], advantages: list[list[float]], pad_id: int) -> TurnBatch:
    """pair.make_batch's batch, with each policy token's turn (one id per (row, turn) in the
    batch) and its weight 1 / (policy tokens of its trajectory)."""
    batch = pair.make_batch(trajs, advantages, pad_id)
    rows, row_of = pair.batch_rows(trajs)
    B, T = batch.ids.shape
    turn = torch.full((B, T), -1, dtype=torch.long)
    weight = torch.zeros(B, T, dtype=torch.float32)
    n_seqs = 0
    for traj in trajs:
        n = sum(len(step.tokens) for step in traj.steps)
        n_seqs += n > 0
        for step in traj.steps:
            r = row_of[id(traj), step.segment]
            s, e = step.span
            turn[r, s:e] = r * T + s
            weight[r, s:e] = 1.0 / n
    return TurnBatch(**vars(batch), turn=turn, weight=weight, n_seqs=n_seqs)


def at2po_loss(logp, logp_old, logp_ref, adv, part: pair.Part, eps: float, beta: float,
               clip: tuple[float, float]):
    """turn_loss on one micro-batch of a TurnBatch (an entry of pair.Objective's loss; eps is
    AT²PO's own `clip`)."""
    turn = part.at_policy_tokens(part.batch.turn).to(logp.device)
    weight = part.at_policy_tokens(part.batch.weight).to(logp.device)
    return turn_loss(logp, logp_old, logp_ref, adv, turn, weight, clip, beta,
                     part.totals["tokens"], part.totals["seqs"])


def at2po_form(args) -> pair.Objective:
    """The update of AT²PO: the process form (its advantages come from the trees) with the
    turn-level loss in place of grpo_loss."""
    return pair.Objective(pair.ADVANTAGES["process"].advantages,
                          partial(at2po_loss, clip=tuple(args.at2po_clip)))


def preset(args, given) -> None:
    """The trees' budget, and the flags a tree search cannot take."""
    if args.reward not in TREE_SEARCH:
        return
    tree_defaults(args)
    for name in ("tree_m", "tree_n", "tree_l"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got "
                             f"{getattr(args, name)}")
    if args.outcome_weight:
        raise SystemExit(f"--outcome-weight: --reward {args.reward} learns from the outcome "
                         "alone already; leave it at 0")
    if args.advantage != "process":
        if "advantage" not in given and args.preset:
            what = f"--preset {args.preset}"
        else:
            what = f"--advantage {args.advantage}"
        raise SystemExit(f"{what}: --reward {args.reward} derives its advantages from its "
                         "trees; leave --advantage at process")


def start(args, ctx: LabContext, log) -> None:
    """What the lab's rewards need before the first step: the judge's client (llm_judge), the
    line that says a tree search replaces the G rollouts."""
    if args.reward == "llm_judge":
        try:
            ctx.judge = toolbench.ChatClient(args.judge_model)
        except toolbench.LLMError as e:
            raise SystemExit(f"--reward llm_judge: {e}") from e
    if args.reward in TREE_SEARCH:
        log(f"tree search instead of the {args.group} rollouts: --tree-m {args.tree_m} "
            f"--tree-n {args.tree_n} --tree-l {args.tree_l} (see lab/methods/baselines.py)", flush=True)


def refresh_teacher(args, ctx: LabContext, policy, step: int) -> None:
    """tips: every --tips-refresh steps the lagged teacher moves to the policy."""
    if args.reward == "tips" and step % args.tips_refresh == 0:
        ctx.lagged = lora_state(policy)


def add_flags(ap) -> None:
    """This module's flags, on the lab's parser."""
    a = ap.add_argument
    a("--judge-model", default="gpt-4o-mini",
      help="llm_judge: model name at the OpenAI-compatible endpoint (OPENAI_BASE_URL, "
           "OPENAI_API_KEY)")
    a("--tips-refresh", type=int, default=10,
      help="tips: steps between refreshes of the lagged teacher (a LoRA snapshot)")
    a("--tips-gamma", type=float, default=1.0, help="tips: discount gamma of the shaping term")
    a("--tree-m", type=int, default=None,
      help="tree_grpo: trees per prompt, each grown from one chain; at2po: chain rollouts under "
           "its one root (default --group / 2)")
    a("--tree-n", type=int, default=None,
      help="tree_grpo: nodes drawn per tree per round, one branch each (default 2); at2po: the "
           "top-K nodes regenerated per round (default --group / 4)")
    a("--tree-l", type=int, default=None,
      help="tree_grpo, at2po: expansion rounds (default 1 for tree_grpo, 2 for at2po)")
    a("--at2po-penalty", type=float, default=0.05,
      help="at2po: branching penalty alpha, score = entropy - alpha x siblings (the release's)")
    a("--at2po-clip", type=float, nargs=2, default=[3e-3, 4e-3], metavar=("LOW", "HIGH"),
      help="at2po: clip range of the turn-level ratio, [1 - LOW, 1 + HIGH] (the release's)")


RANGES = {**{k: grpo.at_least(1) for k in ("tips_refresh", "tree_m", "tree_n", "tree_l")},
          "at2po_penalty": grpo.finite(0.0), "tips_gamma": grpo.finite(),
          "at2po_clip": ((lambda v: 0 <= v < 1), "two numbers in [0, 1)")}
RESUME_KEYS = ("tips_refresh", "tips_gamma", "tree_m", "tree_n", "tree_l", "at2po_penalty",
               "at2po_clip", "judge_model")


def copy_rows(src: list[model.KVCache], src_row: int, dst: list[model.KVCache], dst_row: int,
              n: int):
    """Row dst_row of dst holds the first n slots of row src_row of src, and n tokens: a branch
    of a rollout tree continues from its parent's prefix without prefilling it again (slot =
    position, so the copied keys, RoPE applied, are what a fresh prefill would write)."""
    for s, d in zip(src, dst):
        d.grow(n)
        d.k[dst_row, :, :n] = s.k[src_row, :, :n].to(d.k.device)
        d.v[dst_row, :, :n] = s.v[src_row, :, :n].to(d.v.device)
        d.lengths[dst_row] = n


@contextlib.contextmanager
def lora_swapped(policy, state: dict[str, torch.Tensor]):
    """Run with other adapter weights (the lagged teacher of tips), then put the policy's back."""
    own = lora_state(policy)
    model.load_lora_state(policy, state)
    try:
        yield policy
    finally:
        model.load_lora_state(policy, own)


def lora_state(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.lora_parameters(policy)}
