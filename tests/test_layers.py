"""The package's folders are its layers, in the order of :data:`LAYERS`: a module imports only
modules of its own layer or of the layers beneath it, and no two modules import each other, by
any path. Every import statement counts (at module level, inside functions, under ``if
TYPE_CHECKING:``): each one says that one module needs the other."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvxferd"

#: bottom first; a module belongs to the layer that names it or the folder it lies in
LAYERS: list[tuple[str, ...]] = [
    ("kvxferd", "kvxferd.errors"),  # the package's root (version numbers) and the typed errors
    ("kvxferd.model",),  # the pure model: geometry, cache groups, DP ranks, plans, segments
    ("kvxferd.wire",),  # the protocol and its messages, coalesced parts, peer authentication
    ("kvxferd.directory",),  # which daemon holds which rank: the rules, etcd's keys and client, lookups
    ("kvxferd.ops",),  # configuration, logs, metrics and their endpoint, systemd, signals
    ("kvxferd.datapath",),  # memory files and handles, mapped regions, staging, copies
    ("kvxferd.lifecycle",),  # the core: requests and ranks, routes, events in and effects out
    ("kvxferd.transport",),  # moving chunks between daemons, and the data plane's threads
    ("kvxferd.control",),  # the shells on the event loop, and the daemon that wires them
    ("kvxferd.sdk",),  # what an engine uses to work with its daemon
    ("kvxferd.adapters",),  # serving engines' plugins
    ("kvxferd.tools",),  # demo, bench, soak, simulated engines, the byte oracle
    ("kvxferd.cli", "kvxferd.__main__"),  # the kvxferd command
]

#: the engine side runs inside engines' processes: it never imports the daemon's core, data
#: movement or shells, whatever the order above allows
APART = {"kvxferd.sdk": ("kvxferd.lifecycle", "kvxferd.transport", "kvxferd.control"),
         "kvxferd.adapters": ("kvxferd.lifecycle", "kvxferd.transport", "kvxferd.control")}


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, whether it is a package's __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imports_of(name: str, path: Path, is_package: bool, known: dict[str, tuple[Path, bool]]) -> set[str]:
    """The package's modules one module imports, each import statement of it resolved: a name
    that is a module is that module, any other name its module; a module's packages count too
    (their ``__init__`` runs first), but for those the importer lies in."""
    here = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names if a.name.split(".")[0] == "kvxferd")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[:len(here.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "kvxferd":
                continue
            for alias in node.names:
                targets.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
    out = set()
    for target in targets:
        while target not in known:  # ``import kvxferd.x.y`` of a name: its module
            target = target.rpartition(".")[0]
        parts = target.split(".")
        for n in range(2, len(parts) + 1):
            step = ".".join(parts[:n])
            if not (name == step or name.startswith(step + ".")):
                out.add(step)
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, is_package, known) for name, (path, is_package) in known.items()}


def layer_of(module: str) -> tuple[int, str] | None:
    """(rank, the entry of LAYERS that places it), the longest entry that names it or holds it."""
    best: tuple[int, str] | None = None
    for rank, entries in enumerate(LAYERS):
        for entry in entries:
            holds = module == entry or (entry != "kvxferd" and module.startswith(entry + "."))
            if holds and (best is None or len(entry) > len(best[1])):
                best = (rank, entry)
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One loop of imports for each group of modules that import each other (Tarjan's strongly
    connected components, then a path back to the start within the group)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    loops = []
    for group in groups:
        members, start = set(group), group[0]
        paths = {start: [start]}
        todo = [start]
        while todo:  # breadth first from start, inside the group, until an import leads back to it
            v = todo.pop(0)
            if start in edges[v]:
                loops.append(paths[v] + [start])
                break
            for w in sorted(edges[v] & members):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    todo.append(w)
    return loops


def test_every_module_is_placed_in_a_layer():
    unplaced = sorted(m for m in modules() if layer_of(m) is None)
    assert not unplaced, f"modules in no layer of LAYERS (place their folder there): {unplaced}"


def test_no_import_cycle():
    loops = cycles(graph())
    assert not loops, "import cycles:\n" + "\n".join("  " + " -> ".join(loop) for loop in loops)


def test_no_import_runs_up_the_layers():
    upward = []
    for module, targets in sorted(graph().items()):
        low = layer_of(module)
        for target in sorted(targets):
            high = layer_of(target)
            if low is not None and high is not None and high[0] > low[0]:
                upward.append(f"  {module} ({low[1]}) imports {target} ({high[1]})")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_engine_side_never_imports_the_daemon():
    found = []
    for module, targets in sorted(graph().items()):
        for side, daemon in APART.items():
            if module == side or module.startswith(side + "."):
                found += [f"  {module} imports {t}" for t in sorted(targets)
                          if any(t == d or t.startswith(d + ".") for d in daemon)]
    assert not found, "the engine side imports the daemon's parts:\n" + "\n".join(found)


def test_the_checks_see_what_they_look_for(tmp_path):
    """On made-up modules: an import inside a function and one under TYPE_CHECKING are seen, a
    name is told from a module, and a loop is printed from one module back to it."""
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..b import B\n\n\n"
                      "def f():\n    from ..c import x\n    from . import d, y\n")
    known = {name: (tmp_path, False) for name in ("kvxferd", "kvxferd.p", "kvxferd.p.m", "kvxferd.p.d",
                                                  "kvxferd.b", "kvxferd.c")}
    assert imports_of("kvxferd.p.m", source, False, known) == {"kvxferd.b", "kvxferd.c", "kvxferd.p.d"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert layer_of("kvxferd.transport.nixl.api") == (LAYERS.index(("kvxferd.transport",)), "kvxferd.transport")
    assert layer_of("kvxferd.nowhere") is None
