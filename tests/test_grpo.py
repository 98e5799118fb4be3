"""grpo.py and the lab's loop (lab/train.py) on tiny CPU models: advantages, loss, rollouts,
checkpoints, processes, every reward. A run of the core goes through grpo.main; a run of a lab
reward or flag through lab.train.main, which is what `python -m lab.train` runs."""
import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

import envs
import grpo
import model as mdl
import pair
import probes
from lab import compare, curves, shop, study
from lab import train as lab_train
from lab.infra import runs
from lab.methods import baselines, onpolicy
from lab.policies import adapters, sft
from lab.probing import traces
from lab.worlds import released as lab_data

ROOT = Path(__file__).resolve().parents[1]
CORE_REWARDS = {"outcome", "pair", *probes.FEATURES}
TIMING = set(lab_train.TIMING)          # the core's phases and the lab's (a superset)
BUILTIN = ROOT / "data" / "shop-policy"


# ---------------------------------------------------------------------------------------------
# fixtures: a tiny random policy with a BPE tokenizer trained on shop text

@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("policy")
    torch.manual_seed(0)
    dialogs = shop.sft_dialogs(10, 0.3, seed=1)
    tok = mdl.Tokenizer(sft.train_tokenizer([sft.chat_text(m) for m in dialogs], 300))
    shape = argparse.Namespace(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2)
    config = sft.sft_config(shape, tok)
    policy = mdl.Transformer(mdl.Config.from_dict(config))
    with torch.no_grad():        # opinionated random weights: varied rollouts, real gradients
        for p in policy.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    sft.save_policy(out, policy, tok, config)
    return out


@pytest.fixture(scope="session")
def pair_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("pair-cache")


@pytest.fixture(autouse=True)
def _cache(pair_cache, monkeypatch):
    monkeypatch.setenv("PAIR_CACHE", str(pair_cache))     # probes fitted on the fly go here


def flags(policy, out, reward="coe", **kw) -> list[str]:
    """A short run's command line for the lab (lab.train.main, `python -m lab.train`)."""
    opts = {"model": policy, "reward": reward, "out": out, "steps": 2, "group": 2,
            "max_turns": 2, "max_new_tokens": 8, "lr": 1e-2, "save_every": 1,
            "probe_episodes": 10, "seed": 3, "threads": 1,
            # a random policy's own turns are all wrong: its probes come from the gold corpus
            "probe_corpus": "contaminated", "corpus_samples": 2, "corpus_heldout": 2, **kw}
    return argv_of(opts, "eval_episodes" in kw)


def core_flags(policy, out, reward="outcome", **kw) -> list[str]:
    """A short run's command line for the core alone (grpo.main, `python grpo.py`): flags()'s
    settings less the lab's flags."""
    opts = {"model": policy, "reward": reward, "out": out, "steps": 2, "group": 2,
            "max_turns": 2, "max_new_tokens": 8, "lr": 1e-2, "save_every": 1, "seed": 3,
            "threads": 1, **kw}
    return argv_of(opts, "eval_episodes" in kw)


def argv_of(opts: dict, evaluated: bool) -> list[str]:
    """--flag value for each option (True: the flag alone; None or False: left out); without
    --eval-episodes the run skips its evaluations, with it validation takes 2 episodes."""
    if evaluated:
        opts.setdefault("val_episodes", 2)
    argv = []
    for k, v in opts.items():
        if v is True:
            argv.append(f"--{k.replace('_', '-')}")
        elif v is not None and v is not False:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv + (["--no-eval"] if not evaluated else [])


def run(argv) -> dict:
    """A run of the lab's loop, in this process."""
    return lab_train.main(argv)


def core_run(argv) -> dict:
    """A run of the core's loop, in this process."""
    return grpo.main(argv)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING and k != "t_refit"} for r in records]


def play_args(**kw):
    return argparse.Namespace(**{"max_turns": 3, "max_new_tokens": 8, "max_len": 4096,
                                 "temperature": 1.0, "top_p": 1.0, **kw})


def lora_policy(model_dir, flags: list[str]):
    """The policy with its LoRA adapter, the parsed flags (preset filled) and the shop train env."""
    policy, tok = mdl.load_model(model_dir)
    args = lab_train.parser().parse_args([*flags, "--model", str(model_dir)])
    grpo.resolve_preset(args, pair.Processes(), lab_train.WORLDS)
    mdl.apply_lora(policy, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                   targets=tuple(args.lora_targets.split(",")))
    return policy, tok, args, envs.ShopEnv("train")


# ---------------------------------------------------------------------------------------------
# advantages (METHOD.md §9), hand-worked

def test_advantages_dense_steps():
    # pooled r = [1, 0, 0.5]: mean 0.5, population std sqrt(1/6)
    adv, zero = pair.group_advantages([[1.0, 0.0], [0.5]])
    s = 0.5 / (math.sqrt(1 / 6) + 1e-6)
    assert not zero
    # turn 1 of rollout 0: r^_1 + r^_2 = s - s; turn 2: -s; rollout 1: 0
    assert adv[0] == pytest.approx([0.0, -s], abs=1e-12)
    assert adv[1] == pytest.approx([0.0], abs=1e-12)


def test_advantages_outcome_is_group_normalized_outcome_on_every_turn():
    rewards = [[None, None, 1.0], [None, 0.0], [1.0], [None, None, None, 0.0]]
    adv, zero = pair.group_advantages(rewards)
    s = 0.5 / (0.5 + 1e-6)          # outcomes [1, 0, 1, 0]: mean 0.5, std 0.5
    assert not zero
    assert adv == [pytest.approx([s] * 3), pytest.approx([-s] * 2), pytest.approx([s]),
                   pytest.approx([-s] * 4)]


def test_advantages_all_equal_group_is_zero_and_flagged():
    for rewards in ([[0.3, 0.3], [0.3]], [[None, 1.0], [1.0]], [[0.1 + 0.2, 0.3]]):
        adv, zero = pair.group_advantages(rewards)
        assert zero and adv == [[0.0] * len(r) for r in rewards]
    assert pair.group_advantages([[0.3, 0.3], [0.3000001]])[1] is False


@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--temperature", "1e-40"),
                                         ("--lr", "nan"),
                                         ("--group", "0"), ("--save-every", "0"),
                                         ("--steps", "-1"), ("--eval-episodes", "-5"),
                                         ("--top-p", "0"), ("--beta", "inf"),
                                         ("--at2po-clip", "0.1 -1"),
                                         ("--seed", str(2 ** 32)), ("--threads", "100000")])
def test_numeric_flags_are_checked_before_any_work(flag, value, tmp_path, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr(mdl, "load_model", no_load)
    # a flag of the core by the core's command line, a flag of the lab by the lab's
    loop = lab_train if flag == "--at2po-clip" else grpo
    with pytest.raises(SystemExit):
        loop.main([flag, *value.split(), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert err.startswith(f"{loop.PROG}: error: {flag} must be") and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flag, value", [("--devices", "foo"), ("--devices", ""),
                                         ("--devices", "meta"), ("--lora-targets", "bogus_proj"),
                                         ("--lora-targets", "q_proj,,v_proj")])
def test_device_and_adapter_flags_are_checked_before_any_work(flag, value, tmp_path,
                                                              monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr(mdl, "load_model", no_load)
    with pytest.raises(SystemExit):
        grpo.main([flag, value, "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert f"{flag} {value!r}:" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


def test_a_bad_flag_is_one_line_without_the_usage(capsys):
    # the usage block is --help's; the error says what is wrong, in one line, and where a choice
    # or a flag is the lab's, where to find it
    for loop, argv, message in (
            (grpo, ["--steps", "0"], "--steps must be at least 1, got 0"),
            (grpo, ["--reward", "igpo"], "argument --reward: invalid choice"),
            (lab_train, ["--tree-l", "0"], "--tree-l must be at least 1, got 0"),
            (lab_train, ["--bogus"], "unrecognized arguments: --bogus")):
        with pytest.raises(SystemExit) as stop:
            loop.main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and "usage" not in err, err
        assert err.startswith(f"{loop.PROG}: error: {message}"), err
        assert err.endswith(" (--help lists the flags)\n"), err
        assert ("run through `python -m lab.train`" in err) == (argv[0] == "--reward"), err
    # and so on the command line
    r = subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--steps", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "python grpo.py: error: --steps must be at least 1, got 0 (--help lists the flags)"], \
        r.stderr


def test_release_advantages_hand_worked():
    # rollout 0: r = [0.2, 0.8], total 1.0, own mean 0.5; rollout 1: r = [0.4], total 0.4;
    # rollout 2: r = [None, 0.1, 0.7] -> [0, 0.1, 0.7], total 0.8, own mean 0.8 / 3
    rewards = [[0.2, 0.8], [0.4], [None, 0.1, 0.7]]
    adv, zero = pair.release_advantages(rewards)
    totals = [1.0, 0.4, 0.8]
    mean = sum(totals) / 3
    std = math.sqrt(sum((t - mean) ** 2 for t in totals) / 3)       # population std
    z = [(t - mean) / std for t in totals]
    assert not zero
    assert adv[0] == pytest.approx([0.2 - 0.5 + z[0], 0.8 - 0.5 + z[0]], abs=1e-12)
    assert adv[1] == pytest.approx([0.4 - 0.4 + z[1]], abs=1e-12)
    assert adv[2] == pytest.approx([r - 0.8 / 3 + z[2] for r in (0.0, 0.1, 0.7)], abs=1e-12)
    # equal totals: only centered (no division by a zero std); every reward equal: no advantage
    adv, zero = pair.release_advantages([[0.5, 0.1], [0.6]])
    assert not zero and adv == [pytest.approx([0.2, -0.2]), pytest.approx([0.0])]
    assert pair.release_advantages([[0.3, 0.3], [0.3, 0.3]]) == ([[0.0, 0.0], [0.0, 0.0]], True)
    # equal totals but rewards that differ within a rollout: the turns still move
    assert pair.release_advantages([[1.0, 0.0], [0.0, 1.0]]) == \
        ([[0.5, -0.5], [-0.5, 0.5]], False)
    # a group of one rollout is left as it is (the release normalizes groups of two or more)
    assert pair.release_advantages([[0.2, None, 0.8]]) == ([[0.2, 0.0, 0.8]], False)


def test_release_loss_is_the_release_reinforce_step():
    """At one epoch (logp_old = logp, detached) the gradient of release_loss equals the
    release's per-turn REINFORCE:
    -(1/n) sum_turns (A mean grad logp - beta mean grad(logp - ref))."""
    g = torch.Generator().manual_seed(1)
    turns = [3, 1, 4]                                    # tokens per turn
    A = torch.tensor([0.7, -1.2, 0.3], dtype=torch.float64)
    beta, eps = 0.05, 0.2
    theta = torch.randn(sum(turns), dtype=torch.float64, generator=g, requires_grad=True)
    ref = torch.randn(sum(turns), dtype=torch.float64, generator=g)
    logp = torch.nn.functional.logsigmoid(theta)         # any differentiable log-probabilities
    adv = torch.cat([a.repeat(n) for a, n in zip(A, turns)])
    w = torch.cat([torch.full((n,), 1.0 / n, dtype=torch.float64) for n in turns])
    loss, _ = pair.release_loss(logp, logp.detach(), ref, adv, w, eps, beta, len(turns))
    (ours,) = torch.autograd.grad(loss, theta)
    logp = torch.nn.functional.logsigmoid(theta)
    theirs, at = 0.0, 0
    for a, n in zip(A, turns):                          # the release's loop over turns
        mean_lp, kl = logp[at:at + n].mean(), (logp[at:at + n] - ref[at:at + n]).mean()
        theirs = theirs - (a * mean_lp - beta * kl) / len(turns)
        at += n
    (expected,) = torch.autograd.grad(theirs, theta)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-14)


def test_release_advantage_trains_and_is_refused_with_tree_search(tiny_policy, tmp_path,
                                                                  monkeypatch):
    temperatures = []

    def token_logprobs(policy, ids, mask, temperature=1.0):
        temperatures.append(temperature)
        return logprobs(policy, ids, mask, temperature)
    logprobs = mdl.token_logprobs
    monkeypatch.setattr(mdl, "token_logprobs", token_logprobs)
    summary = run(flags(tiny_policy, tmp_path / "r", advantage="release", eval_episodes=3,
                        temperature=0.7))
    assert summary["selected"] is not None
    # the release's log pi is the model's own distribution, whatever the sampling temperature
    assert temperatures and set(temperatures) == {1.0}
    recs = metrics(tmp_path / "r")
    assert len(recs) == 2 and all(math.isfinite(r["loss"]) and r["tokens"] > 0 for r in recs)
    with pytest.raises(SystemExit, match="--advantage release"):
        run(flags(tiny_policy, tmp_path / "t", reward="tree_grpo", advantage="release"))


# ---------------------------------------------------------------------------------------------
# the loss (METHOD.md §9) against a direct re-computation, gradient included

def test_loss_and_gradient_match_direct_computation():
    g = torch.Generator().manual_seed(0)
    N, eps, beta, n_tokens = 64, 0.2, 0.05, 80.0      # n_tokens: the whole batch, not this part
    logp = (torch.randn(N, generator=g, dtype=torch.float64) - 2).requires_grad_()
    logp_old = logp.detach() + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    logp_ref = logp.detach() + 0.2 * torch.randn(N, generator=g, dtype=torch.float64)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    loss, sums = pair.grpo_loss(logp, logp_old, logp_ref, adv, eps, beta, n_tokens)
    loss.backward()

    total, grad, clipped, kl = 0.0, [], 0, 0.0
    for lp, lo, lr, a in zip(logp.tolist(), logp_old.tolist(), logp_ref.tolist(), adv.tolist()):
        rho = math.exp(lp - lo)
        # PPO's case analysis: the clipped branch is the minimum exactly when rho left the
        # trust region in the direction A favours; there the token has no gradient
        active = (a >= 0 and rho > 1 + eps) or (a < 0 and rho < 1 - eps)
        surrogate = (1 + eps if a >= 0 else 1 - eps) * a if active else rho * a
        k3 = math.exp(lr - lp) - (lr - lp) - 1
        total += -surrogate + beta * k3
        grad.append(((0.0 if active else -rho * a) + beta * (1 - math.exp(lr - lp))) / n_tokens)
        clipped += active
        kl += k3
    assert loss.item() == pytest.approx(total / n_tokens, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=torch.float64))
    assert 0 < clipped < N and sums["clip"] == clipped
    assert sums["kl"] == pytest.approx(kl, rel=1e-9)


def test_token_logprobs_equal_full_log_softmax(tiny_policy):
    policy, _ = mdl.load_model(tiny_policy)
    ids = torch.randint(0, policy.config.vocab_size, (2, 12), generator=torch.Generator()
                        .manual_seed(1))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 3:7] = mask[1, 5:12] = True
    full = torch.log_softmax(policy(ids) / 0.7, -1)             # (B, T, V)
    direct = torch.cat([full[b, j - 1, ids[b, j]][None] for b in range(2) for j in range(12)
                        if mask[b, j]])
    torch.testing.assert_close(mdl.token_logprobs(policy, ids, mask, 0.7), direct)


# ---------------------------------------------------------------------------------------------
# rollouts: one KV cache per group across turns, statistics from the generation pass

def test_rollout_appends_turns_to_one_cache_and_traces_equal_teacher_forcing(tiny_policy):
    policy, tok = mdl.load_model(tiny_policy)
    env = envs.ShopEnv("train")
    episodes = [env.episode(5), env.episode(5), env.episode(6)]
    prompts = [tok.render(ep.messages, add_generation_prompt=True)[0] for ep in episodes]
    trajs = probes.rollout(policy, tok, episodes, play_args(),
                           generator=torch.Generator().manual_seed(0))
    assert max(len(t.steps) for t in trajs) > 1
    for traj, prompt in zip(trajs, prompts):
        (seq,) = traj.segments
        assert seq[:len(prompt)] == prompt
        pos = len(prompt)
        for k, step in enumerate(traj.steps):
            s, e = step.span
            assert (s, e) == (pos, pos + len(step.tokens)) and seq[s:e] == step.tokens
            pos = e
            if k + 1 < len(traj.steps):     # exactly the chat template's tokens in between
                opening = probes.turn_opening(tok, step.trace.finished, step.observation)
                assert seq[e:e + len(opening)] == opening
                pos += len(opening)
            # the reward's statistics came from generation; teacher forcing gives the same
            tf = traces.trace_forward(policy, seq[:e], (s, e))
            torch.testing.assert_close(step.trace.h_last, tf.h_last, atol=1e-4, rtol=1e-4)
            for name in mdl.STATS:
                torch.testing.assert_close(step.trace.attn_stats[name], tf.attn_stats[name], atol=1e-4,
                                           rtol=1e-4)
        assert pos == len(seq)
        assert traj.score == traj.episode.score()


def test_rollout_survives_a_reply_with_a_lone_surrogate_escape(tiny_policy, monkeypatch):
    # Plain ASCII from the policy whose JSON escape decodes to half a UTF-16 pair: the episode gets
    # an error observation and the rollout goes on.
    policy, tok = mdl.load_model(tiny_policy)
    hostile = 'Thought: x\nAction: Lookup\nAction Input: {"store": "\\ud800", "item": "tea"}'
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: hostile)
    episodes = [envs.ShopEnv("train").episode(0)]
    (traj,) = probes.rollout(policy, tok, episodes, play_args(max_turns=2),
                             generator=torch.Generator().manual_seed(0))
    assert len(traj.steps) == 2 and traj.steps[0].observation.startswith("Observation: Invalid")


class RewritingEpisode(envs.Episode):
    """ToolBench's history cap in miniature: after the second turn the first observation is
    rewritten in place (StepResult.rewritten_from = 2). Every turn is a valid Calculator call,
    whatever the model writes; the score is `fixed`, or the number of turns when None."""
    fixed: float | None = None

    def call_tool(self, name, arguments):
        return "x" * 50

    def _after_observation(self):
        if len(self.steps) == 2:
            self.messages[2]["content"] = "Observation: [elided]"
            return 2
        return None

    def score(self):
        return float(len(self.steps)) if self.fixed is None else self.fixed


