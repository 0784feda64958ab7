"""No import cycles between the package's modules: the graph of every ``import`` of one of its own modules, at the
top of a file or inside a function, has no cycle. ``from pkg import sub`` where ``sub`` is a module counts as an
import of ``pkg.sub`` only."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.launch import REPO


def module_names(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its file."""
    modules = module_names(root, package)

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = mod.split(".")[: len(mod.split(".")) - (node.level - (1 if is_pkg else 0))]
                    base = ".".join(parts + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names]
                names = [s for s in subs if s in modules] or [base]
                names += [base for s in subs if s not in modules]
            else:
                continue
            for name in names:
                target = owner(name)
                if target and target != mod and target != package:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph(REPO, "outlier_titan")
    assert len(graph) > 50 and graph["outlier_titan.trainer"], "the graph missed the package's modules"
    assert cycles(graph) == [], "\n".join(" <-> ".join(c) for c in cycles(graph))


def test_a_function_level_cycle_is_found(tmp_path):
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from toy.sub import b\n")
    (pkg / "a.py").write_text("from toy.sub.b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (pkg / "c.py").write_text("from toy import a\n")
    graph = import_graph(tmp_path, "toy")
    assert graph["toy.sub"] == {"toy.sub.b"} and graph["toy.c"] == {"toy.a"}
    assert cycles(graph) == [["toy.a", "toy.sub.b"]]


LAYERS = (
    ("errors", "exit_codes", "options", "plugins", "tensors", "linalg", "packaged", "provenance", "preempt", "cli"),
    ("lowprec",),  # the formats and recipes (config's [low_precision] choices come from them)
    ("config",),
    ("data",),
    ("models",),
    ("optim", "parallel"),
    ("observe",),
    ("quant",),
    ("checkpoint",),
    ("eval",),
    ("hf",),
    ("remedies",),
    ("components",),
    ("training",),
    ("trainer",),
    ("study",),
    ("tools",),
    ("train", "launch", "progress"),
)
"""The package's layers, lowest first: a module imports (at the top of its file or inside a function) only from its
own top-level part (module or sub-package) and from lower layers; the parts of one layer (``optim`` and
``parallel``; the basics) do not import each other. The basics at the bottom import nothing of the package but
other basics; the entry points at the top may import anything."""


def layer_violations(graph: dict[str, set[str]], layers=LAYERS, package: str = "outlier_titan") -> list[str]:
    """``importer -> imported`` for every import that points up or sideways (the basics among themselves
    excepted); a part no layer names is reported too."""
    rank = {part: i for i, layer in enumerate(layers) for part in layer}

    def part(module: str) -> str:
        return module.split(".")[1] if module.count(".") else module

    out = []
    for mod, targets in sorted(graph.items()):
        if mod == package:
            continue
        src = part(mod)
        if src not in rank:
            out.append(f"{mod}: part '{src}' is in no layer")
            continue
        for t in sorted(targets):
            dst = part(t)
            if dst == src or dst not in rank:
                continue
            if rank[dst] > rank[src] or (rank[dst] == rank[src] and rank[src] != 0):
                out.append(f"{mod} -> {t}")
    return out


def test_imports_point_down_the_layers():
    graph = import_graph(REPO, "outlier_titan")
    bad = layer_violations(graph)
    assert bad == [], "imports that point up or sideways:\n" + "\n".join(bad)


def test_an_upward_or_sideways_import_is_found(tmp_path):
    pkg = tmp_path / "toy"
    for sub in ("low", "mid_a", "mid_b", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "x.py").write_text("def f():\n    from toy.high import y\n")  # up, inside a function
    (pkg / "mid_a" / "x.py").write_text("from toy.mid_b import x\n")  # sideways
    (pkg / "mid_b" / "x.py").write_text("from toy.low import x\n")  # down: fine
    (pkg / "high" / "y.py").write_text("from toy.mid_a import x\n")  # down: fine
    graph = import_graph(tmp_path, "toy")
    layers = (("low",), ("mid_a", "mid_b"), ("high",))
    assert layer_violations(graph, layers, "toy") == ["toy.low.x -> toy.high.y", "toy.mid_a.x -> toy.mid_b.x"]
