"""grpo.update_policy's three lines no equality test of the loss sees: the gradient-norm
clip, the warmup of the learning rate, and log pi taken at the sampling temperature. Each test
fails when its line is removed (AdamW hides a uniform rescale of the gradient, a 20-step run
warms up for one step, and a run at T = 1 cannot tell the temperatures apart)."""
import argparse
import json
from pathlib import Path

import pytest
import torch

import envs
import grpo
import model as mdl
import pair
import probes

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ROOT / "data" / "shop-policy"       # the built-in shop policy (~0.3M parameters)


# ---------------------------------------------------------------------------------------------
# How these tests reach grpo.py: every call into it is here, so that a change of its signatures
# is made in this one place.

def lora_policy(flags: list[str]):
    """(test_grpo.lora_policy on the built-in policy) The policy with a fresh LoRA adapter, the
    parsed flags (preset filled) and the shop train env."""
    policy, tok = mdl.load_model(BUILTIN)
    args = grpo.train_parser().parse_args([*flags, "--model", str(BUILTIN)])
    grpo.resolve_preset(args, pair.Processes())
    mdl.apply_lora(policy, r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout,
                   targets=tuple(args.lora_targets.split(",")))
    return policy, tok, args, envs.ShopEnv("train")


def run_update(policy, optimizer, batch: pair.Batch, args) -> dict:
    """One call of the update on one process; returns its logged statistics."""
    run = argparse.Namespace(policy=policy, optimizer=optimizer, args=args,
                             objective=pair.ADVANTAGES[args.advantage], procs=pair.Processes())
    return grpo.update_policy(run, batch)


def lr_at(step: int, args) -> float:
    return grpo.lr_at(step, args)


def train_recording_lr(monkeypatch, argv: list[str]) -> list[float]:
    """A training run (grpo.main) whose every update first records the learning rate of each of
    the optimizer's parameter groups: the lr its AdamW step runs at, one list per step."""
    seen, real = [], grpo.update_policy

    def spy(run, batch):
        seen.append([group["lr"] for group in run.optimizer.param_groups])
        return real(run, batch)
    monkeypatch.setattr(grpo, "update_policy", spy)
    grpo.main(argv)
    return seen


def record_policy_logprobs(monkeypatch) -> list[torch.Tensor]:
    """The log pi the update's loss differentiates, as it computes them: every call of
    model.token_logprobs with gradients on (the reference's runs under no_grad), detached."""
    calls, real = [], mdl.token_logprobs

    def spy(policy, ids, mask, temperature=1.0):
        logp = real(policy, ids, mask, temperature)
        if torch.is_grad_enabled():
            calls.append(logp.detach().clone())
        return logp
    monkeypatch.setattr(mdl, "token_logprobs", spy)
    return calls


# ---------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def play_args(**kw):
    return argparse.Namespace(**{"max_turns": 2, "max_new_tokens": 16, "max_len": 4096,
                                 "temperature": 1.0, "top_p": 1.0, **kw})


def rollouts(policy, tok, env, temperature: float) -> list[probes.Trajectory]:
    """Three sampled rollouts of two shop episodes, with every turn's traces (logprobs)."""
    policy.eval()
    trajs = probes.rollout(policy, tok, [env.episode(1), env.episode(1), env.episode(4)],
                           play_args(temperature=temperature),
                           generator=torch.Generator().manual_seed(0))
    assert sum(len(step.tokens) for traj in trajs for step in traj.steps) > 20
    return trajs


def varied_advantages(trajs) -> list[list[float]]:
    return [[(-1.0) ** i * (1.0 + 0.5 * t) for t in range(len(traj.steps))]
            for i, traj in enumerate(trajs)]


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that records, at each step, the global L2 norm of its parameters' gradients: the
    gradient it is handed, after whatever the update did to it."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.norms = []

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"]
                 if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        self.norms.append(norm.item())
        return super().step(closure)


# ---------------------------------------------------------------------------------------------
# the gradient-norm clip: AdamW's step is invariant to a uniform rescale of the gradient (up to
# its eps), so a removed clip changes no loss, no logged grad_norm and barely the adapter