def rewriting_episode(score: float | None) -> RewritingEpisode:
    ep = RewritingEpisode("r", "Add 1 and 2.", envs.SHOP_TOOLS)
    ep.fixed = score
    ep.step = lambda text, step=ep.step: step(
        'Action: Calculator\nAction Input: {"expression": "1+2"}')
    return ep


def test_rollout_refills_the_cache_when_the_environment_rewrites_history(tiny_policy):
    # ToolBench's history cap rewrites old observations in place (StepResult.rewritten_from)
    policy, tok = mdl.load_model(tiny_policy)

    def episode():
        return rewriting_episode(score=0.0)
    (traj,) = probes.rollout(policy, tok, [episode()], play_args(max_turns=3),
                             generator=torch.Generator().manual_seed(0))
    assert len(traj.segments) == 2 and [s.segment for s in traj.steps] == [0, 0, 1]
    first, second = traj.segments
    assert tok.decode(second).count("[elided]") == 1 and "[elided]" not in tok.decode(first)
    last = traj.steps[-1]
    tf = traces.trace_forward(policy, second[:last.span[1]], last.span)
    torch.testing.assert_close(last.trace.h_last, tf.h_last, atol=1e-4, rtol=1e-4)
    batch = pair.make_batch([traj], [[1.0, 2.0, 3.0]], tok.pad_id)
    assert batch.ids.shape[0] == 2 and batch.mask.sum() == sum(len(s.tokens) for s in traj.steps)
    assert batch.adv[1][batch.mask[1]].unique().tolist() == [3.0]


def test_the_judge_rates_each_turn_in_the_history_it_was_taken_in(tiny_policy, monkeypatch):
    # the third turn's rollout elides the first observation; the judge of the second turn must
    # still see it, as the policy did when it took that turn
    policy, tok = mdl.load_model(tiny_policy)
    (traj,) = probes.rollout(policy, tok, [rewriting_episode(score=0.0)], play_args(max_turns=3),
                             generator=torch.Generator().manual_seed(0))
    assert traj.episode.messages[2]["content"] == "Observation: [elided]"
    rated = []
    monkeypatch.setattr(baselines, "judge_step",
                        lambda client, messages: rated.append(messages) or 0.5)
    ctx = baselines.LabContext(policy, tok, args=play_args(), judge=object())
    assert baselines.judge_reward(traj, ctx).rewards == [0.5] * 3
    assert [len(m) for m in rated] == [2, 4, 6]      # the task, then turns and observations
    assert all(m[-1]["role"] == "assistant" for m in rated)
    assert [m[2]["content"] for m in rated[1:]] == [traj.steps[0].observation,
                                                    "Observation: [elided]"]
    assert "[elided]" not in traj.steps[0].observation


def test_batch_masks_exactly_the_generated_tokens_eos_included():
    ep = envs.ShopEnv("train").episode(0)
    traj = probes.Trajectory(ep, segments=[[7, 7, 7, 1, 2, 99, 7, 7, 3, 99, 7]])
    for (s, e) in ((3, 6), (8, 10)):
        traj.steps.append(probes.Step(traj.segments[0][s:e], 0, (s, e), "", None, None))
    batch = pair.make_batch([traj], [[0.5, -1.0]], pad_id=0)
    assert batch.mask[0].tolist() == [False] * 3 + [True] * 3 + [False] * 2 + [True] * 2 + [False]
    assert batch.adv[0].tolist() == [0, 0, 0, .5, .5, .5, 0, 0, -1, -1, 0]


# ---------------------------------------------------------------------------------------------
# the update: KL = 0 and rho = 1 before the first step, then the adapter moves

def test_first_update_has_zero_kl_and_unit_ratio(tiny_policy):
    # dropout 0: dropout noise alone would give KL > 0 even with pi_ref = the policy itself
    policy, tok, args, env = lora_policy(tiny_policy, ["--lr", "1e-2", "--micro-batch", "1",
                                                       "--lora-dropout", "0"])
    trajs = probes.rollout(policy, tok, [env.episode(1) for _ in range(3)], play_args(),
                           generator=torch.Generator().manual_seed(0))
    adv = [[float(i + t) for t in range(len(tr.steps))] for i, tr in enumerate(trajs)]
    batch = pair.make_batch(trajs, adv, tok.pad_id)
    opt = torch.optim.AdamW([p for _, p in mdl.lora_parameters(policy)], lr=1e-2)
    # the run's update (grpo.update_policy) on a run of this policy, optimizer and flags
    run = argparse.Namespace(policy=policy, optimizer=opt, objective=pair.ADVANTAGES["process"],
                             args=args, procs=pair.Processes())
    stats = grpo.update_policy(run, batch)
    assert stats["kl"] == 0.0 and stats["ratio"] == 1.0 and stats["clip_frac"] == 0.0
    n = batch.mask.sum().item()
    # rho = 1 and KL = 0: the loss is minus the token-averaged advantage
    assert stats["loss"] == pytest.approx(-batch.adv[batch.mask].sum().item() / n, rel=1e-5)
    assert stats["tokens"] == n and stats["grad_norm"] > 0
    # the adapter has moved: the KL is against the same model with the adapter disabled
    with torch.no_grad():
        logp = mdl.token_logprobs(policy, batch.ids, batch.mask, args.temperature)
        with mdl.lora_disabled(policy):
            logp_ref = mdl.token_logprobs(policy, batch.ids, batch.mask, args.temperature)
    kl = (torch.expm1(logp_ref - logp) - (logp_ref - logp)).mean().item()
    again = grpo.update_policy(run, batch)
    assert kl > 1e-6 and again["kl"] == pytest.approx(kl, rel=1e-3)
    assert again["ratio"] == pytest.approx(1.0)                          # new pi_old, new ratio


def test_a_batch_without_generated_tokens_logs_loss_0_and_is_counted(tiny_policy, tmp_path,
                                                                     monkeypatch):
    # every rollout ends before its first turn (each prompt is longer than a max_len of 20,
    # which grpo.py would refuse up front): nothing is generated, nothing is learned
    real = probes.rollout

    def no_room(policy, tok, episodes, args, **kw):
        return real(policy, tok, episodes, argparse.Namespace(**{**vars(args), "max_len": 20}),
                    **kw)
    monkeypatch.setattr(probes, "rollout", no_room)
    out = tmp_path / "empty"
    core_run(core_flags(tiny_policy, out, "outcome", steps=2, save_every=2))
    lines = (out / "metrics.jsonl").read_text().splitlines()

    def no_nan(name):
        raise AssertionError(f"{name} in metrics.jsonl")
    recs = [json.loads(line, parse_constant=no_nan) for line in lines]
    assert [(r["loss"], r["tokens"], r["empty_batch"], r["grad_norm"]) for r in recs] == \
        [(0.0, 0, 1, 0.0)] * 2
    policy, _ = mdl.load_model(tiny_policy)
    adapter = adapters.load_adapter(policy, out / "checkpoint-000002" / "adapter")
    lora_b = [p for n, p in mdl.lora_parameters(adapter) if ".lora_B." in n]
    assert lora_b and all(p.abs().sum() == 0 for p in lora_b)     # B starts at zero, stays there


def test_a_non_finite_gradient_skips_the_update_and_says_so(tiny_policy, tmp_path, monkeypatch,
                                                            capsys):
    # a NaN that reaches the gradient (here through the advantages) must not reach the adapter:
    # AdamW would turn every weight it touches into NaN
    def nan_advantages(rewards):
        return [[math.nan] * len(row) for row in rewards], False
    monkeypatch.setattr(pair, "group_advantages", nan_advantages)    # --advantage process's
    out = tmp_path / "nan"
    core_run(core_flags(tiny_policy, out, "outcome", steps=1))
    recs = metrics(out)
    assert [(r["skipped_updates"], r["tokens"] > 0) for r in recs] == [(1, True)]
    assert "step 1: the gradient was not finite" in capsys.readouterr().out
    policy, _ = mdl.load_model(tiny_policy)
    adapter = adapters.load_adapter(policy, out / "checkpoint-000001" / "adapter")
    lora_b = [p for n, p in mdl.lora_parameters(adapter) if ".lora_B." in n]
    assert lora_b and all(p.abs().sum() == 0 for p in lora_b)


# ---------------------------------------------------------------------------------------------
# checkpoints and --resume

def interrupted_run(monkeypatch, argv, loop=lab_train, at: int = 3):
    """A run of `loop` (lab_train, or grpo: the core's) interrupted (KeyboardInterrupt) as its
    step `at` starts."""
    real = loop.train_step

    def crash_at_step(step, *a, **k):
        if step == at - 1:
            raise KeyboardInterrupt
        return real(step, *a, **k)
    monkeypatch.setattr(loop, "train_step", crash_at_step)
    with pytest.raises(SystemExit) as stop:             # Ctrl-C: one line, how to resume
        loop.main(argv)
    monkeypatch.setattr(loop, "train_step", real)
    out = Path(argv[argv.index("--out") + 1])
    assert out.resolve() not in grpo.LOCKS and not (out / ".lock").exists()    # let go
    message = str(stop.value.code)
    assert message.count("\n") == 1 and f"{loop.PROG} " in message and "--resume" in message
    return message


def test_ctrl_c_says_how_to_resume_and_that_command_resumes(tiny_policy, tmp_path, monkeypatch):
    out = tmp_path / "r"
    message = interrupted_run(monkeypatch, flags(tiny_policy, out, steps=3, save_every=1))
    again = shlex.split(message.split(f"{lab_train.PROG} ", 1)[1])
    assert again[again.index("--out") + 1] == str(out) and again[-1] == "--resume"
    run(again)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_ctrl_c_before_the_first_checkpoint_says_the_run_starts_over(tiny_policy, tmp_path,
                                                                     monkeypatch):
    out = tmp_path / "r"
    message = interrupted_run(monkeypatch, flags(tiny_policy, out, steps=3, save_every=3))
    assert "before the first checkpoint (after step 3)" in message and \
        "starts the run over from step 1" in message and "exactly" not in message, message
    run(shlex.split(message.split(f"{lab_train.PROG} ", 1)[1]))
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    # before the run directory was written: a plain restart, nothing to resume
    monkeypatch.setattr(lab_train, "setup", lambda args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit, match="interrupted before the run started; start it with: "
                                         f"{lab_train.PROG} ") as stop:
        run(flags(tiny_policy, tmp_path / "s"))
    assert "--resume" not in str(stop.value.code)


def test_resume_refuses_checkpoints_without_trainer_json(tiny_policy, tmp_path, monkeypatch):
    out = tmp_path / "r"
    run(flags(tiny_policy, out, steps=1))
    (out / "checkpoint-000001" / "trainer.json").unlink()       # cut short, or damaged
    with pytest.raises(SystemExit, match="logged 1 steps but holds no checkpoint whole"):
        run(flags(tiny_policy, out, steps=1, resume=True))


def test_bad_devices_and_a_missing_judge_key_are_one_line(tiny_policy, tmp_path, monkeypatch,
                                                          capsys):
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            grpo.main(["--devices", "cuda:0,cuda:1", "--out", str(tmp_path / "a")])
        assert "--devices cuda:0,cuda:1: this PyTorch sees no CUDA" in capsys.readouterr().err
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="^error: OPENAI_API_KEY is not set"):   # the lab's env
        run(["--env", "toolbench", "--reward", "outcome", "--out", str(tmp_path / "b")])


def test_resume_reproduces_the_uninterrupted_run(tiny_policy, tmp_path, monkeypatch):
    kw = dict(steps=4, save_every=2, lora_dropout=0.05)
    whole = tmp_path / "whole"
    run(flags(tiny_policy, whole, **kw))

    cut = tmp_path / "cut"
    interrupted_run(monkeypatch, flags(tiny_policy, cut, **kw))
    with pytest.raises(SystemExit, match="--out .* already holds a run"):
        run(flags(tiny_policy, cut, **kw))
    with pytest.raises(SystemExit, match="--lr"):
        run(flags(tiny_policy, cut, resume=True, **dict(kw, lr=0.5)))
    run(flags(tiny_policy, cut, resume=True, **kw))

    assert without_timing(metrics(cut)) == without_timing(metrics(whole))
    assert len(metrics(whole)) == 4 and metrics(whole)[-1]["kl"] > 0
    # each segment of a run records the code it ran: the resumed one from step 2 on
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or None
    segments = json.loads((cut / "code.json").read_text())
    assert [x["from_step"] for x in segments] == [0, 2]
    assert [x["from_step"] for x in json.loads((whole / "code.json").read_text())] == [0]
    assert all(x["commit"] == head and x["clean"] in (True, False, None) for x in segments)
    ckpt = cut / "checkpoint-000004"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "adapter", "manifest.json", "optimizer.safetensors", "rng-0.json", "rng-0.safetensors",
        "trainer.json"]
    assert grpo.damage(ckpt) is None                    # every file the manifest lists, intact
    assert sorted(p.name for p in (ckpt / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    assert not list(cut.glob(".*tmp*"))
    a = adapters.load_adapter(mdl.load_model(tiny_policy)[0],
                              whole / "checkpoint-000004" / "adapter")
    b = adapters.load_adapter(mdl.load_model(tiny_policy)[0], ckpt / "adapter")
    for (name, p), (_, q) in zip(mdl.lora_parameters(a), mdl.lora_parameters(b)):
        assert torch.equal(p, q), name


def test_resume_with_only_out_takes_the_runs_flags_and_continues_exactly(tiny_policy, tmp_path,
                                                                         monkeypatch):
    # the run's args.json holds its flags: `python grpo.py --resume --out RUN` needs no other
    dims = {"d": 32, "L": 2, "H": 4}        # tiny_policy's; a PAIR reward: something to learn
    head = fake_pair(tmp_path / "pair", 32, 4 * 2 * 4, dims=dims,
                     model_sha256=mdl.checkpoint_sha256(tiny_policy))
    kw = dict(reward="pair", probes=head, steps=2, eval_episodes=4, val_episodes=2,
              save_every=1, seed=7)
    whole = tmp_path / "whole"
    core_run(core_flags(tiny_policy, whole, **kw))
    cut = tmp_path / "cut"
    interrupted_run(monkeypatch, core_flags(tiny_policy, cut, **kw), loop=grpo, at=2)
    assert [r["step"] for r in metrics(cut)] == [1]
    # a flag given that differs from the run's is still refused, before anything is written
    with pytest.raises(SystemExit, match=re.escape(f"--resume: --seed is 8 but the run in {cut} "
                                                   "used 7")):
        core_run(["--resume", "--out", str(cut), "--seed", "8"])
    assert [r["step"] for r in metrics(cut)] == [1]
    # one thread, as --threads 1 gave the runs above (not a flag a resumed run keeps)
    r = subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--resume", "--out", str(cut)],
                       cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {cut / 'checkpoint-000001'} at step 1" in r.stdout

    def evals(out):
        return [(e["step"], e["val"]["scores"], e["test"]["scores"])
                for e in grpo.read_jsonl(out / "eval.jsonl")]
    assert len(metrics(whole)) == 2 and metrics(whole)[-1]["kl"] > 0
    assert without_timing(metrics(cut)) == without_timing(metrics(whole))
    assert evals(cut) == evals(whole) and [s for s, _, _ in evals(cut)] == [0, 1, 2]


def test_resume_checks_args_json(tiny_policy, tmp_path):
    def prepare(out, **kw):
        args = lab_train.parser().parse_args(flags(tiny_policy, out, **kw))
        grpo.resolve_preset(args, pair.Processes(), lab_train.WORLDS)
        return lab_train.prepare_out(args, pair.Processes())

    out = tmp_path / "run"
    prepare(out, eval_episodes=4)
    (out / "checkpoint-000001").mkdir()
    (out / "checkpoint-000001" / "trainer.json").write_text('{"step": 1}')
    with pytest.raises(SystemExit, match="--eval-episodes is 6 but the run .* used 4"):
        prepare(out, resume=True, eval_episodes=6)
    (out / "args.json").write_text('{"lr": 0.1')
    with pytest.raises(SystemExit, match="args.json is not readable"):
        prepare(out, resume=True, eval_episodes=4)
    (out / "args.json").unlink()            # any flag could change under the checkpoint
    with pytest.raises(SystemExit, match="no args.json"):
        prepare(out, resume=True, eval_episodes=4, lr=0.5)


def test_a_bad_model_is_a_one_line_error_and_writes_nothing(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="error: .*no-model: no such directory"):
        run(flags(tmp_path / "no-model", tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    r = subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--model", "no-model"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        "error: no-model: no such directory (nor a Hub model name like "
        "Qwen/Qwen2.5-7B-Instruct)"], r.stderr
    assert not (tmp_path / "runs").exists()          # where the run would have gone
    # shaped like a Hub name, but data/ is a local directory: a path, never fetched
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PAIR_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit, match=r"error: data/nonexistent: no such directory \(data/ "
                                         "is a local directory"):
        run(flags("data/nonexistent", tmp_path / "b"))
    assert not (tmp_path / "b").exists() and not (tmp_path / "cache").exists()


def test_out_and_resume_checks_read_what_a_run_left(tiny_policy, tmp_path):
    def checked(out, *argv):
        args = lab_train.parse_args(["--model", str(tiny_policy), "--out", str(out), *argv])
        grpo.resolve_preset(args, pair.Processes(), lab_train.WORLDS)
        grpo.check_out(args, lab_train.RESUME_KEYS, lab_train.RESUME_DEFAULTS)
        return args
    # a run killed after its base evaluation, before step 1: a new one would take its step 0
    out = tmp_path / "killed"
    out.mkdir()
    grpo.append_jsonl(out / "eval.jsonl", {"step": 0})
    with pytest.raises(SystemExit, match="already holds a run: pass --resume"):
        checked(out)
    # what trains a run cannot change under a resume, nor what scores it
    grpo.write_json(out / "args.json", vars(checked(tmp_path / "new")))
    for flag, value in (("--grad-clip", "0.1"), ("--weight-decay", "0.1"),
                        ("--dtype", "bfloat16"), ("--judge-model", "x")):
        with pytest.raises(SystemExit, match=f"--resume: {flag} is"):
            checked(out, "--resume", flag, value)
    args = checked(out, "--resume", "--threads", "1", "--eval-batch", "7")    # where it runs: free
    # logged past the step of its first checkpoint, or finished, but no checkpoint: they were
    # deleted (as results/ keeps none), and starting over would replace the logs
    first = min(args.save_every, args.steps)
    for step in range(1, first + 1):
        grpo.append_jsonl(out / "metrics.jsonl", {"step": step})
    checked(out, "--resume")            # killed before its first checkpoint was whole: redone
    (out / "summary.json").write_text("{}")
    with pytest.raises(SystemExit, match=f"logged {first} steps but holds no checkpoint"):
        checked(out, "--resume")
    (out / "summary.json").unlink()
    grpo.append_jsonl(out / "metrics.jsonl", {"step": first + 1})
    with pytest.raises(SystemExit, match=f"logged {first + 1} steps but holds no checkpoint"):
        checked(out, "--resume")
    (out / "checkpoint-000001").mkdir()
    (out / "checkpoint-000001" / "trainer.json").write_text('{"step": 1}')
    checked(out, "--resume")


def test_the_probe_cache_keys_a_sharded_policy_and_where_it_runs(tiny_policy, tmp_path):
    from safetensors.torch import load_file, save_file
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_policy, sharded)
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file)
    grpo.write_json(sharded / "model.safetensors.index.json", {"weight_map": {
        n: file for file, part in halves.items() for n in part}})
    assert runs.policy_hash(sharded) != runs.policy_hash(tiny_policy)
    mdl.load_model(sharded)                                 # a policy the run can load
    args = lab_train.parse_args(["--model", str(tiny_policy)])
    grpo.resolve_preset(args, pair.Processes(), lab_train.WORLDS)
    keys = {runs.settings_hash(onpolicy.own_turns_settings(args))}
    for name, value in (("dtype", "bfloat16"), ("devices", "cuda")):
        keys.add(runs.settings_hash(onpolicy.own_turns_settings(
            argparse.Namespace(**{**vars(args), name: value}))))
    assert len(keys) == 3


def test_resume_with_nothing_to_resume_stops_and_says_so(tiny_policy, tmp_path, capsys):
    for out in (tmp_path / "missing", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(SystemExit, match=f"--resume: nothing to resume in {out} "):
            run(flags(tiny_policy, out, resume=True))
        assert not (out / "args.json").exists()
    with pytest.raises(SystemExit, match="2"):          # argparse's error: one line
        run(["--resume"])
    assert capsys.readouterr().err == (
        f"{lab_train.PROG}: error: --resume: nothing to resume without --out (the run "
        "directory to continue) (--help lists the flags)\n")
    with pytest.raises(SystemExit, match="2"):
        run(flags(tiny_policy, tmp_path / "x", resume=True, resume_if_present=True))
    # asked for explicitly: a run starts where there is none, and continues where there is one
    out = tmp_path / "empty"
    run(flags(tiny_policy, out, steps=1, resume_if_present=True))
    policy, _ = mdl.load_model(tiny_policy)
    n_base = sum(p.numel() for p in policy.parameters())
    n_lora = sum(p.numel() for p in mdl.apply_lora(policy, r=16).parameters() if p.requires_grad)
    assert f": {n_base:,} parameters, + {n_lora:,} in the LoRA adapter" in capsys.readouterr().out
    assert [m["step"] for m in metrics(out)] == [1]
    run(flags(tiny_policy, out, steps=1, resume_if_present=True))
    assert [m["step"] for m in metrics(out)] == [1]


def test_a_truncated_checkpoint_is_a_one_line_error(tiny_policy, tmp_path):
    out = tmp_path / "b"
    run(flags(tiny_policy, out, steps=1))
    ckpt = out / "checkpoint-000001"
    opt = ckpt / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:50])
    # its manifest tells, and there is no earlier checkpoint to resume from
    with pytest.raises(SystemExit, match=re.escape(f"--resume: no checkpoint in {out} is intact "
                                                   f"({opt}: changed since the checkpoint")):
        run(flags(tiny_policy, out, steps=1, resume=True))
    # written truncated (its manifest agrees): reading it tells
    grpo.write_manifest(ckpt)
    with pytest.raises(SystemExit, match=re.escape(f"{opt}: cannot resume from this checkpoint")):
        run(flags(tiny_policy, out, steps=1, resume=True))


