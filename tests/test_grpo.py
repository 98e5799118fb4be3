"""grpo.py on tiny CPU models: advantages, loss, rollouts, checkpoints, processes, every reward."""
import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

import envs
import grpo
import model as mdl

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"t_rollout", "t_reward", "t_update"}


# ---------------------------------------------------------------------------------------------
# fixtures: a tiny random policy with a BPE tokenizer trained on shop text

@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("policy")
    torch.manual_seed(0)
    dialogs = grpo.sft_dialogs(10, 0.3, seed=1)
    tok = mdl.Tokenizer(grpo.train_tokenizer([grpo._chat(m) for m in dialogs], 300))
    shape = argparse.Namespace(hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2)
    config = grpo.sft_config(shape, tok)
    policy = mdl.Transformer(mdl.Config.from_dict(config))
    with torch.no_grad():        # opinionated random weights: varied rollouts, real gradients
        for p in policy.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    grpo.save_policy(out, policy, tok, config)
    return out


@pytest.fixture(scope="session")
def pair_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("pair-cache")


@pytest.fixture(autouse=True)
def _cache(pair_cache, monkeypatch):
    monkeypatch.setenv("PAIR_CACHE", str(pair_cache))     # probes fitted on the fly go here


def flags(policy, out, reward="coe", **kw) -> list[str]:
    opts = {"model": policy, "reward": reward, "out": out, "steps": 2, "group": 2,
            "max_turns": 2, "max_new_tokens": 8, "lr": 1e-2, "save_every": 1,
            "probe_episodes": 10, "seed": 3, "threads": 1, **kw}
    argv = []
    for k, v in opts.items():
        if v is True:
            argv.append(f"--{k.replace('_', '-')}")
        elif v is not None and v is not False:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv + (["--no-eval"] if "eval_episodes" not in kw else [])


def run(argv) -> dict:
    return grpo.main(argv)


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def play_args(**kw):
    return argparse.Namespace(**{"max_turns": 3, "max_new_tokens": 8, "max_len": 4096,
                                 "temperature": 1.0, "top_p": 1.0, **kw})


def lora_policy(model_dir, flags: list[str]):
    """The policy with its LoRA adapter, the parsed flags (preset filled) and the shop train env."""
    policy, tok = mdl.load_model(model_dir)
    args = grpo.train_parser().parse_args(flags)
    grpo.resolve_preset(args, grpo.World())
    grpo.add_lora(policy, args)
    return policy, tok, args, envs.make("shop", split="train")


# ---------------------------------------------------------------------------------------------
# advantages (SPEC §9), hand-worked

def test_advantages_dense_steps():
    # pooled r = [1, 0, 0.5]: mean 0.5, population std sqrt(1/6)
    adv, zero = grpo.group_advantages([[1.0, 0.0], [0.5]])
    s = 0.5 / (math.sqrt(1 / 6) + 1e-6)
    assert not zero
    # turn 1 of rollout 0: r^_1 + r^_2 = s - s; turn 2: -s; rollout 1: 0
    assert adv[0] == pytest.approx([0.0, -s], abs=1e-12)
    assert adv[1] == pytest.approx([0.0], abs=1e-12)


def test_advantages_outcome_is_group_normalized_outcome_on_every_turn():
    rewards = [[None, None, 1.0], [None, 0.0], [1.0], [None, None, None, 0.0]]
    adv, zero = grpo.group_advantages(rewards)
    s = 0.5 / (0.5 + 1e-6)          # outcomes [1, 0, 1, 0]: mean 0.5, std 0.5
    assert not zero
    assert adv == [pytest.approx([s] * 3), pytest.approx([-s] * 2), pytest.approx([s]),
                   pytest.approx([-s] * 4)]


