"""The import rules of docs/architecture.md, read from the source with `ast`: arrows run one way.

Every `import` of a Pylon module counts, function-local ones included (only those under `if TYPE_CHECKING:` do
not: they never run). No cycle anywhere; no module imports a layer above its own; within a middle layer, one
package imports another only where ALLOWED says so (the ground floor's modules and the ways in may use each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {
    "pylon": REPO / "platform" / "pylon",
    "pylon.data": REPO / "data",
    "pylon.jobs": REPO / "jobs",
    "pylon.serving": REPO / "serving",
}

# Lowest first. A module belongs to the longest prefix that names it.
LAYERS = [
    [
        "pylon.errors",
        "pylon.version",
        "pylon.settings",
        "pylon.display",
        "pylon.presets",
        "pylon.storage",
        "pylon.specs",
        "pylon.home",
        "pylon.models",
        "pylon.draft_head",
        "pylon.weight_subset",
        "pylon.ops",
    ],
    ["pylon.data", "pylon.serving.errors", "pylon.serving.model"],
    ["pylon.jobs", "pylon.plan", "pylon.serving.engine"],
    ["pylon.infra", "pylon.serving.api"],
    ["pylon.sdk"],
    ["pylon.cli", "pylon.__main__", "pylon"],
]
# Same-layer arrows between packages that the design allows: the planner reads a run's directory, never the trainer.
# The run's ledger (pylon.jobs.ledger) prices what a run used with the catalog and sets the planner's prediction
# beside it: the trainer's ledger reads the planner, never the other way round.
ALLOWED = {
    ("pylon.plan", "pylon.jobs.run_dir"),
    ("pylon.jobs", "pylon.plan.catalog"),
    ("pylon.jobs", "pylon.plan.steptime"),
    ("pylon.jobs", "pylon.plan.train"),
    # grpo.sampler engine (jobs/rollout.py): a trainer samples through the serving engine
    ("pylon.jobs", "pylon.serving.engine.engine"),
    ("pylon.jobs", "pylon.serving.engine.sampling"),
}


def modules() -> dict[str, Path]:
    found = {}
    for pkg, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if pkg == "pylon" and parts and parts[0] in ("data", "jobs", "serving"):
                continue
            found[".".join([pkg, *parts])] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip |= {id(n) for n in ast.walk(node)}
    return skip


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The Pylon modules `name` imports, anywhere in its body."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "pylon" and (mod := resolve(target)) and mod != name:
                out.add(mod)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def package_of(module: str) -> tuple[int, str]:
    best = None
    for rank, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (rank, prefix)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS in {__file__}"
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_pylon_modules():
    assert cycles(graph()) == []


def test_no_arrow_runs_up_a_layer():
    wrong = []
    for module, targets in sorted(graph().items()):
        rank, package = package_of(module)
        for target in sorted(targets):
            t_rank, t_package = package_of(target)
            if t_rank > rank:
                wrong.append(f"{module} -> {target} (layer {rank} imports layer {t_rank})")
            elif (
                0 < rank < len(LAYERS) - 1
                and t_rank == rank
                and t_package != package
                and (package, target) not in ALLOWED
            ):
                wrong.append(f"{module} -> {target} (across {package} and {t_package} in one layer)")
    assert wrong == []


@pytest.mark.parametrize(
    "edges, expected",
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(edges, expected):
    assert cycles(edges) == expected


def test_the_layer_check_sees_an_upward_arrow(tmp_path):
    # The engine importing the replica's server would be an arrow up: the check must name it.
    known = {"pylon.serving.engine.engine": tmp_path / "engine.py", "pylon.serving.api.server": tmp_path / "s.py"}
    known["pylon.serving.engine.engine"].write_text("def f():\n    from pylon.serving.api.server import X\n")
    found = imports_of("pylon.serving.engine.engine", known["pylon.serving.engine.engine"], known)
    assert found == {"pylon.serving.api.server"}
    assert package_of("pylon.serving.api.server")[0] > package_of("pylon.serving.engine.engine")[0]