def fake_pair(directory, d, n_attn, **info):
    """A PAIR directory with random weights (d hidden, n_attn attention inputs) and a source."""
    import pair
    import probes
    g = torch.Generator().manual_seed(0)

    def probe(n):
        return probes.Probe(torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64),
                            torch.randn(n, generator=g, dtype=torch.float64),
                            torch.tensor(0.0, dtype=torch.float64))
    pair.Pair(probe(d), probe(n_attn + 1), info=info).save(directory)
    return directory


def test_probes_of_another_model_fail_up_front(tiny_policy, tmp_path, monkeypatch):
    import pair
    other = tmp_path / "other"              # same shape, other weights
    other.mkdir()
    for f in tiny_policy.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import load_file, save_file
    w = load_file(str(other / "model.safetensors"))
    save_file({k: v + 0.01 for k, v in w.items()}, str(other / "model.safetensors"))
    dims = {"d": 32, "L": 2, "H": 4}        # tiny_policy's
    theirs = fake_pair(tmp_path / "theirs", 32, 4 * 2 * 4, model=str(other), dims=dims,
                       model_sha256=mdl.checkpoint_sha256(other))

    def no_evaluation(*a, **k):
        raise AssertionError("evaluated before the probes were checked")
    monkeypatch.setattr(probes, "evaluate", no_evaluation)
    with pytest.raises(SystemExit, match=f"{theirs} was made from model {other} .* but --model "
                                         f"{tiny_policy} from .*model_sha256 differs"):
        run(flags(tiny_policy, tmp_path / "run", "pair", probes=theirs, eval_episodes=2))
    narrow = fake_pair(tmp_path / "narrow", 16, 4 * 2 * 4)
    with pytest.raises(SystemExit, match="width 16 but --model"):
        run(flags(tiny_policy, tmp_path / "run2", "pair", probes=narrow, eval_episodes=2))
    ours = fake_pair(tmp_path / "ours", 32, 4 * 2 * 4, dims=dims,
                     model_sha256=mdl.checkpoint_sha256(tiny_policy))
    pair.check_probe_model(ours, tiny_policy)          # the right model passes


# ---------------------------------------------------------------------------------------------
# torchrun: 2 processes x 1 prompt == 1 process x 2 prompts

