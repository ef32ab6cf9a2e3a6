"""The import graph keeps its layers: no import circle, and every import points down.

The graph is read from the source (ast), not by importing: every `import` / `from ...
import` of preempt/, predictor/ and experiments/ is an edge, marked `top`
(runs at import), `function` (inside a function: runs when called) or `type` (under
`if TYPE_CHECKING:`, never runs). All three count: a lazy or type-only import still
makes the lower module know the upper one.

Layers, bottom to top (preempt/__init__.py's docstring shows them as a tree). A module
may import its own package and any package of a lower layer; packages of one layer never
import each other.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("preempt", "predictor", "experiments")

LAYERS: tuple[tuple[str, ...], ...] = (
    ("preempt.core",),  # requests, blocks, config, clocks, cost model, workloads
    ("preempt.kernels", "preempt.model"),  # Triton kernels + references; the tiny model
    ("preempt.kv",),  # where a preempted request's KV goes and how it comes back
    ("preempt.engine",),  # scheduler, policies, the waiting queue, the step
    ("preempt.early",),  # early saves and restores ahead: hooks the step calls by name
    ("preempt.obs",),  # results files, metrics, the predictor's dataset, wandb seam
    ("preempt.lm", "preempt.calibrate", "preempt.replay"),  # reference LM; cost fits; a run
    ("preempt.parity",),  # our scheduler beside vLLM's
    ("preempt.integrations",),  # our policies inside vLLM
    ("preempt.serve", "preempt.bench"),  # the HTTP server; benchmarks
    ("predictor", "experiments"),  # training (Lightning), ablations: the CLI's alone
    ("preempt.cli",),  # the CLI alone imports everything
    # The package root: re-exports the public objects, and imports the kv, engine and early
    # packages so that each registers its plug-in names before any config is validated.
    ("preempt",),
)
# Run as programs (`python -m ...`), imported by nothing: they may import anything.
ENTRY_POINTS = frozenset({"preempt.server", "preempt.serve.__main__"})
# Run in vLLM's own virtualenv (PYTHONPATH=repo, preempt/parity/harness.py, or preempt
# installed there, `make peer`): what they import at module level must exist there.
# prometheus_client: a dependency of vLLM itself (its /metrics).
PEER_MODULES = ("preempt.parity.vllm_peer", "preempt.integrations.vllm")
# torch comes with vLLM; zstandard is in the peer's lock for the KV connector's codecs;
# isal is optional (preempt.kv.codec falls back to zlib's identical CRC-32 without it).
PEER_PACKAGES = frozenset(
    {"vllm", "pydantic", "numpy", "yaml", "prometheus_client", "torch", "zstandard", "isal"}
)


def module_files() -> dict[str, Path]:
    modules = {}
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path) -> Iterable[tuple[str, str]]:
    """(imported dotted name, kind) for every import in the module."""
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, kind: str) -> Iterable[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            child_kind = kind
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and kind == "top":
                child_kind = "function"
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), "type")
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), kind)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child_kind
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                yield module, child_kind
                for alias in child.names:  # `from pkg import module`
                    yield f"{module}.{alias.name}", child_kind
            yield from visit(child, child_kind)

    yield from visit(ast.parse(path.read_text()), "top")


def build_graph() -> tuple[dict[str, dict[str, set[str]]], dict[str, set[str]]]:
    """(internal edges: module -> imported module -> kinds, external top-level roots per
    module: the third-party or stdlib packages it imports at module level)."""
    files = module_files()

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    edges: dict[str, dict[str, set[str]]] = {m: {} for m in files}
    external: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for dotted, kind in imports_of(module, path):
            target = resolve(dotted)
            if target is not None:
                if target != module:
                    edges[module].setdefault(target, set()).add(kind)
            elif kind == "top" and dotted.split(".")[0] not in ROOTS:
                external[module].add(dotted.split(".")[0])
    return edges, external


def cycles(edges: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(edges.get(succ, {}))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def unit_of(module: str) -> str | None:
    """The layered package a module belongs to (the root, `preempt`, only itself)."""
    for layer in LAYERS:
        for unit in layer:
            if module == unit or (unit != "preempt" and module.startswith(unit + ".")):
                return unit
    return None


def layer_of(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def layering_violations(edges: dict[str, dict[str, set[str]]]) -> list[str]:
    bad = []
    for module, targets in edges.items():
        for target, kinds in targets.items():
            how = "/".join(sorted(kinds))
            if target in ENTRY_POINTS:
                bad.append(f"{module} -> {target} ({how}): an entry point is imported by nothing")
                continue
            if module in ENTRY_POINTS:
                continue
            source_unit, target_unit = unit_of(module), unit_of(target)
            if source_unit is None or target_unit is None:
                bad.append(f"{module} -> {target} ({how}): module outside every layer")
            elif source_unit != target_unit and layer_of(target_unit) >= layer_of(source_unit):
                bad.append(f"{module} -> {target} ({how}): {target_unit} is not below {source_unit}")
    return bad


def test_every_module_has_a_layer():
    modules = module_files()
    homeless = [m for m in modules if unit_of(m) is None and m not in ENTRY_POINTS]
    assert not homeless, f"add these to LAYERS (or move them into a package): {homeless}"
    flat = {m for m, path in modules.items() if m.count(".") == 1 and m.startswith("preempt.")}
    flat -= {m for m, path in modules.items() if path.name == "__init__.py"}
    assert flat == {"preempt.replay", "preempt.server"}, "modules belong in a package"


def test_no_import_circle():
    edges, _ = build_graph()
    found = cycles(edges)
    described = [
        " ; ".join(f"{a} -> {b} ({'/'.join(sorted(edges[a][b]))})" for a in scc for b in scc if b in edges[a])
        for scc in found
    ]
    assert not found, "import circles: " + " | ".join(described)


def test_imports_point_down_the_layers():
    edges, _ = build_graph()
    assert not layering_violations(edges), "\n".join(layering_violations(edges))


def test_the_checks_see_a_circle_and_an_upward_import():
    """The two checks above on a made-up graph: they can fail."""
    edges = {
        "preempt.core.config": {"preempt.engine.policies": {"function"}},
        "preempt.engine.policies": {"preempt.core.config": {"top"}},
    }
    assert cycles(edges) == [["preempt.core.config", "preempt.engine.policies"]]
    assert layering_violations(edges) == [
        "preempt.core.config -> preempt.engine.policies (function): preempt.engine is not below preempt.core"
    ]
    assert layering_violations({"preempt.cli.main_job": {"experiments.report": {"top"}}}) == []
    assert layering_violations({"experiments.main": {"preempt.cli": {"top"}}}) == [
        "experiments.main -> preempt.cli (top): preempt.cli is not below experiments"
    ]
    assert layering_violations({"preempt.bench.serve": {"predictor.online": {"type"}}}) == [
        "preempt.bench.serve -> predictor.online (type): predictor is not below preempt.bench"
    ]


def test_type_checking_and_function_imports_are_edges(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nimport numpy\nif TYPE_CHECKING:\n"
        "    from preempt.engine.engine import Engine\n"
        "def f():\n    from predictor.train import train\n"
    )
    found = set(imports_of("preempt.obs.m", source))
    assert ("preempt.engine.engine", "type") in found
    assert ("predictor.train", "function") in found
    assert ("numpy", "top") in found


def _top_level_closure(start: Iterable[str]) -> tuple[set[str], set[str]]:
    """Modules and external packages imported at module level, transitively (what
    `import start` runs), including the packages above each module."""
    edges, external = build_graph()
    seen: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in edges)
        todo.extend(t for t, kinds in edges[module].items() if "top" in kinds)
    packages = set().union(*(external[m] for m in seen))
    return seen, packages


def test_peer_modules_import_only_what_the_vllm_peer_has():
    modules = [m for m in module_files() if m.startswith(PEER_MODULES)]
    assert "preempt.parity.vllm_peer" in modules
    _, packages = _top_level_closure(modules)
    foreign = packages - PEER_PACKAGES - set(sys.stdlib_module_names) - {"__future__"}
    assert not foreign, f"the vLLM peer's virtualenv lacks {sorted(foreign)}"


@pytest.mark.parametrize("entry", ["preempt.engine.engine", "preempt.serve.app", "preempt.serve.args"])
def test_engine_and_server_never_import_lightning(entry):
    _, packages = _top_level_closure([entry])
    assert "pytorch_lightning" not in packages and "lightning" not in packages


def test_no_module_names_an_upper_module_as_an_import_path():
    """A `module:Class` string is an import waiting to happen: a layer may name only its own
    modules or lower ones that way (each layer registers its own plug-in names)."""
    bad = []
    for name, path in module_files().items():
        unit = unit_of(name)
        if unit is None or name in ENTRY_POINTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            module, colon, attr = node.value.partition(":")
            target = unit_of(module) if colon and attr.isidentifier() and "." in module else None
            if target is not None and target != unit and layer_of(target) > layer_of(unit):
                bad.append(f"{name}: {node.value!r} ({target} is above {unit})")
    assert not bad, bad
