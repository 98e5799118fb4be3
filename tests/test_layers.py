"""The house: the five core files import each other in one order, model -> probes -> pair ->
envs -> grpo, and nothing else of the project (lab/ not even inside a function); the lab imports
the core, never the reverse, and changes none of it by being imported; the core runs alone, has
no hooks, and reads as prose and plain statements."""
import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ("model", "probes", "pair", "envs", "grpo")


def imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function ("lab.x" or "lab.pkg.x" for
    the lab's: `from lab.pkg import x` names the module x when lab/pkg/x.py exists)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                module = f"{node.module}.{a.name}"
                is_file = (ROOT / (module.replace(".", "/") + ".py")).is_file()
                found.add(module if node.module.startswith("lab") and is_file else node.module)
    return {name.split(".")[0] if name.split(".")[0] != "lab" else name for name in found}


def lab_modules() -> dict[str, Path]:
    """Every module of the lab by its name under lab ("train", "worlds.shop"; a package's
    __init__ by the package's name)."""
    found = {}
    for path in (ROOT / "lab").rglob("*.py"):
        parts = path.relative_to(ROOT / "lab").with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            found[".".join(parts)] = path
    return found


def test_the_top_level_is_the_five_core_files():
    assert sorted(p.stem for p in ROOT.glob("*.py")) == sorted(CORE)


def test_the_core_imports_down_its_order_and_never_the_lab():
    for k, name in enumerate(CORE):
        project = {m for m in imports(ROOT / f"{name}.py") if m in CORE or m.startswith("lab")}
        assert project <= set(CORE[:k]), f"{name}.py imports {sorted(project - set(CORE[:k]))}"


def test_the_lab_imports_the_core_and_its_own_files_only():
    lab = lab_modules()
    for path in lab.values():
        for m in imports(path):
            if m.startswith("lab."):
                assert m[4:] in lab, f"{path.name} imports {m}, which does not exist"


def test_the_lab_tells_its_commands_from_its_libraries():
    # a command is a file at lab/'s top level, run as `python -m lab.NAME`, ending in its
    # __main__ block; a library lies in a sub-package, runs nothing and imports no command; a
    # world (lab/worlds/) imports no recipe, method or probing code, only other worlds' files
    lab = lab_modules()
    for name, path in lab.items():
        body = ast.parse(path.read_text()).body
        runs = any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
                   for node in body)
        library = "." in name or path.name == "__init__.py"
        assert runs != library, f"lab/{path.relative_to(ROOT / 'lab')}: " + (
            "a library with a __main__ block" if library else "a command without one")
        if not library:
            continue
        for m in imports(path):
            if m.startswith("lab.") and m[4:] in lab:
                assert "." in m[4:], f"the library {name} imports the command {m}"
                assert not name.startswith("worlds.") or m.startswith("lab.worlds."), \
                    f"the world {name} imports {m}"