@pytest.mark.parametrize("reward", ["coe", "tree_grpo"])
def test_two_processes_equal_one_process(reward, tiny_policy, tmp_path, pair_cache):
    kw = dict(reward=reward, batch=2, steps=2, lora_dropout=0.0, save_every=2)
    env = dict(os.environ, PAIR_CACHE=str(pair_cache), OMP_NUM_THREADS="1")
    one, two = tmp_path / "one", tmp_path / "two"
    for out, launcher in ((one, [sys.executable]),
                          (two, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc_per_node", "2"])):
        r = subprocess.run(launcher + ["-m", "lab.train"] + flags(tiny_policy, out, **kw),
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    m1, m2 = metrics(one), metrics(two)
    assert [m["step"] for m in m2] == [1, 2]
    for a, b in zip(m1, m2):
        for k in ("reward_mean", "reward_std", "success", "loss", "kl", "grad_norm", "tokens",
                  "frac_zero_std", "turns"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k
    pa = adapters.load_adapter(mdl.load_model(tiny_policy)[0],
                               one / "checkpoint-000002" / "adapter")
    pb = adapters.load_adapter(mdl.load_model(tiny_policy)[0],
                               two / "checkpoint-000002" / "adapter")
    for (name, p), (_, q) in zip(mdl.lora_parameters(pa), mdl.lora_parameters(pb)):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-4, msg=name)


def test_two_runs_on_one_out_one_refuses(tiny_policy, tmp_path, pair_cache):
    # Both start at once: without a lock both pass the "already holds a run" check and write
    # interleaved metrics and checkpoints of two seeds.
    out = tmp_path / "run"
    env = dict(os.environ, PAIR_CACHE=str(pair_cache), OMP_NUM_THREADS="1")
    runs = [subprocess.Popen([sys.executable, "-m", "lab.train",
                              *flags(tiny_policy, out, steps=3, seed=seed)], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for seed in (1, 2)]
    results = [(r.wait(timeout=300), r.stderr.read()) for r in runs]
    refused = [err for rc, err in results if rc != 0]
    # on a loaded machine the second may start only after the first has finished, and then
    # meets its metrics instead of its lock: a refusal too (the lock alone: the next test)
    assert len(refused) == 1 and (f"{out} is in use by pid" in refused[0]
                                  or f"--out {out} already holds a run" in refused[0]), results
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]


def test_steps_and_evaluations_say_how_far_they_are(tiny_policy, tmp_path, capsys):
    run(flags(tiny_policy, tmp_path / "r", steps=2, eval_episodes=3))
    out = capsys.readouterr().out
    assert re.search(r"evaluating: 3/3 test episodes, \d+s left", out)
    assert re.search(r"evaluating: 2/2 validation episodes, \d+s left", out)
    steps = [line for line in out.splitlines() if line.startswith("step ") and "reward" in line]
    assert len(steps) == 2 and re.search(r"steps left \d+s$", steps[0])
    assert steps[-1].endswith("steps left 0s")


def test_the_cores_own_lock_refuses_a_second_holder(tmp_path):
    # `python grpo.py` keeps one run per OUT by its own flock, not the lab's lock (lab/runs.py)
    import fcntl
    with open(tmp_path / ".lock", "a+") as other:       # another open file: another holder
        other.write("4242\n")
        other.flush()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match=f"--out {tmp_path} is in use by pid 4242"):
            grpo.lock(tmp_path)
    grpo.lock(tmp_path)                                 # released with its file: taken
    assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
    grpo.unlock(tmp_path)                               # let go: the file goes with it
    assert not (tmp_path / ".lock").exists() and tmp_path.resolve() not in grpo.LOCKS


@pytest.mark.parametrize("loop", [grpo, lab_train], ids=["core", "lab"])
def test_a_finished_run_lets_its_out_go(loop, tiny_policy, tmp_path, monkeypatch):
    # the lock file names the run's process while it lasts; a finished run removes it
    out = tmp_path / "r"
    if loop is grpo:
        argv = core_flags(tiny_policy, out, steps=1)
    else:
        argv = flags(tiny_policy, out, steps=1)
    held, real = [], loop.train_step

    def step(*a, **k):
        held.append((out / ".lock").read_text())
        return real(*a, **k)
    monkeypatch.setattr(loop, "train_step", step)
    loop.main(argv)
    assert held == [f"{os.getpid()}\n"]
    assert (out / "summary.json").is_file() and not (out / ".lock").exists()


def test_kill_9_frees_the_out_of_a_run(tiny_policy, tmp_path, pair_cache):
    out = tmp_path / "run"
    args = lab_train.parser().parse_args(flags(tiny_policy, out, steps=1000, resume=True))
    grpo.resolve_preset(args, pair.Processes(), lab_train.WORLDS)
    env = dict(os.environ, PAIR_CACHE=str(pair_cache), OMP_NUM_THREADS="1")
    first = subprocess.Popen([sys.executable, "-m", "lab.train",
                              *flags(tiny_policy, out, steps=1000)], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.perf_counter()
        while not (out / "metrics.jsonl").exists():
            assert time.perf_counter() - t0 < 120 and first.poll() is None
            time.sleep(0.05)
        with pytest.raises(SystemExit, match=f"{out} is in use by pid {first.pid}"):
            lab_train.prepare_out(args, pair.Processes())
    finally:
        first.send_signal(signal.SIGKILL)       # no cleanup runs: the kernel drops the lock
        first.wait()
    assert lab_train.prepare_out(args, pair.Processes()) == out
    runs.release(out)


@pytest.mark.parametrize("loop", ["grpo.py", "lab.train"])
def test_sigterm_stops_a_run_in_one_line_and_frees_its_lock(loop, tiny_policy, tmp_path,
                                                            pair_cache):
    # `kill` (or a scheduler's stop) ends a run as Ctrl-C does: one line saying how to go on,
    # and no .lock left in OUT
    out = tmp_path / "run"
    if loop == "grpo.py":
        command = [sys.executable, "grpo.py", *core_flags(tiny_policy, out, steps=1000)]
    else:
        command = [sys.executable, "-m", "lab.train", *flags(tiny_policy, out, "outcome",
                                                               steps=1000)]
    env = dict(os.environ, PAIR_CACHE=str(pair_cache), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.perf_counter()
        while not (out / "checkpoint-000001" / "manifest.json").exists():
            assert time.perf_counter() - t0 < 120 and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and lines, (proc.returncode, err)
    assert lines[-1].startswith("stopped by SIGTERM; the run resumes from its last checkpoint "
                                "(checkpoint-"), err
    assert f" --out {out} " in lines[-1] and lines[-1].endswith(" --resume"), err
    assert not (out / ".lock").exists()


def test_resume_before_the_first_checkpoint_says_it_starts_over(tiny_policy, tmp_path,
                                                                monkeypatch, capsys):
    out = tmp_path / "r"
    argv = core_flags(tiny_policy, out, steps=3, save_every=3)
    real = grpo.train_step

    def killed_at_step_2(step, run):
        if step == 1:
            raise KeyboardInterrupt
        return real(step, run)
    monkeypatch.setattr(grpo, "train_step", killed_at_step_2)
    with pytest.raises(SystemExit):
        grpo.main(argv)
    monkeypatch.setattr(grpo, "train_step", real)
    assert [r["step"] for r in metrics(out)] == [1] and not list(out.glob("checkpoint-*"))
    capsys.readouterr()
    grpo.main([*argv, "--resume"])
    said = capsys.readouterr().out
    assert f"--resume: {out} holds no checkpoint (the first is saved after step 3): the run " \
        "starts over from step 1" in said, said
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_out_refuses_a_folder_that_holds_other_files(tiny_policy, tmp_path):
    # --out runs (the folder of every run) or a folder of one's own files is no run to write
    # into: refused before anything is loaded, naming the folder
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    for loop, argv in ((grpo, core_flags(tiny_policy, out)), (lab_train, flags(tiny_policy, out))):
        with pytest.raises(SystemExit, match=f"--out {out} holds other files, not a run "
                                             r"\(no args.json\)"):
            loop.main(argv)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    # an empty folder, or one holding only a hidden file (a lock), is a fresh run's
    (out / "notes.txt").unlink()
    (out / ".lock").write_text("")
    args = grpo.parse_args(core_flags(tiny_policy, out))
    grpo.resolve_preset(args, pair.Processes())
    grpo.check_out(args)


def test_a_flag_is_never_taken_by_a_prefix_of_its_name(tiny_policy, tmp_path, capsys):
    # argparse's default takes --step for --steps: a typo would train with another setting
    for loop in (grpo, lab_train):
        with pytest.raises(SystemExit):
            loop.parse_args(["--step", "1", "--out", str(tmp_path / "r")])
        err = capsys.readouterr().err
        assert "unrecognized arguments: --step 1" in err, err
    args = grpo.parse_args(["--steps", "1", "--out", str(tmp_path / "r")])
    assert args.steps == 1


def test_a_flag_error_points_to_the_lab_only_for_the_labs_names(capsys):
    # a misspelled flag or value is not the lab's; a name only the lab takes is
    for argv, lab in ((["--stpes", "3"], None), (["--reward", "pari"], None),
                      (["--env", "nowhere"], None),
                      (["--reward", "igpo"], "--reward igpo"),
                      (["--env", "shop-long"], "--env shop-long"),
                      (["--advantage", "position"], "--advantage position"),
                      (["--probe-reads", "base"], "--probe-reads")):
        with pytest.raises(SystemExit):
            grpo.main(argv)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("python grpo.py: error: "), err
        assert ("`python -m lab.train`" in err) == (lab is not None), err
        if lab is not None:
            assert f"; {lab} is the lab's (" in err, err
    # the names grpo.py points to are exactly those the lab's parser adds to the core's
    core, lab = grpo.train_parser(), lab_train.parser()
    assert {s for a in lab._actions for s in a.option_strings} - \
        {s for a in core._actions for s in a.option_strings} == grpo.LAB_ONLY["flags"]
    for flag in ("--env", "--reward", "--advantage"):
        lab_choices = next(set(a.choices) for a in lab._actions if flag in a.option_strings)
        core_choices = next(set(a.choices) for a in core._actions if flag in a.option_strings)
        assert lab_choices - core_choices == grpo.LAB_ONLY[flag], flag


# ---------------------------------------------------------------------------------------------
# evaluation: greedy rollouts on the held-out split (GTA matched loosely there); the
# summary keeps the best and the final checkpoint apart

def spy_envs(monkeypatch) -> dict:
    """Record what the lab's train() hands to the training steps and to evaluate: name ->
    (env, pool)."""
    seen = {}
    real_step, real_eval = lab_train.train_step, probes.evaluate

    def train_step(step, run):
        seen["train"] = run.env, run.pool
        return real_step(step, run)

    def evaluate(policy, tok, env, pool, *a, **k):
        seen.setdefault("eval", []).append((env, pool))
        return real_eval(policy, tok, env, pool, *a, **k)
    monkeypatch.setattr(lab_train, "train_step", train_step)
    monkeypatch.setattr(probes, "evaluate", evaluate)
    return seen


class Recording:
    """An environment that keeps every episode it hands out (to read what was played)."""

    def __init__(self, env):
        self.env, self.ids, self.episodes = env, env.ids, []

    def __len__(self):
        return len(self.env)

    def episode(self, i):
        self.episodes.append(self.env.episode(i))
        return self.episodes[-1]


def test_evaluation_decodes_greedily(tiny_policy):
    policy, tok = mdl.load_model(tiny_policy)
    held_out = envs.ShopEnv("test")
    pool = [4, 1, 7]
    args = play_args(eval_episodes=0, eval_batch=8, temperature=1.0)
    played = []
    for seed in (0, 1):                 # greedy: the global RNG state changes nothing
        torch.manual_seed(seed)
        env = Recording(held_out)
        result = probes.evaluate(policy, tok, env, pool, 0, args, pair.Processes())
        played.append([ep.messages for ep in env.episodes])
        assert result["episodes"] == 3
        assert result["success"] == pytest.approx(sum(ep.score() for ep in env.episodes) / 3)
    assert played[0] == played[1]
    greedy = probes.rollout(policy, tok, [held_out.episode(j) for j in pool], args, greedy=True,
                            stats=False)
    assert played[0] == [t.episode.messages for t in greedy]
    sampled = probes.rollout(policy, tok, [held_out.episode(j) for j in pool], args,
                             generator=torch.Generator().manual_seed(0), stats=False)
    assert played[0] != [t.episode.messages for t in sampled]      # the check can tell


def test_training_plays_the_train_split_and_evaluation_the_test_split(tiny_policy, tmp_path,
                                                                      monkeypatch):
    seen = spy_envs(monkeypatch)
    summary = run(flags(tiny_policy, tmp_path / "run", "outcome", steps=1, eval_episodes=2))
    (train_env, _), evals = seen["train"], seen["eval"]
    assert train_env.ids == envs.ShopEnv("train").ids
    # base and step 1, each on validation (selection) then test (the reported number)
    assert [env.ids for env, _ in evals] == [envs.ShopEnv(s).ids
                                             for s in ("val", "test", "val", "test")]
    assert summary["base"]["episodes"] == 2 and all(len(p) == len(e) for e, p in evals)


def test_summary_selects_on_validation_and_reports_test(tmp_path):
    # (validation, test) success per evaluation: validation's best (0.6, first at step 20) is
    # not test's best (0.8 at step 30), and neither is the last checkpoint
    success = {0: (0.3, 0.2), 10: (0.4, 0.5), 20: (0.6, 0.7), 30: (0.6, 0.8), 40: (0.5, 0.4)}
    for step, (val, test) in success.items():
        grpo.append_jsonl(tmp_path / "eval.jsonl", {
            "step": step, "val": {"success": val, "episodes": 20, "turns": 3.0, "scores": []},
            "test": {"success": test, "episodes": 48, "turns": 3.0, "scores": []}})
    s = grpo.summarize(tmp_path, 12.0, argparse.Namespace(reward="pair", alpha=5.0, seed=1,
                                                          steps=40))
    assert [s[k]["step"] for k in ("base", "selected", "final", "best_on_test")] == [0, 20, 40, 30]
    assert [s[k]["success"] for k in ("base", "selected", "final", "best_on_test")] == \
        [0.2, 0.7, 0.4, 0.8]
    assert s["selected"]["val"] == 0.6 and "scores" not in s["selected"]
    assert s["selected_adapter"] == str(tmp_path / "checkpoint-000020" / "adapter")
    assert ("before 0.200 -> selected 0.700 (step 20, chosen on validation) -> final 0.400 "
            "(step 40); best on test 0.800 (step 30, the paper's protocol)") in \
        grpo.summary_text(s)


def test_gta_answers_match_strictly_in_training_and_loosely_in_evaluation(release_dir):
    args = argparse.Namespace(env="gta", data_dir=release_dir)
    scores = {}
    for split, evaluation in (("train", False), ("train", True), ("test", True)):
        ep = envs.make_env(args, split, evaluation).episode(0)
        ep.gt_answer = {"whitelist": [["1919.96"]], "blacklist": None}  # GTA test episode 1
        assert ep.skip_reason is None
        ep.step("Final Answer: 1919.96s")           # "s" touches the alias: strict says no
        scores[split, evaluation] = ep.score()
    assert scores == {("train", False): 0.0, ("train", True): 1.0, ("test", True): 1.0}


# ---------------------------------------------------------------------------------------------
# every --reward that needs no network: a short run each

OFFLINE = [r for r in lab_train.REWARDS if r != "llm_judge"]


@pytest.mark.parametrize("reward", OFFLINE)
def test_every_offline_reward_runs(reward, tiny_policy, tmp_path):
    out = tmp_path / reward
    summary = run(flags(tiny_policy, out, reward, steps=1, eval_episodes=2,
                        outcome_weight=0.5 if reward == "pair" else None))
    (rec,) = metrics(out)
    assert math.isfinite(rec["reward_mean"]) and math.isfinite(rec["loss"])
    assert rec["tokens"] > 0 and rec["turn_rewards"] and rec["empty_batch"] == 0
    if reward in ("pair", *pair.PROBE_REWARDS):
        assert "probe_auroc" in rec
        bound = 1.5 if reward == "pair" else 1.0            # + 0.5 x task score on pair
        assert all(0 <= r <= bound for r in rec["turn_rewards"] if r is not None)
    if reward == "outcome":          # one reward per rollout: its task score
        assert rec["reward_mean"] == pytest.approx(rec["success"])
    assert summary["base"]["episodes"] == 2 and summary["final"]["step"] == 1


@pytest.mark.parametrize("reward", ["outcome", "igpo", "tree_grpo", "at2po"])
def test_gta_replay_runs(reward, release_dir, tiny_policy, tmp_path, monkeypatch):
    # igpo reads the gold answer from the released gold dialog; tree search replays GTA episodes
    # to branch them
    out = tmp_path / reward
    seen = spy_envs(monkeypatch)
    summary = run(flags(tiny_policy, out, reward, env="gta", data_dir=release_dir, steps=1,
                        eval_episodes=2))
    (rec,) = metrics(out)
    assert rec["tokens"] > 0 and math.isfinite(rec["loss"]) and "probe_auroc" not in rec
    assert summary["base"]["episodes"] == 2
    # the reward matches answers strictly, the held-out evaluation loosely (the paper's protocol)
    (train_env, train_pool), evals = seen["train"], seen["eval"]
    (val_env, val_pool), (test_env, _) = evals[:2]
    assert train_env.match == "strict" and val_env.match == test_env.match == "loose"
    assert test_env.ids == envs.make("gta", split="test", data_dir=release_dir).ids
    # validation is set aside from the end of the training split, and never trained on
    assert val_env.ids == train_env.ids and not set(val_pool) & set(train_pool)


@pytest.mark.parametrize("reward", ["tree_grpo", "at2po"])
def test_toolbench_tree_search_runs_with_the_judge(reward, release_dir, tiny_policy, tmp_path,
                                                   fake_openai):
    # ToolBench releases test files only: a by-episode split of a few of them (envs.py
    # split-episodes) is its training data; ToolBench needs a judge to score answers
    lab_data.split_episodes(release_dir, "toolbench", tmp_path / "data" / "toolbench", seed=0,
                            episodes=8)
    out = tmp_path / reward
    summary = run(flags(tiny_policy, out, reward, env="toolbench", data_dir=tmp_path / "data",
                        steps=1, eval_episodes=2))
    (rec,) = metrics(out)
    assert rec["branch_rollouts"] > 0 and rec["tokens"] > 0 and math.isfinite(rec["loss"])
    assert summary["base"]["episodes"] == 2 and summary["final"]["step"] == 1


def test_probe_cache_is_reused(tiny_policy, tmp_path, pair_cache):
    run(flags(tiny_policy, tmp_path / "a", "last_token", steps=1))
    cached = list((pair_cache / "grpo-probes").glob("shop-*/contaminated-*/probes.json"))
    assert len(cached) == 1
    before = cached[0].stat().st_mtime_ns
    run(flags(tiny_policy, tmp_path / "b", "multi_attn", steps=1))
    assert cached[0].stat().st_mtime_ns == before
    report = json.loads(cached[0].read_text())
    assert set(report["heldout"]) >= {"pair", "last_token", "multi_attn"}
    assert report["settings"]["corpus"] == "contaminated"


def test_igpo_rewards_are_gold_probability_gains(tiny_policy):
    policy, tok = mdl.load_model(tiny_policy)
    env = envs.ShopEnv("train")
    args = play_args(micro_batch=2, reward="igpo", outcome_weight=0.0)
    (traj,) = probes.rollout(policy, tok, [env.episode(2)], args,
                             generator=torch.Generator().manual_seed(0))
    ctx = baselines.LabContext(policy, tok, env, args=args)
    rewards = baselines.igpo_reward(traj, ctx).rewards
    answer = env.episode(2).task.answer
    assert baselines.gold_answer(ctx, traj.episode) == answer

    def p_gold(prefix):        # geometric-mean probability of the answer tokens, directly
        head = tok.encode("Final Answer:")
        target = tok.encode(" " + answer)
        ids = torch.tensor([prefix + head + target])
        logp = torch.log_softmax(policy(ids)[0], -1)
        n = len(target)
        return math.exp(sum(logp[ids.shape[1] - n - 1 + k, target[k]].item()
                            for k in range(n)) / n)
    p = [p_gold(traj.segments[0][:s.span[0]]) for s in traj.steps]
    expected = [p[t + 1] - p[t] for t in range(len(p) - 1)] + [traj.score]
    assert rewards == pytest.approx(expected, rel=1e-4, abs=1e-7)


def test_tips_reads_the_lagged_teacher(tiny_policy):
    policy, tok, args, env = lora_policy(tiny_policy, ["--micro-batch", "2", "--reward", "tips"])
    (traj,) = probes.rollout(policy, tok, [env.episode(3)], play_args(),
                             generator=torch.Generator().manual_seed(0))
    base = baselines.lora_state(policy)                # B = 0: the teacher is the base model
    with torch.no_grad():
        for _, p in mdl.lora_parameters(policy):
            p.add_(0.3)                                  # the policy has moved on since
    moved = baselines.lora_state(policy)
    ctx = baselines.LabContext(policy, tok, env, args=args, lagged=base)
    rewards = baselines.tips_reward(traj, ctx).rewards
    assert all(torch.equal(moved[n], p) for n, p in mdl.lora_parameters(policy))   # restored
    states = baselines.traj_states(traj)
    answer = baselines.gold_answer(ctx, traj.episode)
    with mdl.lora_disabled(policy):
        logp, n = baselines.gold_logprobs(policy, tok, states, answer, 1)
    assert n[0] > 1                     # the mean, not the sum, is what the check can tell
    phi = [lp / k for lp, k in zip(logp, n)]            # length-normalized, as the release
    expected = [phi[t + 1] - phi[t] for t in range(len(phi) - 1)] + [traj.score]
    assert rewards == pytest.approx(expected, rel=1e-5, abs=1e-6)
    phi_moved, _ = baselines.gold_logprobs(policy, tok, states, answer, 1)
    assert phi_moved != pytest.approx(phi, rel=1e-3)


def stacked_raw(steps) -> dict[str, torch.Tensor]:
    raws = [probes.raw_features(step.trace) for step in steps]
    return {k: torch.stack([r[k] for r in raws]) for k in raws[0]}


def random_pair(raw: dict, seed: int) -> pair.Pair:
    """PAIR with random weights, its scalers fitted to `raw`: s_final spread over (0, 1)."""
    g = torch.Generator().manual_seed(seed)

    def probe(X):
        d = X.shape[1]
        scale = X.std(0, correction=0).clamp_min(1e-3)
        w = 2 * torch.randn(d, generator=g, dtype=torch.float64) / math.sqrt(d)
        return probes.Probe(X.mean(0), scale, w, torch.tensor(0.0, dtype=torch.float64))
    X1 = probes.feature("last_token", raw)
    stage1 = probe(X1)
    X2 = torch.cat([probes.feature("multi_attn", raw), stage1.predict_proba(X1)[:, None]], 1)
    return pair.Pair(stage1, probe(X2))                           # stage 2 on [multi_attn; s_bc]


def test_pair_reward_is_the_momentum_reward_of_the_turns_s_final(tiny_policy, tmp_path):
    policy, tok = mdl.load_model(tiny_policy)
    env = envs.ShopEnv("train")
    trajs = probes.rollout(policy, tok, [env.episode(i) for i in range(4)], play_args(max_turns=4),
                           generator=torch.Generator().manual_seed(0))
    model = random_pair(stacked_raw([step for t in trajs for step in t.steps]), seed=0)
    model.save(tmp_path / "pair")
    traj = max(trajs, key=lambda t: len(t.steps))
    assert len(traj.steps) >= 3             # momentum reads the mean of at least two earlier s~
    ctx = pair.RewardContext(policy, tok, pair=pair.Pair.load(tmp_path / "pair"), alpha=5.0)
    rewards, p_correct = pair.pair_reward(traj, ctx)

    _, s_final = model.scores(stacked_raw(traj.steps))
    assert p_correct == pytest.approx(s_final.tolist(), abs=1e-9)
    expected = pair.trajectory_rewards(s_final.tolist(), alpha=5.0)
    assert rewards == pytest.approx(expected, abs=1e-9)
    # the check can tell: a momentum over the earlier rewards r instead of the earlier s~ differs
    s_tilde = [pair.temp_clip(s) for s in s_final.tolist()]
    over_r = [s_tilde[0]]
    for t in range(1, len(s_tilde)):
        over_r.append(pair.momentum_reward(s_tilde[t], over_r[:t]))
    assert max(abs(a - b) for a, b in zip(over_r, expected)) > 1e-3


def test_outcome_weight_moves_the_last_reward_not_the_probes_p_correct(tiny_policy):
    # a probe reward's turn rewards are its P(correct), which the drift monitor also scores:
    # --outcome-weight adds to the last reward only
    policy, tok = mdl.load_model(tiny_policy)
    env = envs.ShopEnv("train")
    traj = probes.rollout(policy, tok, [env.episode(0)], play_args(max_turns=3),
                          generator=torch.Generator().manual_seed(0))[0]
    traj.score = 1.0
    probe = random_pair(stacked_raw(traj.steps), seed=0).stage1        # a last_token probe
    ctx = pair.RewardContext(policy, tok, probe=probe, feature="last_token")
    p = probe.predict_proba(probes.feature("last_token", stacked_raw(traj.steps))).tolist()
    rewards, p_correct = pair.turn_rewards(traj, pair.REWARDS["last_token"], ctx,
                                           outcome_weight=0.5)
    assert p_correct == pytest.approx(p, abs=1e-12)
    assert rewards == pytest.approx(p[:-1] + [p[-1] + 0.5], abs=1e-12)


def test_the_cores_pair_reward_runs_without_the_lab(tiny_policy):
    # the core's own objects only: the "pair" row of pair.REWARDS, a pair.RewardContext, and
    # PAIR's rewards from stored features with alpha, T and eps as arguments (METHOD.md §7)
    policy, tok = mdl.load_model(tiny_policy)
    env = envs.ShopEnv("train")
    trajs = probes.rollout(policy, tok, [env.episode(i) for i in range(4)], play_args(max_turns=4),
                           generator=torch.Generator().manual_seed(0))
    head = random_pair(stacked_raw([step for t in trajs for step in t.steps]), seed=1)
    traj = max(trajs, key=lambda t: len(t.steps))
    assert len(traj.steps) >= 3             # momentum reads the mean of at least two earlier s~
    traj.score = 1.0
    _, s_final = head.scores(stacked_raw(traj.steps))
    s_final = s_final.tolist()

    def by_hand(alpha, T, eps):
        # s~_t = clip(sigma(logit(s_t) / T), eps, 1 - eps); r_1 = s~_1,
        # r_t = sigma(logit(s~_t) + alpha (s~_t - mean_{k<t} s~_k))
        def sigma(z):
            return 1 / (1 + math.exp(-z))

        def logit(p):
            return math.log(p / (1 - p))
        s = [min(max(sigma(logit(x) / T), eps), 1 - eps) for x in s_final]
        return [s[0]] + [sigma(logit(s[t]) + alpha * (s[t] - sum(s[:t]) / t))
                         for t in range(1, len(s))]

    # other alpha, T and eps than the paper's: each one must reach the reward
    raw = pair.turn_features(traj)
    for alpha, T, eps in ((3.0, 1.5, 0.2), (5.0, 2.0, 0.05), (0.0, 4.0, 0.3)):
        rewards, p = pair.rewards_from_pair(head, raw, alpha=alpha, T=T, eps=eps)
        expected = pair.trajectory_rewards(s_final, alpha, T, eps)
        assert expected == pytest.approx(by_hand(alpha, T, eps), abs=1e-12)
        assert rewards == pytest.approx(expected, abs=1e-9)
        assert p == pytest.approx(s_final, abs=1e-9)
    assert pair.rewards_from_pair(head, raw, alpha=3.0, T=1.5, eps=0.2).rewards != \
        pytest.approx(pair.rewards_from_pair(head, raw).rewards, abs=1e-3)   # the check can tell
    # the table's row: ctx.alpha, the paper's T and eps, + 0.5 x the task score on the last turn
    ctx = pair.RewardContext(policy, tok, pair=head, alpha=3.0)
    rewards, p_correct = pair.turn_rewards(traj, pair.REWARDS["pair"], ctx, outcome_weight=0.5)
    r = by_hand(3.0, 2.0, 0.05)
    assert rewards == pytest.approx(r[:-1] + [r[-1] + 0.5], abs=1e-9)
    assert p_correct == pytest.approx(s_final, abs=1e-9)
    # and the core loads none of the lab
    code = "import grpo, sys; print(sorted(m for m in sys.modules if m.split('.')[0] == 'lab'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout == "[]\n", out.stderr


def test_probes_of_a_pair_train_run(tiny_policy, tmp_path, capsys, monkeypatch):
    # README: `python -m lab.study train --out runs/pair-gta`, then `grpo.py --probes runs/pair-gta`
    policy, tok = mdl.load_model(tiny_policy)
    data, features = tmp_path / "shop-data", tmp_path / "features"
    shop.make_shop_data(data, episodes=10, seed=42)
    for split in study.TRAIN_SPLITS["mixed"] + study.TEST_SPLITS:
        study.extract(policy, tok, data / f"{split}.json", features / f"{split}.safetensors")
    trained = tmp_path / "pair-shop"
    study.main(["train", "--features", str(features), "--out", str(trained), "--seeds", "43", "42"])
    loaded, real_read = [], lab_train.read_probes

    def read_probes(ctx, *a, **k):          # what the reward reads: which model, which seed
        report = real_read(ctx, *a, **k)
        m = ctx.pair or ctx.probe
        loaded.append((type(m).__name__, m.info.get("feature"), m.info["seed"]))
        return report
    monkeypatch.setattr(lab_train, "read_probes", read_probes)
    capsys.readouterr()
    for n, (reward, probes_flag, expect) in enumerate([
            ("pair", trained, ("Pair", None, 42)),
            ("last_token", trained, ("Probe", "last_token", 42)),
            ("pair", trained / "seed43", ("Pair", None, 43))]):
        run(flags(tiny_policy, tmp_path / f"run{n}", reward, probes=probes_flag, steps=1))
        assert loaded[-1] == expect
        said = f"--probes {trained}: the probes of seed 42"
        assert (said in capsys.readouterr().out) == (probes_flag == trained)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no pair.json there nor in pair_mixed/, pair/"):
        run(flags(tiny_policy, tmp_path / "run3", "pair", probes=tmp_path / "empty", steps=1))


# ---------------------------------------------------------------------------------------------
# llm_judge against a local fake OpenAI-compatible server

class FakeJudge(BaseHTTPRequestHandler):
    calls = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeJudge.calls.append(body)
        step = body["messages"][-1]["content"].rsplit("Latest step to rate:", 1)[-1]
        score = 1 + len(step) % 10                  # deterministic, varies with the step
        reply = {"choices": [{"message": {"content": json.dumps({"score": score})}}]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_llm_judge_against_a_local_server(tiny_policy, tmp_path, monkeypatch):
    server = HTTPServer(("127.0.0.1", 0), FakeJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{server.server_port}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    monkeypatch.setenv("PAIR_CACHE", str(tmp_path / "cache"))    # no judgment cached yet
    FakeJudge.calls = []
    try:
        run(flags(tiny_policy, tmp_path / "j", "llm_judge", steps=1))
    finally:
        server.shutdown()
    (rec,) = metrics(tmp_path / "j")
    scores = [1 + len(c["messages"][-1]["content"].rsplit("Latest step to rate:", 1)[-1]) % 10
              for c in FakeJudge.calls]
    assert rec["turns"] * 2 == len(FakeJudge.calls) > 0        # one call per step, G = 2
    assert rec["reward_mean"] == pytest.approx(sum((s - 1) / 9 for s in scores) / len(scores))
    assert FakeJudge.calls[0]["model"] == "gpt-4o-mini"


def test_llm_judge_without_a_key_fails_before_any_work(tiny_policy, tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="OPENAI_API_KEY"):
        run(flags(tiny_policy, tmp_path / "j", "llm_judge", steps=1))


def test_premise_gate_is_printed_kept_and_its_turns_cached(tiny_policy, tmp_path, pair_cache,
                                                           capsys):
    # --reward labels fits no probe: the held-out own turns are sampled once, then read again
    summary = run(flags(tiny_policy, tmp_path / "a", "labels", steps=1, eval_episodes=2,
                        advantage="position"))
    gate = summary["premise_gate"]
    assert (gate["advantage"], gate["reward"]) == ("position", "labels") and gate["groups"] == 2
    assert "premise gate: the position advantage of --reward labels" in capsys.readouterr().out
    cached = {p: p.stat().st_mtime_ns
              for p in (pair_cache / "grpo-probes").glob("shop-*/heldout-*.safetensors")}
    assert cached
    summary = run(flags(tiny_policy, tmp_path / "b", "labels", steps=1, eval_episodes=2))
    assert all(p.stat().st_mtime_ns == t for p, t in cached.items())
    assert summary["premise_gate"]["advantage"] == "process"
    assert "sampling the held-out own turns" not in capsys.readouterr().out


def test_cli_help_lists_every_reward_and_the_real_defaults():
    core = subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert core.returncode == 0 and "igpo" not in core.stdout and "--tree-m" not in core.stdout
    # the lab's (python -m lab.train) adds its rewards and flags to the core's
    r = subprocess.run([sys.executable, "-m", "lab.train", "--help"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0

    def choices(text):
        return set(re.search(r"--reward \{([^}]*)\}", text)[1].split(","))
    assert choices(r.stdout) == set(lab_train.REWARDS) and choices(core.stdout) == CORE_REWARDS
    text = " ".join(r.stdout.split())       # wide enough that no default is broken at a "-"
    body = text[text.index("optimization:"):]          # the flags' help, past the usage
    assert "default: None" not in text and body.count("(default:", body.index("--micro-batch"),
                                                      body.index("--micro-batch-tokens")) == 1
    for key, paper in grpo.PAPER_HPARAMS.items():
        flag = f"--{key.replace('_', '-')} {key.upper()} "
        default = text[text.index("(default:", text.index(flag)):][:80]   # its help's last part
        tiny = grpo.TINY.get(key, paper)
        assert default.startswith(f"(default: {tiny} with the built-in policy, {paper} otherwise)"
                                  if tiny != paper else f"(default: {paper})"), (flag, default)
    # which defaults are the paper's (Table grpo_config) and which the release's: said once
    assert "the release's (the paper states no T or top-p)" in text
    assert grpo.train_parser(pair.REWARDS).parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"


# ---------------------------------------------------------------------------------------------
# the probes of the built-in world: an on-policy corpus, held-out own turns, reads from the base

def test_no_held_out_episode_is_sampled_for_the_corpus_or_for_training(tmp_path, monkeypatch):
    calls, fitted, yardstick = [], [], []
    real_rollout, real_fit = probes.rollout, onpolicy.fit_probes
    real_corpus = onpolicy.contaminated_corpus

    def spy_rollout(policy, tok, episodes, args, greedy=False, **kw):
        calls.append((greedy, [ep.id for ep in episodes]))
        return real_rollout(policy, tok, episodes, args, greedy=greedy, **kw)

    def spy_fit(train, info):
        fitted.append(list(train.episode_id))
        return real_fit(train, info)
    for module in (probes, onpolicy):     # training, evaluation, the probe corpus
        monkeypatch.setattr(module, "rollout", spy_rollout)
    monkeypatch.setattr(onpolicy, "fit_probes", spy_fit)
    monkeypatch.setattr(onpolicy, "contaminated_corpus",
                        lambda *a: yardstick.append(real_corpus(*a)) or yardstick[-1])
    summary = run(["--model", str(BUILTIN), "--reward", "pair", "--out", str(tmp_path / "r"),
                   "--steps", "2", "--batch", "2", "--group", "2", "--save-every", "1",
                   "--corpus-episodes", "4", "--corpus-samples", "2", "--corpus-heldout", "3",
                   "--probe-episodes", "10", "--eval-episodes", "3", "--val-episodes", "2",
                   "--threads", "1"])
    split_of = {}
    for greedy, ids in calls:
        for eid in ids:
            split_of.setdefault(eid.split("-")[2], set()).add(greedy)
    sampled = {eid for greedy, ids in calls if not greedy for eid in ids}
    assert not any("-test-" in eid for eid in sampled)              # test is only ever evaluated
    val_sampled = {eid for eid in sampled if "-val-" in eid}
    assert val_sampled == {f"shop-42-val-{i}" for i in range(3)}    # the held-out own turns
    (on_policy,), contaminated = fitted, yardstick[0].episode_id    # corpus; the yardstick
    assert on_policy and all("-train-" in eid for eid in on_policy)
    assert all("-train-" in eid for eid in contaminated)
    evaluated = {eid for greedy, ids in calls if greedy for eid in ids}
    assert evaluated == {f"shop-42-val-{i}" for i in range(2)} | \
        {f"shop-42-test-{i}" for i in range(3)}
    assert set(split_of) == {"train", "val", "test"}
    assert 0 <= summary["probe_auroc_heldout"]["pair"] <= 1
    report = json.loads(next((Path(os.environ["PAIR_CACHE"]) / "grpo-probes")
                             .glob("shop-*/on-policy-*/probes.json")).read_text())
    assert report["heldout"]["n"]["all"] == summary["probe_auroc_heldout"]["turns"] > 0


def test_probe_reads_base_equals_teacher_forcing_through_the_base():
    policy, tok, args, env = lora_policy(BUILTIN, ["--lora-dropout", "0"])
    with torch.no_grad():                     # a trained-looking adapter: the policy != the base
        for name, p in mdl.lora_parameters(policy):
            p.normal_(0, 0.004 if "lora_B" in name else 0.3)
    policy.eval()
    trajs = probes.rollout(policy, tok, [env.episode(i) for i in (0, 1)],
                           play_args(max_new_tokens=96), generator=torch.Generator().manual_seed(0))
    generated = [step.trace for traj in trajs for step in traj.steps]
    onpolicy.read_from_base(policy, trajs, rows_per_forward=2)
    k = 0
    for traj in trajs:
        turns = [m for m, msg in enumerate(traj.episode.messages) if msg["role"] == "assistant"]
        for step, m in zip(traj.steps, turns):
            # what `python -m lab.study extract` does with this transcript: render, one
            # teacher-forced pass
            ids, spans = tok.render(traj.episode.messages[:m + 1])
            if not step.trace.finished:           # a turn cut at max_new_tokens has no im_end
                continue
            assert tuple(spans[-1]) == step.span
            assert ids[:step.span[1]] == traj.segments[step.segment][:step.span[1]]
            with mdl.lora_disabled(policy):
                want = grpo.probes.raw_features(traces.trace_forward(policy, ids, spans[-1]))
            got = grpo.probes.raw_features(step.trace)
            for key in want:
                torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-4)
            k += 1
    assert k > 0
    # and the policy's own generation pass reads something else
    assert any(not torch.allclose(a.h_last, s.trace.h_last, atol=1e-4) for a, s in
               zip(generated, [s for t in trajs for s in t.steps]))


def test_the_drift_monitor_warns_once_when_the_probe_falls_below_chance(tiny_policy, tmp_path,
                                                                        monkeypatch, capsys):
    assert grpo.below_chance([0.9, 0.4, 0.4, 0.4, 0.4]) is None           # not yet 5 below
    assert grpo.below_chance([0.9, 0.4, 0.4, None, 0.4, 0.4]) is None     # a step without one
    assert grpo.below_chance([0.9, 0.3, 0.4, 0.5, 0.4, 0.4]) == pytest.approx(0.4)
    assert grpo.below_chance([0.3, 0.4, 0.5, 0.6, 0.7]) is None           # mean 0.5: not below
    # a tiny random policy's turns are all wrong (no AUROC): feed the loop a falling monitor
    real, falling = lab_train.train_step, iter([0.8, 0.6, 0.4, 0.4, 0.4, 0.4, 0.3])

    def step(*a, **kw):
        rec = real(*a, **kw)
        rec["probe_auroc"] = next(falling)
        return rec
    monkeypatch.setattr(lab_train, "train_step", step)
    run(flags(tiny_policy, tmp_path / "m", "pair", steps=7, save_every=7))
    out = capsys.readouterr().out
    assert out.count("below chance") == 1
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if "below chance" in line)
    assert lines[i - 1].startswith("step    6/7") and "mean AUROC 0.44" in lines[i]


def test_probe_reads_base_runs_and_logs_its_cost(tiny_policy, tmp_path):
    run(flags(tiny_policy, tmp_path / "b", "pair", steps=1, probe_reads="base"))
    (rec,) = metrics(tmp_path / "b")
    assert rec["t_base_read"] > 0 and "probe_auroc" in rec


# ---------------------------------------------------------------------------------------------
# compare: resumable, the table, the curves

def test_compare_resumes_without_redoing_finished_runs(tiny_policy, tmp_path):
    out = tmp_path / "cmp"
    compare.main(_compare_argv(tiny_policy, out))
    run_dirs = out / "runs"
    done = {p.name: (p / "summary.json").stat().st_mtime_ns for p in run_dirs.iterdir()
            if p.is_dir()}
    assert len(done) == 4
    first = json.loads((out / "compare.json").read_text())
    # interrupt one run after its first checkpoint: no summary, the last checkpoint gone
    cut = run_dirs / "outcome-s2"
    (cut / "summary.json").unlink()
    shutil.rmtree(cut / "checkpoint-000002")
    compare.main(_compare_argv(tiny_policy, out))
    for name, mtime in done.items():
        if name != "outcome-s2":
            assert (run_dirs / name / "summary.json").stat().st_mtime_ns == mtime, name
    assert "resumed from" in (run_dirs / "outcome-s2.log").read_text()
    again = json.loads((out / "compare.json").read_text())
    for a, b in zip(first["rows"], again["rows"]):
        assert a["selected"]["per_seed"] == b["selected"]["per_seed"]
        assert a["final"]["per_seed"] == b["final"]["per_seed"]
    row = again["rows"][1]
    assert row["reward"] == "coe:alpha=0" and len(row["curve_success"]) == 3
    lo, hi = row["selected"]["ci95"]
    assert lo <= row["selected"]["mean"] <= hi
    assert "| outcome |" in (out / "compare.md").read_text()
    assert (out / "curves.svg").read_text().startswith("<svg")
    # the curves against training seconds, and how soon each reaches outcome's final success
    first_row = again["rows"][0]
    xs = [x for x, _ in first_row["curve_seconds"]]
    assert xs[0] == 0.0 and xs == sorted(xs) and xs[-1] > 0
    assert [y for _, y in first_row["curve_seconds"]] == [y for _, y in first_row["curve_success"]]
    clock = curves.training_seconds(metrics(run_dirs / "outcome-s1"))
    assert clock[2] == pytest.approx(sum(m["t_rollout"] + m["t_reward"] + m["t_update"]
                                         for m in metrics(run_dirs / "outcome-s1")))
    reach = first_row["to_target"]
    assert reach["success"] == first_row["final"]["mean"] and reach["step"] in (1, 2)
    assert "held-out success against training time" in (out / "curves.svg").read_text()
    # which habits each reward taught away: the test tasks by habit (task 0 is in USD, 1 and 2
    # are not: the divided habit's), success on each group recomputed from eval.jsonl
    assert again["habits"] == {"none": [0], "divided": [1, 2]}
    for row in again["rows"]:
        for key in ("base", "selected", "final"):
            want = []
            for run in row["runs"]:
                step = json.loads((Path(run) / "summary.json").read_text())[key]["step"]
                (ev,) = [e for e in grpo.read_jsonl(Path(run) / "eval.jsonl")
                         if e["step"] == step]
                want.append(sum(ev["test"]["scores"][1:]) / 2)
            assert row["by_habit"][key]["divided"] == pytest.approx(sum(want) / len(want))
    assert "| divided (2 tasks) |" in (out / "compare.md").read_text()


# shop's test tasks 0-3: task 0 is in USD (no habit), 1-3 have the divided habit
FAKE_SCORES = {1: {0: [0, 0, 0, 0], 10: [1, 1, 0, 0], 20: [0, 0, 0, 1]},
               2: {0: [0, 0, 0, 0], 10: [1, 1, 1, 1], 20: [0, 1, 1, 0]}}


def _finished_runs(out: Path, scores=FAKE_SCORES):
    """compare's finished runs of `outcome` as grpo.py leaves them, without training."""
    for seed, by_step in scores.items():
        run = out / "runs" / compare.run_name("outcome", seed)
        run.mkdir(parents=True)
        grpo.write_json(run / "args.json", {"env": "shop", "eval_episodes": 4})
        for step, test in by_step.items():
            grpo.append_jsonl(run / "eval.jsonl", {"step": step, "test": {
                "scores": test, "success": sum(test) / 4}})
        for step in (10, 20):
            grpo.append_jsonl(run / "metrics.jsonl", {"step": step, "frac_zero_std": 0.0,
                                                      "kl": 0.0, "reward_mean": 0.0})
        grpo.write_json(run / "summary.json", {"seconds": 60, **{
            key: {"step": step, "success": sum(by_step[step]) / 4}
            for key, step in (("base", 0), ("selected", 10), ("final", 20),
                              ("best_on_test", 10))}})


def test_compare_tables_success_by_habit_and_by_seed_from_each_runs_evaluations(tmp_path):
    _finished_runs(tmp_path)
    result = compare.compare_table(tmp_path, ["outcome"], [1, 2])
    assert result["habits"] == {"none": [0], "divided": [1, 2, 3]}
    got = result["rows"][0]["by_habit"]
    assert got["base"] == {"none": 0.0, "divided": 0.0}
    # mean over seeds of each seed's success on the group's tasks
    assert got["selected"] == pytest.approx({"none": 1.0, "divided": (1 / 3 + 1) / 2})
    assert got["final"] == pytest.approx({"none": 0.0, "divided": (1 / 3 + 2 / 3) / 2})
    table = compare.compare_markdown(result, "cmd")
    assert "| outcome | 0.0 → 100.0 → 0.0 | 0.0 → 66.7 → 50.0 |" in table
    # and each seed's curve after the base, which the mean over seeds hides
    assert "by seed, at steps 10, 20." in table
    assert "| outcome | 50.0, 25.0 | 100.0, 50.0 |" in table
    # a row evaluated at other steps (its own --save-every) says at which, cell by cell
    other = json.loads(json.dumps(result["rows"][0]))
    other["reward"], other["curve_by_seed"] = "sparse", {"steps": [20], "success": [[0.25], [0.5]]}
    table = compare.compare_markdown({**result, "rows": result["rows"] + [other]}, "cmd")
    assert "by seed, step: success." in table and "| sparse | 20: 25.0 | 20: 50.0 |" in table
    assert "| outcome | 10: 50.0, 20: 25.0 | 10: 100.0, 20: 50.0 |" in table


def _compare_argv(policy, out):
    per_run = ["--model", str(policy), "--steps", "2", "--group", "2", "--max-turns", "2",
               "--max-new-tokens", "8", "--save-every", "1", "--eval-episodes", "3",
               "--val-episodes", "2"]
    return ["--rewards", "outcome", "coe:alpha=0", "--seeds", "1", "2", "--out",
            str(out), "--jobs", "2", "--", *per_run]


def test_compare_rejects_a_bad_reward_spec(tmp_path):
    with pytest.raises(SystemExit, match="unknown reward 'paír'"):
        compare.main(["--rewards", "paír", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="name=value"):
        compare.main(["--rewards", "pair:alpha", "--out", str(tmp_path)])


@pytest.fixture
def no_run_starts(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("compare started a run")
    monkeypatch.setattr(compare.subprocess, "Popen", refuse)


@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_compare_refuses_jobs_below_one(jobs, tmp_path, no_run_starts):
    # it started nothing and waited for it forever
    with pytest.raises(SystemExit) as e:
        compare.main(["--rewards", "outcome", "--seeds", "1", "--out", str(tmp_path / "o"),
                      "--jobs", jobs])
    assert e.value.code == f"compare: --jobs must be at least 1, got {jobs}"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("rewards, seeds, error", [
    (["outcome", "pair"], ["42", "43", "42"], "--seeds: 42 given twice"),
    (["outcome", "pair:alpha=0", "pair:alpha=0"], ["42"], "--rewards: pair:alpha=0 given twice")])
def test_compare_refuses_a_run_asked_for_twice(rewards, seeds, error, tmp_path, no_run_starts):
    # it would train the same run directory twice at once and tabulate it twice
    with pytest.raises(SystemExit) as e:
        compare.main(["--rewards", *rewards, "--seeds", *seeds, "--out", str(tmp_path / "o")])
    assert e.value.code == f"compare: {error}"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("rewards, extra, error", [
    (["pair:alpha="], [], "argument --alpha: invalid float value: ''"),
    (["outcome", "pair:nosuchflag=1"], [], "unrecognized arguments: --nosuchflag 1"),
    (["pair:alpha=abc"], [], "argument --alpha: invalid float value: 'abc'"),
    (["tree_grpo:tree-l=0"], [], "--tree-l must be at least 1, got 0"),
    (["outcome"], ["--bogus"], "unrecognized arguments: --bogus"),
    (["outcome"], ["--steps", "0"], "--steps must be at least 1, got 0"),
    (["outcome"], ["--seed", "7"], "--seed, --out and --resume are compare's to set"),
    (["outcome"], ["--see", "7"], "unrecognized arguments: --see 7"),     # no prefix is taken
    (["outcome:reward=pair"], [], "--seed, --out and --resume are compare's to set"),
    (["pair", "outcome:probe-retrain-every=5"], [], "--reward outcome reads no probe to refit"),
    (["pair:probe-retrain-every=5"], ["--env", "gta"], "only the built-in world has")])
def test_compare_checks_every_run_with_grpos_parser_before_starting_any(
        rewards, extra, error, tmp_path, no_run_starts):
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        compare.main(["--rewards", *rewards, "--seeds", "1", "--out", str(out), "--", *extra])
    spec = rewards[-1]
    assert e.value.code.startswith(f"compare: {spec!r} (run {compare.run_name(spec, 1)}): ")
    assert error in e.value.code
    assert "\n" not in e.value.code and not out.exists()       # no run dir, no log


def test_compare_refuses_a_resumed_run_whose_flags_changed_before_starting_any(
        tmp_path, no_run_starts):
    run = tmp_path / "runs" / "outcome-s1"
    run.mkdir(parents=True)
    grpo.write_json(run / "args.json", {"steps": 3})
    with pytest.raises(SystemExit) as e:
        compare.main(["--rewards", "outcome", "--seeds", "1", "--out", str(tmp_path), "--",
                      "--steps", "2"])
    assert e.value.code == (f"compare: 'outcome' (run outcome-s1): --resume: --steps is 2 but "
                            f"the run in {run} used 3")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["outcome-s1"]      # no log


def test_compare_refuses_no_eval_as_there_is_then_nothing_to_tabulate(tmp_path, no_run_starts):
    with pytest.raises(SystemExit, match="^compare: --no-eval: the table is held-out success"):
        compare.main(["--rewards", "outcome", "--seeds", "1", "--out", str(tmp_path / "o"),
                      "--", "--no-eval"])
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("under", ["", "x/y", "runs"])
def test_compare_refuses_an_out_with_a_file_in_the_way(under, tmp_path, no_run_starts):
    path = tmp_path / "f"
    out = path / under if under and under != "runs" else path
    if under == "runs":                 # OUT is a folder, but OUT/runs a file
        out.mkdir()
        path = out / "runs"
    path.write_text("kept")
    with pytest.raises(SystemExit) as e:
        compare.main(["--rewards", "outcome", "--seeds", "1", "--out", str(out)])
    assert e.value.code == f"compare: --out {out}: {path} is a file, not a directory"
    assert path.read_text() == "kept"


def _set_summary(run, key, value):
    summary = json.loads((run / "summary.json").read_text())
    grpo.write_json(run / "summary.json", {**summary, key: value})


def _drop_eval(run, step):
    kept = [e for e in grpo.read_jsonl(run / "eval.jsonl") if e["step"] != step]
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept))


@pytest.mark.parametrize("damage, file, error", [
    (lambda r: (r / "summary.json").write_text(""), "summary.json", "not readable JSON"),
    (lambda r: (r / "summary.json").write_text("[]"), "summary.json", "not a JSON object"),
    (lambda r: _set_summary(r, "base", None), "summary.json", "no held-out evaluation"),
    (lambda r: _set_summary(r, "selected", {"step": "10", "success": 1}), "summary.json",
     '"selected" is not an object with an integer "step"'),
    (lambda r: _set_summary(r, "seconds", None), "summary.json", 'no number "seconds"'),
    (lambda r: _drop_eval(r, 10), "eval.jsonl", "no evaluation of step 10"),
    (lambda r: grpo.append_jsonl(r / "eval.jsonl", {"step": 30, "test": {"success": 1}}),
     "eval.jsonl", '"test" is not an object with a number "success" and a list of numbers'),
    (lambda r: (r / "eval.jsonl").write_text('{"step"\n{"step": 0}\n'), "eval.jsonl",
     "line 1 is not JSON"),
    (lambda r: (r / "metrics.jsonl").write_text(""), "metrics.jsonl", "no training step logged"),
    (lambda r: grpo.append_jsonl(r / "metrics.jsonl", {"step": 21}), "metrics.jsonl",
     "step 21: reward_mean, frac_zero_std, kl not a number"),
    (lambda r: (r / "args.json").write_text("{"), "args.json", "not readable JSON"),
    (lambda r: grpo.write_json(r / "args.json", {"env": "shop", "eval_episodes": "4"}),
     "args.json", "the run used --eval-episodes '4', where this command gives 4"),
    (lambda r: grpo.write_json(r / "args.json", {"env": "shop-long", "eval_episodes": 4}),
     "args.json", "the run used --env 'shop-long', where this command gives 'shop'")])
def test_compare_tabulating_a_damaged_run_is_one_line_naming_its_file(
        damage, file, error, tmp_path, no_run_starts):
    _finished_runs(tmp_path)
    run = tmp_path / "runs" / "outcome-s1"
    damage(run)
    with pytest.raises(SystemExit) as e:     # every run finished: straight to the table
        compare.main(["--rewards", "outcome", "--seeds", "1", "2", "--out", str(tmp_path), "--",
                      "--eval-episodes", "4"])
    assert e.value.code.startswith(f"compare: {run / file}") and error in e.value.code
    assert e.value.code.endswith(f"delete {run} and run the same command again to redo that run")
    assert "\n" not in e.value.code and not (tmp_path / "compare.md").exists()


def test_compare_tabulates_runs_of_the_built_in_policy_made_in_another_checkout(
        tmp_path, no_run_starts):
    # results/ holds runs whose args.json name the checkout that trained them
    _finished_runs(tmp_path)
    argv = ["--rewards", "outcome", "--seeds", "1", "2", "--out", str(tmp_path), "--",
            "--eval-episodes", "4"]
    for seed in (1, 2):
        grpo.write_json(tmp_path / "runs" / f"outcome-s{seed}" / "args.json", {
            "env": "shop", "eval_episodes": 4, "model": "/elsewhere/pair/data/shop-policy"})
    compare.main(argv)
    assert "| outcome |" in (tmp_path / "compare.md").read_text()
    # another policy, there or here, is another run
    (tmp_path / "compare.md").unlink()
    for model in ("/elsewhere/pair/data/shop-long-policy", "/elsewhere/pair/shop-policy"):
        grpo.write_json(tmp_path / "runs" / "outcome-s1" / "args.json", {
            "env": "shop", "eval_episodes": 4, "model": model})
        with pytest.raises(SystemExit, match=f"^compare: .*outcome-s1/args.json: the run used "
                           f"--model '{model}', where this command gives "):
            compare.main(argv)
    # and so is a policy of the user's own that was named so
    grpo.write_json(tmp_path / "runs" / "outcome-s1" / "args.json", {
        "env": "shop", "eval_episodes": 4, "model": "/elsewhere/pair/data/shop-policy"})
    with pytest.raises(SystemExit, match="^compare: .*outcome-s1/args.json: the run used --model"):
        compare.main([*argv, "--model", str(tmp_path / "data" / "shop-policy")])
    assert not (tmp_path / "compare.md").exists()


def test_compare_refuses_runs_evaluated_on_different_episodes(tmp_path, no_run_starts):
    _finished_runs(tmp_path, {**FAKE_SCORES, 2: {k: v[:3] for k, v in FAKE_SCORES[2].items()}})
    with pytest.raises(SystemExit, match="^compare: the runs were evaluated on different test "
                       r"episodes \(.*outcome-s1/args.json: 4, .*outcome-s2/eval.jsonl: 3;"):
        compare.main(["--rewards", "outcome", "--seeds", "1", "2", "--out", str(tmp_path), "--",
                      "--eval-episodes", "4"])


def test_compare_cost_names_a_run_whose_metrics_lack_the_costs(tmp_path, no_run_starts):
    _finished_runs(tmp_path)
    cost = ["--cost", "--rewards", "outcome", "--seeds", "1", "--out", str(tmp_path), "--",
            "--eval-episodes", "4"]
    # a comparison's run: trained with evaluations, perhaps beside another, so not timed alone
    with pytest.raises(SystemExit, match=r"^compare: .*outcome-s1/args.json: the run was "
                       "trained with evaluations, .* so its step times are not --cost's"):
        compare.main(cost)
    args = tmp_path / "runs" / "outcome-s1" / "args.json"
    grpo.write_json(args, {**json.loads(args.read_text()), "no_eval": True})
    with pytest.raises(SystemExit, match=r"^compare: .*outcome-s1/metrics.jsonl: step 10: "
                       "t_rollout, t_reward, t_update, gen_tokens"):
        compare.main(cost)


def test_changed_flag_reads_a_model_directory_written_another_way(tmp_path, monkeypatch):
    (tmp_path / "policy").mkdir()
    monkeypatch.chdir(tmp_path)
    args = grpo.parse_args(["--model", str(tmp_path / "policy")])
    saved = {k: getattr(args, k) for k in grpo.RESUME_KEYS}
    assert grpo.changed_flag(args, {**saved, "model": "policy"}) is None      # relative
    # a policy shipped in data/, as another checkout of the repository wrote it
    shipped = grpo.parse_args(["--env", "shop"])
    elsewhere = {**saved, "model": "/elsewhere/pair/data/shop-policy"}
    assert grpo.changed_flag(shipped, {**elsewhere, "lr": shipped.lr}) is None
    assert grpo.changed_flag(args, elsewhere)[0] == "--model"       # not a shipped policy here
    assert grpo.changed_flag(args, {**saved, "model": "other"}) == (
        "--model", str(tmp_path / "policy"), "other")
    assert grpo.changed_flag(args, {**saved, "lr": 1.0}) == ("--lr", args.lr, 1.0)


def test_student_t_quantile_equals_scipys():
    from scipy.stats import t
    for df in (1, 2, 2.5, 3, 9.7, 30, 599):
        assert compare.student_t_quantile(0.975, df) == pytest.approx(t.ppf(0.975, df), abs=1e-8)


def test_interval95_by_hand_over_the_seeds_means():
    from scipy.stats import t
    g = np.random.default_rng(0)
    x = (g.random((3, 100)) < np.array([[0.2], [0.3], [0.45]])).astype(float)
    m = x.mean(1)
    half = t.ppf(0.975, 2) * m.std(ddof=1) / np.sqrt(3)
    assert compare.interval95(x.tolist()) == pytest.approx((x.mean() - half, x.mean() + half))
    base = (g.random((3, 100)) < 0.25).astype(float)            # paired: seed by seed
    d = (x - base).mean(1)
    half = t.ppf(0.975, 2) * d.std(ddof=1) / np.sqrt(3)
    assert compare.interval95(x.tolist(), base.tolist()) == pytest.approx(
        (d.mean() - half, d.mean() + half))
    one = x[:1]                                                 # one seed: the episodes alone
    half = t.ppf(0.975, 99) * one.std(ddof=1) / 10
    assert compare.interval95(one.tolist()) == pytest.approx((one.mean() - half,
                                                              one.mean() + half))
    assert compare.interval95(x.tolist(), x.tolist()) == (0.0, 0.0)     # paired: no noise
    assert compare.interval95([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])[1] == 1.0     # clipped


@pytest.mark.parametrize("seeds", [3, 5])
@pytest.mark.parametrize("seed_sd", [0.0, 0.03, 0.1])
def test_interval95_covers_over_seeds(seeds, seed_sd):
    # Gaussian seed effects around a true mean, each seed evaluated on 300 episodes: the paired
    # difference's interval holds the true difference 95% of the time, whether the seeds or the
    # episodes carry the noise (2,000 draws: 0.95 +- 0.02 is four standard errors)
    g = np.random.default_rng(seeds * 100 + int(1000 * seed_sd))
    held, draws = 0, 2000
    for _ in range(draws):
        p_base = 0.30 + g.normal(0, seed_sd, seeds)        # 3 sd from 0 and 1: never clipped
        p_row = 0.45 + g.normal(0, seed_sd, seeds)
        base = (g.random((seeds, 300)) < p_base[:, None]).astype(float)
        row = (g.random((seeds, 300)) < p_row[:, None]).astype(float)
        lo, hi = compare.interval95(row, base)
        held += lo <= 0.15 <= hi
    assert 0.93 <= held / draws <= 0.97


def test_oversample_keeps_the_first_groups_with_something_to_say(tiny_policy, tmp_path,
                                                                 monkeypatch):
    # prompts whose training-pool index is odd get varied rewards, the others all-equal ones
    real_rewards, real_batch = pair.turn_rewards, pair.make_batch
    counter, kept = iter(range(10**6)), []

    def rewards(traj, reward, ctx, outcome_weight=0.0):
        r, p_correct = real_rewards(traj, reward, ctx, outcome_weight)
        odd = int(traj.episode.id.rsplit("-", 1)[1]) % 2
        return pair.TurnRewards(r[:-1] + [float(next(counter)) if odd else 0.5], p_correct)

    def batch(trajs, advantages, pad_id):
        kept.append([t.episode.id for t in trajs])
        return real_batch(trajs, advantages, pad_id)
    monkeypatch.setattr(pair, "turn_rewards", rewards)
    monkeypatch.setattr(pair, "make_batch", batch)
    run(flags(tiny_policy, tmp_path / "o", "outcome", steps=1, batch=2, oversample=4))
    (rec,) = metrics(tmp_path / "o")
    played = [grpo.prompt_index(3, g, 10_000) for g in range(8)]
    odd = [p for p in played if p % 2]
    want = odd[:2] if len(odd) >= 2 else None
    assert want is not None                      # seed 3's first 8 prompts hold two odd ones
    assert [int(e.rsplit("-", 1)[1]) for e in kept[0][::2]] == want
    assert rec["groups_played"] == played.index(want[1]) + 1
    assert rec["frac_zero_std"] == pytest.approx(1 - 2 / rec["groups_played"])


def test_two_runs_on_one_fresh_probe_cache_fit_the_probes_once(tiny_policy, tmp_path):
    cache = tmp_path / "fresh-cache"
    env = dict(os.environ, PAIR_CACHE=str(cache), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "lab.train",
                               *flags(tiny_policy, tmp_path / f"run{k}", "pair", steps=1)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for k in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum(o.count("fitting the probes of this policy once") for o in outs) == 1, outs
    assert len(list(cache.glob("grpo-probes/shop-*/contaminated-*/probes.json"))) == 1
    # the other one says whose probes it reads (the one it waited for, as a rule)
    other = next(o for o in outs if "fitting the probes of this policy once" not in o)
    assert "fitted by another run, which this one waited for" in other or \
        "fitted by an earlier run" in other, other


def test_resume_redoes_exactly_what_was_logged_after_the_last_checkpoint(tiny_policy, tmp_path,
                                                                         monkeypatch):
    kw = dict(steps=3, save_every=2, eval_episodes=2)
    whole = tmp_path / "whole"
    run(flags(tiny_policy, whole, "outcome", **kw))

    def evals(out):
        return [(e["step"], e["test"]["scores"]) for e in grpo.read_jsonl(out / "eval.jsonl")]

    real_step, real_eval = lab_train.train_step, probes.evaluate_all
    # 1. killed before the first checkpoint: step 1 was logged, the base model evaluated
    early = tmp_path / "early"

    def crash_at_step_2(step, *a, **k):
        if step == 1:
            raise KeyboardInterrupt
        return real_step(step, *a, **k)
    monkeypatch.setattr(lab_train, "train_step", crash_at_step_2)
    with pytest.raises(SystemExit, match="--resume"):          # Ctrl-C: how to resume
        run(flags(tiny_policy, early, "outcome", **kw))
    monkeypatch.setattr(lab_train, "train_step", real_step)
    with open(early / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward_me')                  # a line cut short by the kill
    run(flags(tiny_policy, early, "outcome", resume=True, **kw))
    assert without_timing(metrics(early)) == without_timing(metrics(whole))
    assert evals(early) == evals(whole)

    # 2. killed after checkpoint 2 was written, before it was evaluated
    late = tmp_path / "late"

    def crash_in_eval_2(step, *a, **k):
        if step == 2:
            raise KeyboardInterrupt
        return real_eval(step, *a, **k)
    monkeypatch.setattr(probes, "evaluate_all", crash_in_eval_2)
    with pytest.raises(SystemExit, match="--resume"):
        run(flags(tiny_policy, late, "outcome", **kw))
    monkeypatch.setattr(probes, "evaluate_all", real_eval)
    assert (late / "checkpoint-000002").is_dir() and [s for s, _ in evals(late)] == [0]
    summary = run(flags(tiny_policy, late, "outcome", resume=True, **kw))
    assert without_timing(metrics(late)) == without_timing(metrics(whole))
    assert evals(late) == evals(whole) and summary["final"]["step"] == 3


def test_a_damaged_log_line_before_the_last_is_a_one_line_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "reward\n{"step": 3}\n')
    with pytest.raises(SystemExit, match="line 2 is not JSON"):
        grpo.read_jsonl(path)
    # valid JSON of another shape: resuming would fail on it (a KeyError, a TypeError)
    for line in ('{"x": 1}', "[1]", '{"step": "a"}', '{"step": true}'):
        path.write_text(f'{{"step": 1}}\n{line}\n{{"step": 3}}\n')
        with pytest.raises(SystemExit, match="line 2 is not a step's record"):
            grpo.read_jsonl(path)


def test_the_base_model_is_evaluated_once_per_policy_and_evaluation_settings(
        tiny_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("PAIR_CACHE", str(tmp_path / "cache"))
    real_eval, steps = probes.evaluate_all, []

    def counted(step, *a, **k):
        steps.append(step)
        return real_eval(step, *a, **k)
    monkeypatch.setattr(probes, "evaluate_all", counted)
    kw = dict(steps=1, eval_episodes=3)

    def base(out):
        return json.loads((out / "eval.jsonl").read_text().splitlines()[0])
    run(flags(tiny_policy, tmp_path / "a", "outcome", **kw))
    assert steps == [0, 1]
    run(flags(tiny_policy, tmp_path / "b", "outcome", **{**kw, "seed": 4, "lr": 1e-3}))
    assert steps == [0, 1, 1]                           # another seed and lr: the base is known
    assert base(tmp_path / "b") == base(tmp_path / "a")    # as run a computed it
    run(flags(tiny_policy, tmp_path / "c", "outcome", **{**kw, "max_new_tokens": 6}))
    assert steps == [0, 1, 1, 0, 1]                     # other decoding: evaluated again


# ---------------------------------------------------------------------------------------------
# tree search: Tree-GRPO and AT²PO (grpo.py section 3b)

def hand_step(nll: float = 0.0) -> probes.Step:
    return probes.Step([1, 2], 0, (0, 2), "", None, None, nll=nll)


def hand_forest(n_roots: int, paths: list[tuple[int, int | None, int, list[float], float]]):
    """paths: (root, index of an earlier path it branches from or None, turns it keeps from it,
    the entropies of its own new turns, its outcome) -> (forest, trajectories)."""
    forest = baselines.Forest([baselines.Node(None, None, None, k) for k in range(n_roots)])
    trajs = []
    for root, src, kept, nlls, score in paths:
        shared = trajs[src].steps[:kept] if src is not None else []
        traj = probes.Trajectory(None, steps=shared + [hand_step(h) for h in nlls], score=score)
        parent = forest.node_of[id(shared[-1])] if shared else forest.roots[root]
        baselines.attach(forest, traj, parent, kept)
        trajs.append(traj)
    return forest, trajs


def test_tree_grpo_advantages_hand_worked():
    # tree 0: chain a (2 turns, R 1); b (R 0) and e (R 1) branch after a's turn 1;
    # tree 1: chain c (1 turn, R 0)
    forest, (a, c, b, e) = hand_forest(2, [(0, None, 0, [0, 0], 1.0), (1, None, 0, [0], 0.0),
                                           (0, 0, 1, [0, 0], 0.0), (0, 0, 1, [0], 1.0)])
    assert forest.leaf_tree == [0, 1, 0, 0]
    adv, zero = baselines.tree_grpo_advantages(forest)
    s = 0.5 / (0.5 + 1e-6)                        # inter-tree: R = [1, 0, 0, 1], mean 0.5, std 0.5
    sd = math.sqrt(2 / 9)                         # intra tree 0: R = [1, 0, 1], mean 2/3
    up, down = (1 / 3) / (sd + 1e-6), -(2 / 3) / (sd + 1e-6)
    # tree 1 has one leaf: nothing to compare it with inside its tree
    assert not zero
    assert adv == [pytest.approx([s + up] * 2), pytest.approx([-s]),
                   pytest.approx([-s + down] * 3), pytest.approx([s + up] * 2)]
    # the turn a, b and e share gets +A(a) - A(b) + A(e) in the update; the siblings below it
    # get their own: b's turn 2 is pushed down, a's and e's up
    forest, _ = hand_forest(1, [(0, None, 0, [0], 1.0), (0, None, 0, [0], 1.0)])
    assert baselines.tree_grpo_advantages(forest) == ([[0.0], [0.0]], True)


def test_at2po_values_are_entropy_weighted_means_of_the_children():
    # one root; chain a = (a1, a2) R 1, chain c = (c1) R 0, b regenerates a2 (R 0), d
    # regenerates from the root: (d1, d2) R 1
    forest, (a, c, b, d) = hand_forest(1, [(0, None, 0, [1.0, 0.5], 1.0), (0, None, 0, [0.2], 0.0),
                                           (0, 0, 1, [1.5], 0.0), (0, None, 0, [0.7, 0.1], 1.0)])
    adv, zero = baselines.at2po_advantages(forest)
    s = 0.5 / (0.5 + 1e-6)                         # leaf values: R normalized over the tree
    e1, e2 = math.exp(0.5), math.exp(1.5)          # a1's children a2 (H .5, V s), b2 (H 1.5, -s)
    v_a1 = (e1 * s - e2 * s) / (e1 + e2)
    assert not zero
    assert adv == [pytest.approx([v_a1, s]), pytest.approx([-s]), pytest.approx([v_a1, -s]),
                   pytest.approx([s, s])]          # d1 has one child: V(d1) = V(d2)
    # the root's value: the softmax over a1, c1, d1
    w = torch.softmax(torch.tensor([1.0, 0.2, 0.7], dtype=torch.float64), 0).tolist()
    assert forest.roots[0].value == pytest.approx(w[0] * v_a1 - w[1] * s + w[2] * s)


def test_at2po_expands_the_highest_entropy_turns_minus_the_branching_penalty():
    forest, (a, c, b, d) = hand_forest(1, [(0, None, 0, [1.0, 0.5], 1.0), (0, None, 0, [0.2], 0.0),
                                           (0, 0, 1, [1.5], 0.0), (0, None, 0, [0.7, 0.1], 1.0)])
    root = forest.roots[0]
    a1, d1 = forest.node_of[id(a.steps[0])], forest.node_of[id(d.steps[0])]
    # expandable: the root and the turns with a child, breadth first (leaves a2, b2, c1, d2 not)
    assert baselines.inner_nodes(root) == [root, a1, d1]
    # root: 0 - 0.05 x 2 own children but one; a1: 1.0 - 0.05 x 2 siblings; d1: 0.7 - 0.1
    assert [baselines.at2po_score(n, 0.05) for n in (root, a1, d1)] == \
        pytest.approx([-0.1, 0.9, 0.6])
    args = argparse.Namespace(tree_n=4, at2po_penalty=0.05)
    points = baselines.at2po_points(forest, args, None)
    # a regenerated turn is a new sibling: parent, the rollout that holds its context, turns kept
    # (ranked a1, d1, root; fewer candidates than K are cycled from the top; the root's context
    # is held by its first chain)
    assert points == [(root, a, 0), (root, d, 0), (root, a, 0), (root, a, 0)]


def test_tree_grpo_draws_expandable_nodes_and_continues_after_them():
    forest, (a, c, b) = hand_forest(2, [(0, None, 0, [0, 0, 0], 1.0), (1, None, 0, [0], 0.0),
                                        (0, 0, 1, [0], 0.0)])
    g = torch.Generator().manual_seed(0)
    points = baselines.tree_grpo_points(forest, argparse.Namespace(tree_n=200), g)
    tree0, tree1 = points[:200], points[200:]
    a1, a2 = (forest.node_of[id(s)] for s in a.steps[:2])
    # tree 0: the root (a fresh chain), a1 (2 children), a2; never a leaf; uniform draws
    assert {p[0].depth for p in tree0} == {0, 1, 2}
    assert {(p[0] is forest.roots[0], p[2]) for p in tree0} == {(True, 0), (False, 1),
                                                                (False, 2)}
    assert all(p[1] is a for p in tree0)           # a holds every context of tree 0
    assert 40 < sum(p[0] is a1 for p in tree0) < 95
    # tree 1 is one turn: only its root can be expanded
    assert all(p == (forest.roots[1], c, 0) for p in tree1)


def test_a_branch_from_a_copied_cache_equals_a_fresh_prefill(tiny_policy, monkeypatch):
    policy, tok = mdl.load_model(tiny_policy)
    env = envs.ShopEnv("train")
    args = play_args(max_turns=4, max_new_tokens=12)
    caches = []
    chains = probes.rollout(policy, tok, [env.episode(5) for _ in range(3)], args,
                            generator=torch.Generator().manual_seed(0), caches=caches)
    i = max(range(3), key=lambda k: len(chains[k].steps))
    owner = chains[i]
    assert len(owner.steps) >= 3 and owner.steps[0].observation
    copied = []
    real_copy = baselines.copy_rows
    monkeypatch.setattr(baselines, "copy_rows", lambda *a: (copied.append(a[-1]), real_copy(*a)))
    for kept in (0, 1, 2):                         # the prompt; after an observation, twice
        forest = baselines.Forest([baselines.Node(None, None, None, 0)])
        forest.caches[id(owner)] = (caches[0], i)
        baselines.attach(forest, owner, forest.roots[0], 0)
        parent = forest.node_of[id(owner.steps[kept - 1])] if kept else forest.roots[0]
        baselines.grow(policy, tok, lambda: env.episode(5), forest, [(parent, owner, kept)], args,
                       torch.Generator().manual_seed(11), stats=True)
        branch = forest.leaves[-1]
        context = owner.segments[0][:owner.steps[kept].span[0]]
        assert copied[-1] == len(context) - 1       # the prefix is copied, one token re-fed
        # the same continuation from a fresh prefill of the whole context
        fresh = probes.Trajectory(baselines.fork_episode(lambda: env.episode(5), owner, kept),
                                  steps=list(owner.steps[:kept]))
        probes.play(policy, tok, [fresh], policy.new_cache(1), [context], args,
                    generator=torch.Generator().manual_seed(11), stats=True)
        assert branch.segments == fresh.segments and branch.steps[:kept] == owner.steps[:kept]
        assert branch.score == fresh.score and len(branch.steps) == len(fresh.steps) > kept
        for x, y in zip(branch.steps[kept:], fresh.steps[kept:]):
            assert x.tokens == y.tokens and x.observation == y.observation
            torch.testing.assert_close(torch.tensor(x.trace.logprobs),
                                       torch.tensor(y.trace.logprobs), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(x.trace.h_last, y.trace.h_last, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(x.trace.h_mean, y.trace.h_mean, atol=1e-5, rtol=1e-5)
            for name in mdl.STATS:
                torch.testing.assert_close(x.trace.attn_stats[name], y.trace.attn_stats[name], atol=1e-5,
                                           rtol=1e-5)
        # and the tree: the branch's new turns hang below the parent
        assert forest.node_of[id(branch.steps[kept])].parent is parent


def test_a_branch_from_before_a_rewritten_history_prefills_only_what_differs(tiny_policy,
                                                                             monkeypatch):
    # ToolBench's history cap: the owner's cache row holds its last segment only
    policy, tok = mdl.load_model(tiny_policy)

    def episode():
        return rewriting_episode(score=None)
    args = play_args(max_turns=3)
    caches = []
    (owner,) = probes.rollout(policy, tok, [episode()], args,
                              generator=torch.Generator().manual_seed(0), caches=caches)
    assert [s.segment for s in owner.steps] == [0, 0, 1]
    copied = []
    real_copy = baselines.copy_rows
    monkeypatch.setattr(baselines, "copy_rows", lambda *a: (copied.append(a[-1]), real_copy(*a)))
    for kept in (1, 2):
        forest = baselines.Forest([baselines.Node(None, None, None, 0)])
        forest.caches[id(owner)] = (caches[0], 0)
        baselines.attach(forest, owner, forest.roots[0], 0)
        baselines.grow(policy, tok, episode, forest, [(forest.node_of[id(owner.steps[kept - 1])],
                                                       owner, kept)], args,
                       torch.Generator().manual_seed(5), stats=True)
        branch = forest.leaves[-1]
        at = owner.steps[kept]
        context = owner.segments[at.segment][:at.span[0]]
        shared = baselines.common_prefix(context, owner.segments[-1])
        assert copied[-1] == min(shared, len(context) - 1)
        assert (shared < len(context)) == (kept == 1)   # turn 2 was played before the rewrite
        fresh = probes.Trajectory(baselines.fork_episode(episode, owner, kept),
                                  segments=[list(x) for x in owner.segments[:at.segment]] + [[]],
                                  steps=list(owner.steps[:kept]))
        probes.play(policy, tok, [fresh], policy.new_cache(1), [context], args,
                    generator=torch.Generator().manual_seed(5), stats=True)
        assert branch.segments == fresh.segments
        for x, y in zip(branch.steps[kept:], fresh.steps[kept:]):
            assert x.tokens == y.tokens
            torch.testing.assert_close(x.trace.h_last, y.trace.h_last, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(x.trace.attn_stats["prefix"], y.trace.attn_stats["prefix"],
                                       atol=1e-5, rtol=1e-5)


def test_turn_loss_matches_a_direct_computation():
    # two turns of one trajectory, one turn of another; logp_old differs: the ratios move
    g = torch.Generator().manual_seed(0)
    N = 7
    turn = torch.tensor([3, 3, 3, 9, 9, 20, 20])
    weight = torch.tensor([1 / 5] * 5 + [1 / 2] * 2, dtype=torch.float64)
    logp = (torch.randn(N, generator=g, dtype=torch.float64) - 1).requires_grad_()
    # turn 3's ratio leaves the trust region upwards with A > 0 (clipped); the others do not
    logp_old = logp.detach() - torch.tensor([0.004, 0.006, 0.008, 0.0, 0.002, -0.001, -0.003],
                                            dtype=torch.float64)
    logp_ref = logp.detach() + 0.1 * torch.randn(N, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, 2.0, 2.0], dtype=torch.float64)
    lo, hi, beta = 3e-3, 4e-3, 0.05
    loss, sums = baselines.turn_loss(logp, logp_old, logp_ref, adv, turn, weight, (lo, hi), beta,
                                     n_tokens=7.0, n_seqs=2.0)
    loss.backward()
    total, grad, clipped = 0.0, [0.0] * N, 0
    lp, lo_, lr = logp.tolist(), logp_old.tolist(), logp_ref.tolist()
    for k in (3, 9, 20):
        idx = [t for t in range(N) if turn[t] == k]
        s = math.exp(sum(lp[t] - lo_[t] for t in idx) / len(idx))   # the turn's ratio
        a = adv[idx[0]].item()
        active = (a >= 0 and s > 1 + hi) or (a < 0 and s < 1 - lo)
        clipped += active * len(idx)
        for t in idx:
            surrogate = ((1 + hi) if a >= 0 else (1 - lo)) * a if active else s * a
            total += -surrogate * weight[t].item() / 2
            # a token's gradient is its own: s x d logp_t, none when clipped
            grad[t] += 0.0 if active else -s * a * weight[t].item() / 2
    for t in range(N):
        total += beta * (math.exp(lr[t] - lp[t]) - (lr[t] - lp[t]) - 1) / 7
        grad[t] += beta * (1 - math.exp(lr[t] - lp[t])) / 7
    assert loss.item() == pytest.approx(total, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=torch.float64))
    assert clipped == 3 and sums["clip"] == clipped


@pytest.mark.parametrize("reward", ["tree_grpo", "at2po"])
def test_tree_search_runs_and_resumes_exactly(reward, tiny_policy, tmp_path, monkeypatch):
    kw = dict(steps=3, save_every=2, group=4, max_turns=3, tree_l=1 if reward == "at2po" else None)
    whole = tmp_path / "whole"
    run(flags(tiny_policy, whole, reward, **kw))
    recs = metrics(whole)
    # defaults from --group 4: tree_grpo M 2, N 2 (6 leaves); at2po M 2, K 1
    args = json.loads((whole / "args.json").read_text())
    assert (args["tree_m"], args["tree_n"]) == ((2, 2) if reward == "tree_grpo" else (2, 1))
    for rec in recs:
        assert rec["branch_rollouts"] == args["tree_n"] * (2 if reward == "tree_grpo" else 1)
        assert rec["gen_tokens"] >= rec["branch_tokens"] > 0 and rec["mem_kv_mb"] > 0
        assert rec["tokens"] >= rec["gen_tokens"]      # a turn shared by k leaves counts k times
        # the sibling rollouts are the reward's time, not a base read's (there is none)
        assert rec["t_base_read"] < rec["t_reward"] / 2
    cut = tmp_path / "cut"
    interrupted_run(monkeypatch, flags(tiny_policy, cut, reward, **kw))
    with pytest.raises(SystemExit, match="--tree-n"):
        run(flags(tiny_policy, cut, reward, resume=True, **dict(kw, tree_n=3)))
    run(flags(tiny_policy, cut, reward, resume=True, **kw))
    assert without_timing(metrics(cut)) == without_timing(recs)


def test_tree_search_refuses_an_outcome_weight_and_an_empty_budget(tiny_policy, tmp_path,
                                                                   capsys):
    with pytest.raises(SystemExit, match="--outcome-weight"):
        run(flags(tiny_policy, tmp_path / "a", "at2po", outcome_weight=0.5))
    with pytest.raises(SystemExit):
        run(flags(tiny_policy, tmp_path / "b", "tree_grpo", tree_l=0))
    assert "--tree-l must be at least 1" in capsys.readouterr().err


def test_compare_cost_measures_what_each_reward_adds(tiny_policy, tmp_path):
    out = tmp_path / "cost"
    per_run = ["--model", str(tiny_policy), "--steps", "1", "--group", "4", "--max-turns", "2",
               "--max-new-tokens", "8"]
    result = compare.main(["--cost", "--rewards", "outcome", "igpo", "tree_grpo", "at2po",
                           "--seeds", "1", "--out", str(out), "--", *per_run])
    rows = {r["reward"]: r for r in result["rows"]}
    assert not any((out / "runs" / name / "eval.jsonl").exists() for name in
                   ("outcome-s1", "igpo-s1"))                 # no evaluation: time only
    assert rows["outcome"]["tf_rows"] == rows["outcome"]["branch_rollouts"] == 0
    # igpo teacher-forces one row per turn state
    assert rows["igpo"]["tf_rows"] == rows["igpo"]["gen_turns"] > 0
    # tree_grpo: 2 trees x 2 branches; at2po: 2 rounds of 1 (G = 4)
    assert rows["tree_grpo"]["branch_rollouts"] == 4 and rows["at2po"]["branch_rollouts"] == 2
    for r in rows.values():
        assert r["gen_tokens"] > 0 and r["mem_kv_mb"] > 0 and r["t_reward"] >= 0
    text = (out / "cost.md").read_text()
    assert "| tree_grpo |" in text and "~5-25 s" in text and "K sibling rollouts" in text
    assert "4.0 sibling rollouts" in text and "~30-50 ms" in text


@pytest.mark.parametrize("damage", ["rng-json-list", "negative-step", "deep-trainer-json",
                                    "deep-adapter-config"])
def test_a_damaged_checkpoint_is_one_line_naming_it(tiny_policy, tmp_path, damage, capsys):
    out = tmp_path / "r"
    run(flags(tiny_policy, out, steps=2, save_every=1))
    ckpt = out / "checkpoint-000002"                     # the newest: the one resumed from
    stale = (ckpt / grpo.MANIFEST).read_text()
    if damage == "rng-json-list":
        (ckpt / "rng-0.json").write_text("[]")
    elif damage == "negative-step":
        info = json.loads((ckpt / "trainer.json").read_text())
        (ckpt / "trainer.json").write_text(json.dumps({**info, "step": -2}))
    elif damage == "deep-trainer-json":
        (ckpt / "trainer.json").write_text("[" * 100000)
    else:
        (ckpt / "adapter" / "adapter_config.json").write_text("[" * 100000)
    # written so (its manifest agrees): what its files say is refused, naming the file read
    grpo.write_manifest(ckpt)
    read = {"rng-json-list": "rng-0.json", "deep-adapter-config": "adapter"}.get(damage,
                                                                                 "trainer.json")
    with pytest.raises(SystemExit, match=re.escape(f"{ckpt / read}: cannot resume from this "
                                                   "checkpoint")):
        run(flags(tiny_policy, out, steps=2, save_every=1, resume=True))
    assert all(r["step"] > 0 for r in metrics(out))      # nothing logged for a bogus step
    # changed after it was written (its manifest disagrees): passed over, named, and the run
    # resumes from the checkpoint before it
    (ckpt / grpo.MANIFEST).write_text(stale)
    changed = {"rng-json-list": "rng-0.json",
               "deep-adapter-config": "adapter/adapter_config.json"}.get(damage, "trainer.json")
    capsys.readouterr()
    run(flags(tiny_policy, out, steps=2, save_every=1, resume=True))
    said = capsys.readouterr().out
    assert f"warning: checkpoint-000002 is damaged ({ckpt / changed}: changed since" in said
    assert f"resumed from {out / 'checkpoint-000001'} at step 1" in said
    assert [r["step"] for r in metrics(out)] == [1, 2] and grpo.damage(ckpt) is None


def test_deeply_nested_json_is_one_line_everywhere(tiny_policy, tmp_path):
    deep = "[" * 100000
    bad_model = tmp_path / "model"
    shutil.copytree(tiny_policy, bad_model)
    (bad_model / "config.json").write_text(deep)
    with pytest.raises(mdl.CheckpointError, match="config.json: not readable JSON"):
        mdl.load_model(bad_model)
    data = tmp_path / "matched_clean_test.json"
    data.write_text(deep)
    with pytest.raises(envs.DataError, match="matched_clean_test.json: not valid JSON"):
        lab_data.load_matched(data)
    (tmp_path / "pairdir").mkdir()
    (tmp_path / "pairdir" / "pair.json").write_text(deep)
    with pytest.raises(probes.FormatError, match="pair.json: not JSON"):
        pair.Pair.load(tmp_path / "pairdir")
    out = tmp_path / "run"
    out.mkdir()
    (out / "args.json").write_text(deep)
    with pytest.raises(SystemExit, match="args.json is not readable"):
        run(flags(tiny_policy, out, steps=1, resume=True))


def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_last_one(tiny_policy, tmp_path,
                                                                        monkeypatch):
    out = tmp_path / "r"
    real, calls = grpo.save_file, []

    def full_at_second_checkpoint(tensors, path, *a, **k):
        calls.append(path)
        if "checkpoint-000002" in str(path):
            raise OSError(28, "No space left on device")
        return real(tensors, path, *a, **k)
    monkeypatch.setattr(grpo, "save_file", full_at_second_checkpoint)
    with pytest.raises(SystemExit, match="checkpoint-000002: could not be written .*No space "
                                         ".*checkpoint-000001 is intact"):
        run(flags(tiny_policy, out, steps=2, save_every=1))
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == \
        ["checkpoint-000001"]
    assert (out / "checkpoint-000001" / "trainer.json").is_file()


def test_a_damaged_probe_cache_fails_before_any_rollout(tiny_policy, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAIR_CACHE", str(cache))
    run(flags(tiny_policy, tmp_path / "a", "pair", steps=1))
    (pair_dir,) = cache.glob("grpo-probes/shop-*/contaminated-*/pair")
    stage1 = probes.Probe.load(pair_dir / "stage1.safetensors")
    stage1.mean, stage1.scale, stage1.w = stage1.mean[:8], stage1.scale[:8], stage1.w[:8]
    stage1.save(pair_dir / "stage1.safetensors")                   # cut to width 8
    with pytest.raises(SystemExit, match="the stage1 probe reads 8 features, this policy gives"):
        run(flags(tiny_policy, tmp_path / "b", "pair", steps=1))
    (report,) = cache.glob("grpo-probes/shop-*/contaminated-*/probes.json")
    report.write_text("{}")
    with pytest.raises(SystemExit, match="probes.json: a damaged probe cache"):
        run(flags(tiny_policy, tmp_path / "c", "pair", steps=1))


def test_compare_draws_each_of_twelve_rewards_with_a_line_of_its_own():
    rows = [{"reward": f"r{i}", "curve_success": [(0, 0.1), (5, 0.2 + i / 100)]}
            for i in range(12)]
    svg = curves.curves_svg({"rows": rows})
    style = r'stroke="#\w+"(?: stroke-dasharray="[\d,]+")?'
    lines = re.findall(f"<polyline [^>]*?({style})", svg)
    legend = re.findall(f'<line [^>]*?({style}) stroke-width="3"/><text[^>]*>r\\d+<', svg)
    assert len(set(lines)) == 12 and legend == lines
    assert len({re.search(r'"(#\w+)"', s)[1] for s in lines}) == 12     # a color each, too


def test_curves_keep_whole_labels_and_a_tick_below_the_lowest_point():
    rows = [{"reward": name, "curve_reward": [(1, 0.353), (2, 0.61)]}
            for name in ("pair:probe-corpus=contaminated", "pair:advantage=release", "outcome")]
    svg = curves.curves_svg({"rows": rows})
    assert all(f">{r['reward']}</text>" in svg for r in rows)             # no label cut
    ticks = [float(v) for v in re.findall(r'text-anchor="end">([\d.]+)<', svg)]
    assert min(ticks) <= 0.353 and max(ticks) >= 0.61, ticks


def test_a_run_draws_its_curves_with_distinct_round_ticks(tiny_policy, tmp_path):
    out = tmp_path / "r"
    run(flags(tiny_policy, out, steps=4, save_every=2, eval_episodes=3))
    assert not (out / "curves.svg").exists()          # the core run draws none: lab.curves does
    curves.main([str(out)])
    svg = (out / "curves.svg").read_text()
    assert svg.count("<polyline") == 3 and "</svg>" in svg         # success vs step, vs s; reward
    for ticks in ([0.04, 0.3], [0.11, 0.18], [1, 4]):
        values = curves.nice_ticks(*ticks, integer=ticks == [1, 4])
        assert len(set(values)) == len(values) and values == sorted(values)
        steps = {round(b - a, 12) for a, b in zip(values, values[1:])}
        assert len(steps) == 1                           # evenly spaced
    assert curves.nice_ticks(1, 4, integer=True) == [1, 2, 3, 4]  # not "1, 2, 2, 3, 4"


# ---------------------------------------------------------------------------------------------
# --probe-retrain-every: the head refitted on the policy's own turns, exactly on resume

def refit_flags(out, reward="pair", **kw):
    opts = {"model": BUILTIN, "reward": reward, "out": out, "steps": 4, "batch": 2, "group": 4,
            "max_turns": 6, "save_every": 1, "probe_corpus": "contaminated",
            "probe_episodes": 10, "corpus_heldout": 3, "corpus_samples": 2, "no_eval": True,
            "threads": 1, "probe_retrain_every": 2, **kw}
    argv = []
    for k, v in opts.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return argv


def test_probe_retrain_refits_stage_2_on_the_named_steps_own_turns(tmp_path, monkeypatch):
    windows, real = [], onpolicy.refit

    def spy(head, window, seed):
        new, rep = real(head, window, seed)
        windows.append((head, window, new))
        return new, rep
    monkeypatch.setattr(onpolicy, "refit", spy)
    out = tmp_path / "r"
    run(refit_flags(out))
    recs = metrics(out)
    assert [r["step"] for r in recs if "refit_turns" in r] == [2, 4]      # every 2 steps only
    for (head, window, new), r in zip(windows, (recs[:2], recs[2:])):
        # the window is the two steps' turns, every one of them, labelled by the world
        assert len(window.y) == sum(round(x["turns"] * 8) for x in r) == r[1]["refit_turns"]
        assert 0 < int(window.y.sum()) < len(window.y)
        assert new is not None and new.stage1 is head.stage1         # stage 1 stays
        assert not torch.equal(new.stage2.w, head.stage2.w)
        assert r[1]["refit_auroc_after"] >= r[1]["refit_auroc_before"] - 1e-9
    assert windows[1][0] is windows[0][2]               # the second refit starts from the first
    saved = pair.Pair.load(out / "refit" / "head-000004")
    assert torch.equal(saved.stage2.w, windows[1][2].stage2.w)
    assert sorted(p.name for p in (out / "refit").iterdir()) == \
        ["head-000002", "head-000004"]      # turns no resume needs are gone at the checkpoints
    # the refitted head is the one read: step 3 differs from a run without refits, 1-2 do not
    plain = tmp_path / "plain"
    run(refit_flags(plain, probe_retrain_every=0, steps=3))
    other = metrics(plain)
    assert without_timing(other[:2]) == without_timing([
        {k: v for k, v in r.items() if not k.startswith("refit_")} for r in recs[:2]])
    assert other[2]["reward_mean"] != recs[2]["reward_mean"]


def test_probe_retrain_resumes_exactly(tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    run(refit_flags(whole, reward="last_token", steps=5, save_every=3))
    assert (whole / "refit" / "head-000004" / "probe.safetensors").is_file()
    cut = tmp_path / "cut"
    real = lab_train.train_step

    def crash_at_step_5(step, *a, **k):     # after checkpoint 3, the refit after 4 done
        if step == 4:
            raise KeyboardInterrupt
        return real(step, *a, **k)
    monkeypatch.setattr(lab_train, "train_step", crash_at_step_5)
    with pytest.raises(SystemExit, match="--resume"):
        run(refit_flags(cut, reward="last_token", steps=5, save_every=3))
    monkeypatch.setattr(lab_train, "train_step", real)
    assert (cut / "refit" / "head-000004").is_dir()     # after the checkpoint: redone
    run(refit_flags(cut, reward="last_token", steps=5, save_every=3, resume=True))
    assert without_timing(metrics(cut)) == without_timing(metrics(whole))
    for name in ("head-000002", "head-000004"):
        a, b = (probes.Probe.load(d / "refit" / name / "probe.safetensors") for d in (whole, cut))
        assert torch.equal(a.w, b.w) and torch.equal(a.mean, b.mean)


def test_probe_retrain_from_a_checkpoint_whose_turns_are_gone_stops(tmp_path):
    out = tmp_path / "r"
    kw = dict(reward="last_token", steps=6, save_every=3, probe_retrain_every=4)
    run(refit_flags(out, **kw))         # checkpoint 6 removed the turns of steps 1-4
    (out / "checkpoint-000006" / "trainer.json").unlink()       # damaged: resume from 3
    with pytest.raises(SystemExit, match="turns-000001-r0.safetensors is gone"):
        run(refit_flags(out, resume=True, **kw))


def test_probe_retrain_is_refused_where_there_is_nothing_to_refit(tmp_path, capsys):
    with pytest.raises(SystemExit, match="reads no probe"):
        run(refit_flags(tmp_path / "a", reward="outcome"))
    with pytest.raises(SystemExit, match="only the built-in world"):
        run(refit_flags(tmp_path / "b", env="gta"))
    with pytest.raises(SystemExit):
        run(refit_flags(tmp_path / "c", probe_retrain_every=-1))
    assert "--probe-retrain-every must be at least 0, got -1" in capsys.readouterr().err


def test_shop_long_is_a_world_of_its_own(tiny_policy, tmp_path, monkeypatch):
    played, real = [], probes.rollout

    def spy(policy, tok, episodes, args, **kw):
        played.extend(e.id for e in episodes)
        return real(policy, tok, episodes, args, **kw)
    for module in (probes, onpolicy):
        monkeypatch.setattr(module, "rollout", spy)
    out = tmp_path / "r"
    run(flags(tiny_policy, out, "pair", env="shop-long", steps=1, eval_episodes=2))
    saved = json.loads((out / "args.json").read_text())
    assert saved["env"] == "shop-long"
    for model in (tiny_policy, shop.LONG_WORLD.policy):          # any policy: 16 turns
        args = lab_train.parse_args(["--env", "shop-long", "--model", str(model), "--out", "x"])
        grpo.resolve_preset(args, pair.Processes(), lab_train.WORLDS)
        assert args.max_turns == lab_train.WORLDS["shop-long"].max_turns == 16
    assert played and all(eid.startswith("shop-long-") for eid in played)
    caches = [p.name for p in (Path(os.environ["PAIR_CACHE"]) / "grpo-probes").iterdir()]
    assert any(name.startswith("shop-long-") for name in caches)
    with pytest.raises(SystemExit, match="shop-long-policy is missing"):
        monkeypatch.setitem(lab_train.WORLDS, "shop-long", dataclasses.replace(
            shop.LONG_WORLD, policy=tmp_path / "shop-long-policy"))
        run(["--env", "shop-long", "--out", str(tmp_path / "x"), "--threads", "1"])


def test_a_max_len_with_no_room_for_a_first_turn_is_refused(tiny_policy, tmp_path):
    with pytest.raises(SystemExit, match="^--max-len 20: a task's prompt alone is .* tokens"):
        run(flags(tiny_policy, tmp_path / "r", "outcome", max_len=20))
    assert not (tmp_path / "r").exists()


def test_an_on_policy_corpus_of_one_class_is_one_line_naming_the_flags(tiny_policy, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("PAIR_CACHE", str(tmp_path / "cache"))
    # a random policy's own turns are all wrong
    with pytest.raises(SystemExit, match="^error: --probe-corpus on-policy: all 16 turns .* are "
                                         "wrong, and a probe needs both"):
        run(flags(tiny_policy, tmp_path / "r", "pair", probe_corpus="on-policy",
                  corpus_episodes=4))
    assert not (tmp_path / "r").exists()


def test_a_run_refused_before_its_first_step_leaves_nothing_behind(tiny_policy, tmp_path,
                                                                   monkeypatch):
    def damaged(*a, **k):
        raise probes.FormatError("probes.json: damaged")
    monkeypatch.setattr(onpolicy, "shop_probes", damaged)     # after OUT is claimed
    out = tmp_path / "r"
    with pytest.raises(SystemExit, match="^error: probes.json: damaged"):
        run(flags(tiny_policy, out, "pair"))
    assert not out.exists()
    out.mkdir()                         # a folder of the user's own files is refused, untouched
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="holds other files, not a run"):
        run(flags(tiny_policy, out, "pair"))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "notes.txt").unlink()
    monkeypatch.undo()
    monkeypatch.setenv("PAIR_CACHE", str(tmp_path / "cache"))
    run(flags(tiny_policy, out, "pair", steps=1))              # the next run starts cleanly
    assert [r["step"] for r in metrics(out)] == [1]
    # given probes with a file missing: one line naming it, and nothing left behind
    pair_dir = next((tmp_path / "cache" / "grpo-probes").rglob("stage2.safetensors")).parent
    shutil.copytree(pair_dir, tmp_path / "probes")
    (tmp_path / "probes" / "stage2.safetensors").unlink()
    with pytest.raises(SystemExit, match="^error: .*stage2.safetensors"):
        run(flags(tiny_policy, tmp_path / "r2", "pair", probes=tmp_path / "probes"))
    assert not (tmp_path / "r2").exists()


def test_micro_batches_bound_rows_and_padded_tokens():
    """At most `rows` consecutive rows and rows x longest <= tokens per micro-batch; a row over
    the token bound goes alone."""
    assert pair.micro_batches([5, 5, 5, 5, 5], 4, 100) == [[0, 1, 2, 3], [4]]
    assert pair.micro_batches([10, 30, 20, 70, 5, 5], 4, 60) == [[0, 1], [2], [3], [4, 5]]
    assert pair.micro_batches([10, 30, 20, 200, 5], 4, 90) == [[0, 1, 2], [3], [4]]
    assert pair.micro_batches([], 4, 90) == []


def test_the_built_in_policies_run_on_one_thread_unless_told(tmp_path):
    """Two torch threads of a model this small wait for each other spinning, and beside any other
    busy process a run went 1.8 to 40 times slower: the built-in policies' preset takes one
    thread, --threads overrides it, and any other model keeps torch's choice."""
    def resolved(*argv, loop=grpo, worlds=envs.WORLDS):
        args = loop.parse_args([*argv, "--out", str(tmp_path / "r")])
        grpo.resolve_preset(args, pair.Processes(rank=1), worlds)
        return args.threads
    assert resolved() == 1
    assert resolved("--env", "shop-long", loop=lab_train, worlds=lab_train.WORLDS) == 1
    assert resolved("--threads", "2") == 2
    assert resolved("--model", str(tmp_path)) is None
