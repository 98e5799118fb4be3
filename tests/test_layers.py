"""The house: the five core files import each other in one order, model -> probes -> pair ->
envs -> grpo, and nothing else of the project (lab/ not even inside a function); the lab imports
the core, never the reverse; and the core runs alone."""
import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ("model", "probes", "pair", "envs", "grpo")


def imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function ("lab.x" for the lab's)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"lab.{a.name}" for a in node.names} if node.module == "lab" else \
                {node.module}
    return {name.split(".")[0] if name.split(".")[0] != "lab" else name for name in found}


def test_the_top_level_is_the_five_core_files():
    assert sorted(p.stem for p in ROOT.glob("*.py")) == sorted(CORE)


def test_the_core_imports_down_its_order_and_never_the_lab():
    for k, name in enumerate(CORE):
        project = {m for m in imports(ROOT / f"{name}.py") if m in CORE or m.startswith("lab")}
        assert project <= set(CORE[:k]), f"{name}.py imports {sorted(project - set(CORE[:k]))}"


def test_the_lab_imports_the_core_and_its_own_files_only():
    lab = {p.stem for p in (ROOT / "lab").glob("*.py")}
    for path in (ROOT / "lab").glob("*.py"):
        for m in imports(path):
            if m.startswith("lab."):
                assert m[4:] in lab, f"{path.name} imports {m}, which does not exist"


def test_the_core_runs_without_the_lab():
    # a fresh interpreter that imports grpo alone: the lab's rewards are not there, the core's are
    code = ("import sys, grpo; assert not any(m.startswith('lab') for m in sys.modules); "
            "print(sorted(grpo.pair.REWARDS))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "'pair'" in r.stdout and "'outcome'" in r.stdout and "'igpo'" not in r.stdout


def test_every_lab_command_plugs_the_lab_in_itself(tmp_path):
    # the suite plugs the lab in once (conftest); a command run alone must do it itself: its
    # runs are checked against the lab's rewards and flags before any starts
    r = subprocess.run([sys.executable, "-m", "lab.compare", "--rewards", "igpo", "tree_grpo",
                        "--seeds", "42", "--out", str(tmp_path / "c"), "--", "--steps", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode != 0 and "--steps must be at least 1, got 0" in r.stderr, r.stderr
    assert "unknown reward" not in r.stderr and not (tmp_path / "c").exists()


def test_a_lab_reward_asked_of_the_core_says_where_it_runs():
    r = subprocess.run([sys.executable, "grpo.py", "--reward", "igpo"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "invalid choice: 'igpo'" in r.stderr
    assert "run through `python -m lab.train`" in r.stderr
    # a lab flag too: --probe-reads base is the lab's
    r = subprocess.run([sys.executable, "grpo.py", "--probe-reads", "base"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unrecognized arguments: --probe-reads base" in r.stderr
    assert "run through `python -m lab.train`" in r.stderr


def test_a_command_runs_after_every_definition_of_its_file():
    """`if __name__ == "__main__"` is a module's last statement: a definition after it does not
    exist yet when the command runs (`python -m lab.study extract` once failed that way)."""
    for path in [*ROOT.glob("*.py"), *(ROOT / "lab").glob("*.py")]:
        body = ast.parse(path.read_text()).body
        mains = [i for i, node in enumerate(body) if isinstance(node, ast.If)
                 and "__main__" in ast.unparse(node.test)]
        assert mains in ([], [len(body) - 1]), f"{path.name}: definitions after its __main__ block"