def test_advantages_all_equal_group_is_zero_and_flagged():
    for rewards in ([[0.3, 0.3], [0.3]], [[None, 1.0], [1.0]], [[0.1 + 0.2, 0.3]]):
        adv, zero = grpo.group_advantages(rewards)
        assert zero and adv == [[0.0] * len(r) for r in rewards]
    assert grpo.group_advantages([[0.3, 0.3], [0.3000001]])[1] is False


# ---------------------------------------------------------------------------------------------
# the loss (SPEC §9) against a direct re-computation, gradient included

def test_loss_and_gradient_match_direct_computation():
    g = torch.Generator().manual_seed(0)
    N, eps, beta, n_tokens = 64, 0.2, 0.05, 80.0      # n_tokens: the whole batch, not this part
    logp = (torch.randn(N, generator=g, dtype=torch.float64) - 2).requires_grad_()
    logp_old = logp.detach() + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    logp_ref = logp.detach() + 0.2 * torch.randn(N, generator=g, dtype=torch.float64)
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    loss, sums = grpo.grpo_loss(logp, logp_old, logp_ref, adv, eps, beta, n_tokens)
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
    full = torch.log_softmax(policy(ids).logits / 0.7, -1)             # (B, T, V)
    direct = torch.cat([full[b, j - 1, ids[b, j]][None] for b in range(2) for j in range(12)
                        if mask[b, j]])
    torch.testing.assert_close(grpo.token_logprobs(policy, ids, mask, 0.7), direct)


# ---------------------------------------------------------------------------------------------
# rollouts: one KV cache per group across turns, statistics from the generation pass

def test_rollout_appends_turns_to_one_cache_and_traces_equal_teacher_forcing(tiny_policy):
    policy, tok = mdl.load_model(tiny_policy)
    env = envs.make("shop", split="train")
    episodes = [env.episode(5), env.episode(5), env.episode(6)]
    prompts = [tok.render(ep.messages, add_generation_prompt=True)[0] for ep in episodes]
    trajs = grpo.rollout(policy, tok, episodes, play_args(),
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
                opening = grpo.turn_opening(tok, step.trace.finished, step.observation)
                assert seq[e:e + len(opening)] == opening
                pos += len(opening)
            # the reward's statistics came from generation; teacher forcing gives the same
            tf = mdl.trace_forward(policy, seq[:e], (s, e))
            torch.testing.assert_close(step.trace.h_last, tf.h_last, atol=1e-4, rtol=1e-4)
            for name in mdl.STATS:
                torch.testing.assert_close(step.trace.attn[name], tf.attn[name], atol=1e-4,
                                           rtol=1e-4)
        assert pos == len(seq)
        assert traj.score == traj.episode.score()


def test_rollout_survives_a_reply_with_a_lone_surrogate_escape(tiny_policy, monkeypatch):
    # Plain ASCII from the policy whose JSON escape decodes to half a UTF-16 pair: the episode gets
    # an error observation and the rollout goes on.
    policy, tok = mdl.load_model(tiny_policy)
    hostile = 'Thought: x\nAction: Lookup\nAction Input: {"store": "\\ud800", "item": "tea"}'
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: hostile)
    episodes = [envs.make("shop", split="train").episode(0)]
    (traj,) = grpo.rollout(policy, tok, episodes, play_args(max_turns=2),
                           generator=torch.Generator().manual_seed(0))
    assert len(traj.steps) == 2 and traj.steps[0].observation.startswith("Observation: Invalid")