def test_the_core_runs_without_the_lab():
    # a fresh interpreter that imports grpo alone: the lab's rewards are not there, the core's are
    code = ("import sys, grpo; assert not any(m.startswith('lab') for m in sys.modules); "
            "print(sorted(grpo.pair.REWARDS))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "'pair'" in r.stdout and "'outcome'" in r.stdout and "'igpo'" not in r.stdout


def test_a_lab_command_checks_its_runs_with_the_lab_flags(tmp_path):
    # lab.compare checks every run's command line with the lab's parser before any starts
    r = subprocess.run([sys.executable, "-m", "lab.compare", "--rewards", "igpo", "tree_grpo",
                        "--seeds", "42", "--out", str(tmp_path / "c"), "--", "--steps", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode != 0 and "--steps must be at least 1, got 0" in r.stderr, r.stderr
    assert "unknown reward" not in r.stderr and not (tmp_path / "c").exists()


def test_the_core_has_no_hooks():
    # the loop a reader follows is written out where it runs: no table of callbacks in the core,
    # nor PyTorch's module hooks (the layer split moves activations in the forward passes)
    for name in CORE:
        text = (ROOT / f"{name}.py").read_text()
        for pattern in (r"\bHOOKS\b", r"hook\(", r"\bPLAYERS\b", r"\bLOSSES\b"):
            assert not re.search(pattern, text), f"{name}.py: {pattern}"


def test_importing_the_lab_changes_nothing_of_the_core():
    # nothing registers at import: the core's tables after importing every lab module are the
    # core's own, and its other globals untouched
    code = """
import importlib, pathlib, envs, grpo, pair
before = (dict(pair.REWARDS), dict(pair.ADVANTAGES), dict(envs.WORLDS), dict(envs.REPLAYS),
          grpo.RESUME_KEYS, dict(grpo.RESUME_DEFAULTS), dict(grpo.FLAG_RANGES), grpo.TIMING,
          grpo.COSTS, grpo.PROG)
for path in sorted(pathlib.Path("lab").rglob("*.py")):
    importlib.import_module(".".join(path.with_suffix("").parts).removesuffix(".__init__"))
after = (dict(pair.REWARDS), dict(pair.ADVANTAGES), dict(envs.WORLDS), dict(envs.REPLAYS),
         grpo.RESUME_KEYS, dict(grpo.RESUME_DEFAULTS), dict(grpo.FLAG_RANGES), grpo.TIMING,
         grpo.COSTS, grpo.PROG)
assert before == after, [k for k, (a, b) in enumerate(zip(before, after)) if a != b]
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_the_lab_imports_no_circle():
    # every import of a lab file by another, functions included: the graph has no cycle
    lab = lab_modules()
    edges = {m: {i[4:] for i in imports(path) if i.startswith("lab.") and i[4:] in lab
                 and i[4:] != m} for m, path in lab.items()}
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(edges[m]):
            assert state.get(n) != "open", "import circle: " + " -> ".join([*path, m, n])
            if n not in state:
                visit(n, [*path, m])
        state[m] = "done"
    for m in sorted(lab):
        if m not in state:
            visit(m, [])


def test_the_sizes_of_the_files():
    sizes = {name: len((ROOT / f"{name}.py").read_text().splitlines()) for name in CORE}
    # a house-keeping bound, so that growth is noticed; prose is not paid for with it
    assert sum(sizes.values()) <= 5600 and max(sizes.values()) <= 1400, sizes
    for path in lab_modules().values():
        assert len(path.read_text().splitlines()) <= 1000, path.name


def prose_and_plainness(path: Path) -> dict[str, int]:
    """A file's lines, its prose lines (comments on lines of their own, and docstrings: a
    comment at the end of a code line is that line's, not prose), its conditional expressions
    and walruses, and its lines of 90-99 and of over 99 columns."""
    text = path.read_text()
    lines = text.splitlines()
    prose = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].lstrip().startswith("#")}
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and \
                    isinstance(doc.value.value, str):
                prose.update(range(doc.lineno, doc.end_lineno + 1))
    nodes = list(ast.walk(tree))
    return {"lines": len(lines), "prose": len(prose),
            "ifexp": sum(isinstance(n, ast.IfExp) for n in nodes),
            "walrus": sum(isinstance(n, ast.NamedExpr) for n in nodes),
            "wide": sum(90 <= len(line) <= 99 for line in lines),
            "over": sum(len(line) > 99 for line in lines)}


def test_the_core_reads_as_prose_and_plain_statements():
    # a porter reads the prose: comments on their own lines and docstrings are at least a fifth
    # of the core's lines (nanoGPT 22%, nanochat 24%, counted the same way); packed one-liners
    # are rare (conditional expressions <= 20 and the walrus <= 1 per 1,000 lines); no line
    # over 99 columns, and fewer than 1 in 8 of 90-99
    measured = [prose_and_plainness(ROOT / f"{name}.py") for name in CORE]
    total = {key: sum(m[key] for m in measured) for key in measured[0]}
    lines = total["lines"]
    assert total["prose"] / lines >= 0.20, f"prose {total['prose'] / lines:.1%}"
    assert 1000 * total["ifexp"] / lines <= 20, f"{total['ifexp']} conditional expressions"
    assert 1000 * total["walrus"] / lines <= 1, f"{total['walrus']} walruses"
    assert total["over"] == 0, "lines over 99 columns"
    assert total["wide"] / lines < 1 / 8, f"{total['wide']} lines of 90-99 columns"


def test_a_tail_comment_is_not_prose(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('"""doc"""\nx = 1  # a tail\n# own line\ny = 2\n' + "z = " + "1" * 96 + "\n")
    m = prose_and_plainness(f)
    assert (m["lines"], m["prose"], m["wide"], m["over"]) == (5, 2, 0, 1)


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
    for path in [*ROOT.glob("*.py"), *lab_modules().values()]:
        body = ast.parse(path.read_text()).body
        mains = [i for i, node in enumerate(body) if isinstance(node, ast.If)
                 and "__main__" in ast.unparse(node.test)]
        assert mains in ([], [len(body) - 1]), f"{path.name}: definitions after its __main__ block"


def test_the_readmes_path_names_the_lines_its_functions_start_at():
    # README's "Read the code" gives each function on the paper's path as `mod.name` (mod.py:N)
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Read the code"):readme.index("## The files")]
    cited = re.findall(r"`((model|probes|pair|envs|grpo)\.[\w.]+)` \((\w+)\.py:(\d+)\)", section)
    assert len(cited) >= 30
    for name, mod, file, line in cited:
        assert mod == file, name
        *_, last = name.split(".")
        text = (ROOT / f"{mod}.py").read_text().splitlines()[int(line) - 1]
        assert re.match(rf"\s*(def|class) {last}\b", text), f"{name} is not at {file}.py:{line}"
