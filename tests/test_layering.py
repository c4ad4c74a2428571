"""The floors of the house (docs/DESIGN-NOTES.md): imports only go down, kernels know nothing of
the model, knobs are flags, benchmarks use the engine's public surface."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hylora"


def _imports(path: Path) -> list[str]:
    """Every hylora module `path` imports, at the top or inside functions (TYPE_CHECKING blocks aside)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n == "hylora" or (n.startswith("hylora.") and not n.startswith("hylora.__"))]


def _floor(module: str) -> str:
    """The top-level package (or module) of `hylora.x.y`: its floor."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hylora"


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _own_floor(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem


def test_no_import_cycles_between_floors():
    graph: dict[str, set[str]] = defaultdict(set)
    for path in _files():
        own = _own_floor(path)
        for module in _imports(path):
            target = _floor(module)
            if target not in (own, "hylora", "__init__"):
                graph[own].add(target)
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in stack:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif len(stack) < len(graph) + 1:
                visit(nxt, [*stack, nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not cycles, "imports climb back up: " + "; ".join(sorted(set(cycles))[:10])


def test_kernels_import_nothing_of_hylora_but_config():
    offenders = {}
    for path in (PACKAGE / "ops").rglob("*.py"):
        bad = [m for m in _imports(path) if _floor(m) not in ("ops", "config")]
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert not offenders, offenders


def test_the_environment_is_read_in_one_module():
    readers = []
    for path in _files():
        text = path.read_text()
        if path.name != "env.py" and ("os.environ" in text or "getenv(" in text):
            readers.append(str(path.relative_to(ROOT)))
    assert not readers, f"environment read outside hylora/env.py: {readers}"


def test_benchmarks_use_the_engines_public_surface():
    offenders = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr.startswith("_")
                    and ast.unparse(target.value) != "self"  # a benchmark's own objects may
                ):
                    offenders.append(f"{path.name}:{node.lineno} assigns {ast.unparse(target)}")
    assert not offenders, offenders