def test_rollout_refills_the_cache_when_the_environment_rewrites_history(tiny_policy):
    # ToolBench's history cap rewrites old observations in place (StepResult.rewritten_from)
    policy, tok = mdl.load_model(tiny_policy)

    class Rewriting(envs.Episode):
        def call_tool(self, name, arguments):
            return "x" * 50

        def _after_observation(self):
            if len(self.steps) == 2:
                self.messages[2]["content"] = "Observation: [elided]"
                return 2
            return None

        def score(self):
            return 0.0

    def episode():
        ep = Rewriting("r", "Add 1 and 2.", envs.SHOP_TOOLS)
        # every turn a valid action, whatever the model writes
        ep.step = lambda text, step=ep.step: step(
            'Action: Calculator\nAction Input: {"expression": "1+2"}')
        return ep
    (traj,) = grpo.rollout(policy, tok, [episode()], play_args(max_turns=3),
                           generator=torch.Generator().manual_seed(0))
    assert len(traj.segments) == 2 and [s.segment for s in traj.steps] == [0, 0, 1]
    first, second = traj.segments
    assert tok.decode(second).count("[elided]") == 1 and "[elided]" not in tok.decode(first)
    last = traj.steps[-1]
    tf = mdl.trace_forward(policy, second[:last.span[1]], last.span)
    torch.testing.assert_close(last.trace.h_last, tf.h_last, atol=1e-4, rtol=1e-4)
    batch = grpo.make_batch([traj], [[1.0, 2.0, 3.0]], tok.pad_id)
    assert batch.ids.shape[0] == 2 and batch.mask.sum() == sum(len(s.tokens) for s in traj.steps)
    assert batch.adv[1][batch.mask[1]].unique().tolist() == [3.0]


def test_batch_masks_exactly_the_generated_tokens_eos_included():
    ep = envs.make("shop", split="train").episode(0)
    traj = grpo.Trajectory(ep, segments=[[7, 7, 7, 1, 2, 99, 7, 7, 3, 99, 7]])
    for (s, e) in ((3, 6), (8, 10)):
        traj.steps.append(grpo.Step(traj.segments[0][s:e], 0, (s, e), "", None, None))
    batch = grpo.make_batch([traj], [[0.5, -1.0]], pad_id=0)
    assert batch.mask[0].tolist() == [False] * 3 + [True] * 3 + [False] * 2 + [True] * 2 + [False]
    assert batch.adv[0].tolist() == [0, 0, 0, .5, .5, .5, 0, 0, -1, -1, 0]


# ---------------------------------------------------------------------------------------------
# the update: KL = 0 and rho = 1 before the first step, then the adapter moves

def test_first_update_has_zero_kl_and_unit_ratio(tiny_policy):
    policy, tok, args, env = lora_policy(tiny_policy, ["--lr", "1e-2", "--micro-batch", "1"])
    trajs = grpo.rollout(policy, tok, [env.episode(1) for _ in range(3)], play_args(),
                         generator=torch.Generator().manual_seed(0))
    adv = [[float(i + t) for t in range(len(tr.steps))] for i, tr in enumerate(trajs)]
    batch = grpo.make_batch(trajs, adv, tok.pad_id)
    opt = torch.optim.AdamW([p for _, p in mdl.lora_parameters(policy)], lr=1e-2)
    policy.train()
    stats = grpo.update(policy, opt, batch, args, grpo.World())
    assert stats["kl"] == 0.0 and stats["ratio"] == 1.0 and stats["clip_frac"] == 0.0
    n = batch.mask.sum().item()
    # rho = 1 and KL = 0: the loss is minus the token-averaged advantage
    assert stats["loss"] == pytest.approx(-batch.adv[batch.mask].sum().item() / n, rel=1e-5)
    assert stats["tokens"] == n and stats["grad_norm"] > 0
    again = grpo.update(policy, opt, batch, args, grpo.World())
    assert again["kl"] > 0 and again["ratio"] == pytest.approx(1.0)     # new pi_old, new ratio


# ---------------------------------------------------------------------------------------------
# checkpoints and --resume

