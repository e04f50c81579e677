"""The core's import graph keeps the layering of docs/structures.md: a module imports only from its own
folder or from rows below its own, and no import loop joins files of different folders. Every import
counts, function-local ones included; only imports under `if TYPE_CHECKING:` (annotations) are left out.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import deepinfer_core

CORE = Path(deepinfer_core.__file__).parent

ROWS: tuple[tuple[str, ...], ...] = (
    ("backends", "plan", "config", "sampling_params", "outputs", "hookspecs", "chat_contract",  # contracts
     "lazy_exports"),  # (the PEP 562 loader the packages of every row export through)
    ("reference",),
    ("plugins", "plugin_report", "tokenizer"),
    ("models",),
    ("kv", "distributed"),
    ("worker", "sched", "speculative", "structured_output"),
    ("executor",),
    ("engine", "multimodal"),  # multimodal: image input, decoded and processed before a request is queued
    ("llm", "entrypoints", "cli", "testing", "__init__"),  # user-facing; testing may import anything
)
"""Lowest first. Units of one row may import each other, as long as no loop joins them."""

ROW_OF = {unit: row for row, units in enumerate(ROWS) for unit in units}


def module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The layering unit: the core's top-level folder or module (`deepinfer_core` itself: `__init__`)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def folder_of(module: str, modules: dict[str, Path]) -> str:
    """The folder (package) a module's file sits in."""
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph() -> tuple[dict[str, set[str]], dict[str, Path]]:
    modules = {module_name(p): p for p in CORE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skipped:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("deepinfer_core"):
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names if alias.name.startswith("deepinfer_core")]
            else:
                continue
            for target in targets:
                found = resolve(target)
                if found is not None and found != module:
                    edges[module].add(found)
    return edges, modules


def strongly_connected(nodes, edges) -> list[set]:
    """Tarjan's components (iterative), each a set of nodes."""
    index, low, stack, on_stack, components, counter = {}, {}, [], set(), [], [0]
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def upward_imports() -> list[str]:
    edges, _ = import_graph()
    found = []
    for module, targets in edges.items():
        for target in targets:
            source_unit, target_unit = unit_of(module), unit_of(target)
            if ROW_OF[target_unit] > ROW_OF[source_unit]:
                found.append(f"{module} -> {target}")
    return sorted(found)


def cross_folder_loops() -> list[str]:
    edges, modules = import_graph()
    loops = []
    for component in strongly_connected(sorted(modules), edges):
        if len({folder_of(m, modules) for m in component}) > 1:
            loops.append(" <-> ".join(sorted(component)))
    units = {unit_of(m) for m in modules}
    unit_edges = defaultdict(set)
    for module, targets in edges.items():
        for target in targets:
            if unit_of(module) != unit_of(target):
                unit_edges[unit_of(module)].add(unit_of(target))
    loops += ["units: " + " <-> ".join(sorted(c)) for c in strongly_connected(sorted(units), unit_edges) if len(c) > 1]
    return loops


def test_every_unit_has_a_row():
    _, modules = import_graph()
    assert sorted({unit_of(m) for m in modules} - set(ROW_OF)) == []


def test_no_upward_import():
    assert upward_imports() == []


def test_no_loop_between_folders():
    assert cross_folder_loops() == []


def test_the_checks_can_fail():
    """The scan sees function-local imports, and the loop finder finds a planted loop."""
    edges, _ = import_graph()
    assert any(targets for targets in edges.values())
    planted = {"a.x": {"b.y"}, "b.y": {"a.x"}, "c.z": set()}
    components = strongly_connected(sorted(planted), planted)
    assert {"a.x", "b.y"} in components and {"c.z"} in components