def test_the_optimizer_steps_on_the_gradient_clipped_to_grad_clip():
    clip = 1e-3
    policy, tok, args, env = lora_policy(["--grad-clip", str(clip), "--micro-batch", "2"])
    trajs = rollouts(policy, tok, env, args.temperature)
    batch = pair.make_batch(trajs, varied_advantages(trajs), tok.pad_id)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = RecordingAdamW(params, lr=args.lr)
    policy.train()
    stats = run_update(policy, optimizer, batch, args)
    # the logged grad_norm is the norm before the clip; the step saw the clipped gradient
    assert stats["grad_norm"] > 100 * clip
    assert optimizer.norms == [pytest.approx(clip, rel=1e-4)]
    # a clip far above the gradient leaves it whole: the recorder measures what grad_norm logs
    args.grad_clip = 1e6
    stats = run_update(policy, optimizer, batch, args)
    assert optimizer.norms[1] == pytest.approx(stats["grad_norm"], rel=1e-5)
    assert stats["grad_norm"] > 100 * clip


# ---------------------------------------------------------------------------------------------
# the warmup: linear over the first --warmup fraction of the steps, then constant. At --steps 2
# or 20 the paper's 5% is one step, which is no warmup at all

def test_lr_warms_up_linearly_over_the_first_5_percent_of_500_steps():
    args = argparse.Namespace(lr=3e-7, warmup=0.05, steps=500)
    schedule = [lr_at(step, args) for step in range(500)]
    assert schedule == pytest.approx([3e-7 * min(1.0, (step + 1) / 25) for step in range(500)],
                                     rel=1e-12)
    assert schedule[0] == pytest.approx(3e-7 / 25)
    assert schedule[23] < schedule[24] == 3e-7


def test_the_training_loop_runs_each_step_at_its_warmup_lr(tmp_path, monkeypatch):
    # 50 one-token steps of one rollout: 10% warmup is 5 steps, then the constant lr
    out = tmp_path / "r"
    lr = 1e-3
    seen = train_recording_lr(monkeypatch, [
        "--model", str(BUILTIN), "--reward", "outcome", "--out", str(out), "--steps", "50",
        "--warmup", "0.1", "--lr", str(lr), "--batch", "1", "--group", "1", "--max-turns", "1",
        "--max-new-tokens", "1", "--save-every", "50", "--no-eval", "--threads", "1"])
    want = [lr * min(1.0, (step + 1) / 5) for step in range(50)]
    assert len(seen) == 50 and all(len(groups) == 1 for groups in seen)
    assert [groups[0] for groups in seen] == pytest.approx(want, rel=1e-12)
    logged = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# the temperature of log pi: the tokens were drawn from softmax(logits / T), so the ratio and
# the KL are of that distribution (--advantage process); the release takes T = 1 whatever it
# sampled at. Every other test of the update samples at T = 1, where the two agree

def independent_logprobs(policy, batch: pair.Batch, T: float) -> torch.Tensor:
    """log softmax(logits / T) of each policy token, from one plain forward: (N,), row-major."""
    with torch.no_grad():
        full = torch.log_softmax(policy(batch.ids) / T, dim=-1)           # (B, L, V)
    picked = full[:, :-1].gather(-1, batch.ids[:, 1:, None]).squeeze(-1)   # (B, L - 1)
    return picked[batch.mask[:, 1:]]


@pytest.mark.parametrize("advantage, T, other", [("process", 0.7, 1.0), ("release", 1.0, 0.7)])
def test_the_update_takes_log_pi_at_the_sampling_temperature(advantage, T, other, monkeypatch):
    policy, tok, args, env = lora_policy(["--advantage", advantage, "--temperature", "0.7",
                                          "--micro-batch", "2", "--lora-dropout", "0"])
    with torch.no_grad():   # a trained-looking adapter: the policy is not the reference
        for name, p in mdl.lora_parameters(policy):
            p.normal_(0, 0.02 if "lora_B" in name else 0.3)
    trajs = rollouts(policy, tok, env, 0.7)
    batch = pair.make_batch(trajs, varied_advantages(trajs), tok.pad_id)
    expected = independent_logprobs(policy, batch, T)
    # the two temperatures differ on these tokens by more than any tolerance below
    assert (expected - independent_logprobs(policy, batch, other)).abs().max() > 0.1
    calls = record_policy_logprobs(monkeypatch)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad],
                                  lr=args.lr)
    policy.train()
    stats = run_update(policy, optimizer, batch, args)
    logp = torch.cat(calls)                 # one epoch: the micro-batches' rows in order
    torch.testing.assert_close(logp, expected, rtol=1e-5, atol=1e-5)
    assert stats["ratio"] == pytest.approx(1.0)
    if advantage == "process":      # what the rollout recorded as it sampled each token
        sampled = torch.tensor([lp for traj in trajs for step in traj.steps
                                for lp in step.trace.logprobs])
        torch.testing.assert_close(logp, sampled, rtol=1e-4, atol=1e-4)