def test_resume_reproduces_the_uninterrupted_run(tiny_policy, tmp_path, monkeypatch):
    kw = dict(steps=4, save_every=2, lora_dropout=0.05)
    whole = tmp_path / "whole"
    run(flags(tiny_policy, whole, **kw))

    cut = tmp_path / "cut"
    real = grpo.train_step

    def crash_at_step_3(step, *a, **k):
        if step == 2:
            raise KeyboardInterrupt
        return real(step, *a, **k)
    monkeypatch.setattr(grpo, "train_step", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run(flags(tiny_policy, cut, **kw))
    monkeypatch.setattr(grpo, "train_step", real)
    with pytest.raises(SystemExit, match="--out .* already holds a run"):
        run(flags(tiny_policy, cut, **kw))
    with pytest.raises(SystemExit, match="--lr"):
        run(flags(tiny_policy, cut, resume=True, **dict(kw, lr=0.5)))
    run(flags(tiny_policy, cut, resume=True, **kw))

    assert without_timing(metrics(cut)) == without_timing(metrics(whole))
    assert len(metrics(whole)) == 4 and metrics(whole)[-1]["kl"] > 0
    ckpt = cut / "checkpoint-000004"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "adapter", "optimizer.safetensors", "rng-0.json", "rng-0.safetensors", "trainer.json"]
    assert sorted(p.name for p in (ckpt / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    assert not list(cut.glob(".*tmp*"))
    a = mdl.load_adapter(mdl.load_model(tiny_policy)[0], whole / "checkpoint-000004" / "adapter")
    b = mdl.load_adapter(mdl.load_model(tiny_policy)[0], ckpt / "adapter")
    for (name, p), (_, q) in zip(mdl.lora_parameters(a), mdl.lora_parameters(b)):
        assert torch.equal(p, q), name


def test_resume_checks_args_json(tiny_policy, tmp_path):
    def prepare(out, **kw):
        args = grpo.train_parser().parse_args(flags(tiny_policy, out, **kw))
        grpo.resolve_preset(args, grpo.World())
        return grpo.prepare_out(args, grpo.World())

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


def test_a_bad_model_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="error: .*no-model: not a checkpoint directory"):
        run(flags(tmp_path / "no-model", tmp_path / "a"))


def test_a_truncated_checkpoint_is_a_one_line_error(tiny_policy, tmp_path):
    out = tmp_path / "b"
    run(flags(tiny_policy, out, steps=1))
    opt = out / "checkpoint-000001" / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:50])
    with pytest.raises(SystemExit, match="cannot resume from this checkpoint"):
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
    monkeypatch.setattr(grpo, "evaluate", no_evaluation)
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

