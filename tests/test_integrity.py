"""Nothing damaged is used silently: a checkpoint verifies itself (its manifest, then what its
files say) before a run resumes from it, a damaged one is named and passed over, and a failed
command leaves no lock behind. Each test damages a real checkpoint of a short core run."""
import contextlib
import io
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import grpo

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = ROOT / "data" / "shop-policy"


def flags(out) -> list[str]:
    return ["--model", str(BUILTIN), "--reward", "outcome", "--out", str(out), "--steps", "3",
            "--group", "2", "--batch", "2", "--max-turns", "2", "--max-new-tokens", "8",
            "--lr", "1e-2", "--save-every", "1", "--seed", "3", "--threads", "1", "--no-eval"]


def metrics(out) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("t_")}
            for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 3-step run with a checkpoint after every step, and its metrics."""
    out = tmp_path_factory.mktemp("run") / "run"
    grpo.main(flags(out))
    return out, metrics(out)


def copy_run(finished, tmp_path) -> Path:
    """The finished run, copied, as if it had stopped after step 3's checkpoint was written."""
    import shutil
    out, _ = finished
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    (copy / "summary.json").unlink()
    return copy


def rewrite_manifest(ckpt: Path) -> None:
    """The manifest written again after a damage: the files then agree with it, and only what
    they say can refuse them."""
    grpo.write_manifest(ckpt)


def resume(out) -> tuple[int, str]:
    """`python grpo.py --resume --out OUT`, in this process: its exit code and all it said (an
    unexpected exception would fail the test with its traceback)."""
    said = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            grpo.main(["--resume", "--out", str(out)])
        except SystemExit as e:
            code = 1
            print(e.code)
    return code, said.getvalue()


def test_every_checkpoint_has_a_manifest_of_its_files(finished):
    out, _ = finished
    for ckpt in sorted(out.glob("checkpoint-*")):
        listed = json.loads((ckpt / grpo.MANIFEST).read_text())["files"]
        assert sorted(listed) == grpo.checkpoint_files(ckpt)
        assert "adapter/adapter_model.safetensors" in listed and "trainer.json" in listed
        assert grpo.damage(ckpt) is None


@pytest.mark.parametrize("how", ["flip a sign", "truncate", "delete", "add a file"])
def test_a_damaged_checkpoint_is_named_and_the_run_resumes_from_the_one_before(
        finished, tmp_path, how):
    out = copy_run(finished, tmp_path)
    last = out / "checkpoint-000003"
    adapter = last / "adapter" / "adapter_model.safetensors"
    if how == "flip a sign":             # one float of the adapter: same size, other bytes
        tensors = load_file(adapter)
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] *= -1
        save_file(tensors, adapter)
    elif how == "truncate":
        adapter.write_bytes(adapter.read_bytes()[:-100])
    elif how == "delete":
        adapter.unlink()
    else:
        (last / "notes.txt").write_text("not the checkpoint's")
    assert grpo.damage(last) is not None and grpo.damage(out / "checkpoint-000002") is None
    code, said = resume(out)
    assert code == 0, said[-2000:]
    assert "checkpoint-000003 is damaged" in said and str(last) in said
    assert "resumed from" in said and "checkpoint-000002 at step 2" in said
    # the step redone from checkpoint 2 is the step the uninterrupted run logged
    assert metrics(out) == finished[1]


def test_no_intact_checkpoint_is_refused_in_one_line(finished, tmp_path):
    out = copy_run(finished, tmp_path)
    for ckpt in out.glob("checkpoint-*"):
        (ckpt / "trainer.json").write_text("{}")
    code, said = resume(out)
    assert code != 0 and "no checkpoint in" in said and "is intact" in said
    assert "Traceback" not in said


def damage_then_resume(finished, tmp_path, change) -> str:
    """Checkpoint 3 changed by change(ckpt), its manifest rewritten: the one-line refusal."""
    out = copy_run(finished, tmp_path)
    ckpt = out / "checkpoint-000003"
    change(ckpt)
    rewrite_manifest(ckpt)
    code, said = resume(out)
    assert code != 0 and "Traceback" not in said, said[-2000:]
    return said


def edit_trainer(key_path, value):
    def change(ckpt):
        info = json.loads((ckpt / "trainer.json").read_text())
        target = info
        for key in key_path[:-1]:
            target = target[key]
        target[key_path[-1]] = value
        (ckpt / "trainer.json").write_text(json.dumps(info))
    return change


def test_a_checkpoint_whose_step_is_not_its_directorys_is_refused(finished, tmp_path):
    said = damage_then_resume(finished, tmp_path, edit_trainer(["step"], 2))
    assert "checkpoint-000003/trainer.json: cannot resume" in said and "step 2" in said


def test_an_optimizer_whose_settings_are_not_the_runs_is_refused(finished, tmp_path):
    def change(ckpt):
        info = json.loads((ckpt / "trainer.json").read_text())
        info["optimizer"]["param_groups"][0]["betas"] = [0.9, 0.99]
        (ckpt / "trainer.json").write_text(json.dumps(info))
    said = damage_then_resume(finished, tmp_path, change)
    assert "trainer.json: cannot resume" in said and "betas" in said


@pytest.mark.parametrize("value, what", [(float("inf"), "exp_avg"), (float("nan"), "exp_avg"),
                                         (-7.7e37, "exp_avg_sq"), (-2.0, "step")])
def test_optimizer_state_not_finite_or_out_of_range_is_refused(finished, tmp_path, value, what):
    # inf or nan anywhere, a negative second moment (its square root is taken) or a negative
    # step count: each once resumed into a crash or into other results
    def change(ckpt):
        path = ckpt / "optimizer.safetensors"
        tensors = load_file(path)
        key = sorted(k for k in tensors if k.endswith("." + what))[0]
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[0] = value
        save_file(tensors, path)
    said = damage_then_resume(finished, tmp_path, change)
    assert "optimizer.safetensors: cannot resume" in said and what in said


def test_a_garbled_file_is_named_not_its_folder(finished, tmp_path):
    said = damage_then_resume(finished, tmp_path,
                              lambda ckpt: (ckpt / "rng-0.json").write_text("{not json"))
    assert "checkpoint-000003/rng-0.json: cannot resume" in said


def test_a_failed_core_command_leaves_no_lock(tmp_path, monkeypatch):
    # a run that fails once OUT is locked (here: a write error in its first step)
    def fail(step, run):
        raise OSError(f"{run.out}: no space left on device")
    monkeypatch.setattr(grpo, "train_step", fail)
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match="no space left"):
        grpo.main(flags(out))
    assert not (out / ".lock").exists() and not grpo.LOCKS


def test_a_failed_lab_command_leaves_no_lock(tmp_path):
    # the lab's claim (runs.exclusive_dir, around an extraction or a fit) lets its directory go
    # on failure as on success: the lock file is removed, a nested claim keeps it
    from lab.infra import runs
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with runs.exclusive_dir(out):
            with runs.exclusive_dir(out):           # nested: the outer claim still holds it
                pass
            assert (out / runs.LOCK_FILE).exists() and runs.holds(out)
            raise RuntimeError("the extraction failed")
    assert not (out / runs.LOCK_FILE).exists() and not runs.holds(out)
