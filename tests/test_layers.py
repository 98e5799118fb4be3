"""The house: every import of a product file (top-level or inside a function) goes one way, down
the floors below, and never in a circle."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each file's floor; a file may import files of lower floors only. The model and the probes
# import nothing of the project but the ground floor.
FLOORS = {
    "common": 0, "weights": 0.5, "chat_api": 0.5, "calculator": 0,
    "model": 1, "probes": 1, "adapters": 1.5,
    "envs": 2, "rollout": 2, "pair": 2.5,
    "shop": 3, "onpolicy": 3.5, "baselines": 3.5, "runs": 3.7,
    "grpo": 4,
    "compare": 5, "bench": 5,
}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_every_product_file_has_a_floor():
    assert {p.stem for p in ROOT.glob("*.py")} == set(FLOORS)


def test_imports_go_down_and_never_in_a_circle():
    graph = {name: imports(ROOT / f"{name}.py") & set(FLOORS) - {name} for name in FLOORS}
    for name, deps in graph.items():
        for dep in deps:
            assert FLOORS[dep] < FLOORS[name], f"{name}.py imports {dep}.py, which is not below it"
    assert graph["model"] <= {"common", "weights"} and graph["probes"] <= {"common"}
    # no cycle (implied by the floors, checked on the graph itself as well)
    seen, done = set(), set()

    def visit(node, path):
        assert node not in seen - done, f"import cycle: {' -> '.join(path)}"
        if node in done:
            return
        seen.add(node)
        for dep in graph[node]:
            visit(dep, path + [dep])
        done.add(node)
    for name in graph:
        visit(name, [name])