def test_two_processes_equal_one_process(tiny_policy, tmp_path, pair_cache):
    kw = dict(batch=2, steps=2, lora_dropout=0.0, save_every=2)
    env = dict(os.environ, PAIR_CACHE=str(pair_cache), OMP_NUM_THREADS="1")
    one, two = tmp_path / "one", tmp_path / "two"
    for out, launcher in ((one, [sys.executable]),
                          (two, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc_per_node", "2"])):
        r = subprocess.run(launcher + [str(ROOT / "grpo.py")] + flags(tiny_policy, out, **kw),
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    m1, m2 = metrics(one), metrics(two)
    assert [m["step"] for m in m2] == [1, 2]
    for a, b in zip(m1, m2):
        for k in ("reward_mean", "reward_std", "success", "loss", "kl", "grad_norm", "tokens",
                  "frac_zero_std", "turns"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-7), k
    pa = mdl.load_adapter(mdl.load_model(tiny_policy)[0], one / "checkpoint-000002" / "adapter")
    pb = mdl.load_adapter(mdl.load_model(tiny_policy)[0], two / "checkpoint-000002" / "adapter")
    for (name, p), (_, q) in zip(mdl.lora_parameters(pa), mdl.lora_parameters(pb)):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-4, msg=name)


def test_two_runs_on_one_out_one_refuses(tiny_policy, tmp_path, pair_cache):
    # Both start at once: without a lock both pass the "already holds a run" check and write
    # interleaved metrics and checkpoints of two seeds.
    out = tmp_path / "run"
    env = dict(os.environ, PAIR_CACHE=str(pair_cache), OMP_NUM_THREADS="1")
    runs = [subprocess.Popen([sys.executable, str(ROOT / "grpo.py"),
                              *flags(tiny_policy, out, steps=3, seed=seed)], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for seed in (1, 2)]
    results = [(r.wait(timeout=300), r.stderr.read()) for r in runs]
    refused = [err for rc, err in results if rc != 0]
    assert len(refused) == 1 and f"{out} is in use by pid" in refused[0], results
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]


def test_kill_9_frees_the_out_of_a_run(tiny_policy, tmp_path, pair_cache):
    out = tmp_path / "run"
    args = grpo.train_parser().parse_args(flags(tiny_policy, out, steps=1000, resume=True))
    grpo.resolve_preset(args, grpo.World())
    env = dict(os.environ, PAIR_CACHE=str(pair_cache), OMP_NUM_THREADS="1")
    first = subprocess.Popen([sys.executable, str(ROOT / "grpo.py"),
                              *flags(tiny_policy, out, steps=1000)], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.perf_counter()
        while not (out / "metrics.jsonl").exists():
            assert time.perf_counter() - t0 < 120 and first.poll() is None
            time.sleep(0.05)
        with pytest.raises(SystemExit, match=f"{out} is in use by pid {first.pid}"):
            grpo.prepare_out(args, grpo.World())
    finally:
        first.send_signal(signal.SIGKILL)       # no cleanup runs: the kernel drops the lock
        first.wait()
    assert grpo.prepare_out(args, grpo.World()) == out


# ---------------------------------------------------------------------------------------------
# every --reward that needs no network: a short run each

OFFLINE = [r for r in grpo.REWARDS if r != "llm_judge"]


@pytest.mark.parametrize("reward", OFFLINE)
def test_every_offline_reward_runs(reward, tiny_policy, tmp_path):
    out = tmp_path / reward
    summary = run(flags(tiny_policy, out, reward, steps=1, eval_episodes=2,
                        outcome_weight=0.5 if reward == "pair" else None))
    (rec,) = metrics(out)
    assert math.isfinite(rec["reward_mean"]) and math.isfinite(rec["loss"])
    assert rec["tokens"] > 0 and rec["turn_rewards"]
    if reward in ("pair", *grpo.PROBE_REWARDS):
        assert "probe_auroc" in rec
        bound = 1.5 if reward == "pair" else 1.0            # + 0.5 x task score on pair
        assert all(0 <= r <= bound for r in rec["turn_rewards"] if r is not None)
    if reward == "outcome":          # one reward per rollout: its task score
        assert rec["reward_mean"] == pytest.approx(rec["success"])
    assert summary["base"]["episodes"] == 2 and summary["final"]["step"] == 1


@pytest.mark.parametrize("reward", ["outcome", "igpo"])
def test_gta_replay_runs(reward, release_dir, tiny_policy, tmp_path):
    # igpo reads the gold answer from the released gold dialog
    out = tmp_path / reward
    summary = run(flags(tiny_policy, out, reward, env="gta", data_dir=release_dir, steps=1,
                        eval_episodes=2))
    (rec,) = metrics(out)
    assert rec["tokens"] > 0 and math.isfinite(rec["loss"]) and "probe_auroc" not in rec
    assert summary["base"]["episodes"] == 2


def test_probe_cache_is_reused(tiny_policy, tmp_path, pair_cache):
    run(flags(tiny_policy, tmp_path / "a", "last_token", steps=1))
    cached = list((pair_cache / "grpo-probes").glob("shop-*/probes.json"))
    assert len(cached) == 1
    before = cached[0].stat().st_mtime_ns
    run(flags(tiny_policy, tmp_path / "b", "multi_attn", steps=1))
    assert cached[0].stat().st_mtime_ns == before
    report = json.loads(cached[0].read_text())
    assert set(report["auroc"]) >= {"pair", "last_token", "multi_attn"}


def test_igpo_rewards_are_gold_probability_gains(tiny_policy):
    policy, tok = mdl.load_model(tiny_policy)
    env = envs.make("shop", split="train")
    args = play_args(micro_batch=2, reward="igpo", outcome_weight=0.0)
    (traj,) = grpo.rollout(policy, tok, [env.episode(2)], args,
                           generator=torch.Generator().manual_seed(0))
    ctx = grpo.RewardContext(policy, tok, args, env=env)
    rewards = grpo.igpo_reward(traj, ctx)
    answer = env.episode(2).task.answer
    assert grpo.gold_answer(ctx, traj.episode) == answer

    def p_gold(prefix):        # geometric-mean probability of the answer tokens, directly
        head = tok.encode("Final Answer:")
        target = tok.encode(" " + answer)
        ids = torch.tensor([prefix + head + target])
        logp = torch.log_softmax(policy(ids).logits[0], -1)
        n = len(target)
        return math.exp(sum(logp[ids.shape[1] - n - 1 + k, target[k]].item()
                            for k in range(n)) / n)
    p = [p_gold(traj.segments[0][:s.span[0]]) for s in traj.steps]
    expected = [p[t + 1] - p[t] for t in range(len(p) - 1)] + [traj.score]
    assert rewards == pytest.approx(expected, rel=1e-4, abs=1e-7)


def test_tips_reads_the_lagged_teacher(tiny_policy):
    policy, tok, args, env = lora_policy(tiny_policy, ["--micro-batch", "2", "--reward", "tips"])
    (traj,) = grpo.rollout(policy, tok, [env.episode(3)], play_args(),
                           generator=torch.Generator().manual_seed(0))
    base = grpo.lora_state(policy)                      # B = 0: the teacher is the base model
    with torch.no_grad():
        for _, p in mdl.lora_parameters(policy):
            p.add_(0.3)                                  # the policy has moved on since
    moved = grpo.lora_state(policy)
    ctx = grpo.RewardContext(policy, tok, args, env=env, lagged=base)
    rewards = grpo.tips_reward(traj, ctx)
    assert all(torch.equal(moved[n], p) for n, p in mdl.lora_parameters(policy))   # restored
    states = grpo.traj_states(traj)
    answer = grpo.gold_answer(ctx, traj.episode)
    with mdl.lora_disabled(policy):
        phi, _ = grpo.gold_logprobs(policy, tok, states, answer, 1)
    expected = [phi[t + 1] - phi[t] for t in range(len(phi) - 1)] + [traj.score]
    assert rewards == pytest.approx(expected, rel=1e-5, abs=1e-6)
    phi_moved, _ = grpo.gold_logprobs(policy, tok, states, answer, 1)
    assert phi_moved != pytest.approx(phi, rel=1e-3)


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


# ---------------------------------------------------------------------------------------------
# the built-in policy: deterministic training, loadable output

def test_sft_is_deterministic_and_loadable(tmp_path):
    tiny = ["--episodes", "10", "--steps", "3", "--batch", "2", "--hidden", "16", "--layers",
            "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "32", "--vocab", "300",
            "--eval-episodes", "0", "--threads", "1", "--induction-steps", "3"]
    for name in ("a", "b"):
        grpo.main(["sft", "--out", str(tmp_path / name)] + tiny)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):   # README: timings
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    policy, tok = mdl.load_model(tmp_path / "a")
    assert policy.config.arch == "Qwen2ForCausalLM" and policy.config.tie_word_embeddings
    assert tok.decode(tok.encode("<|im_start|>user\n3 apple<|im_end|>")) == \
        "<|im_start|>user\n3 apple<|im_end|>"
    assert "python grpo.py sft --env shop" in (tmp_path / "a" / "README.md").read_text()


def test_cli_help_lists_every_reward():
    r = subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--help"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0
    for name in grpo.REWARDS:
        assert name in r.stdout
