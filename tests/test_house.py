"""The house's imports, read from the source: no circle of files, no loop of folders, the
core path apart from detached jobs, the rank side apart from the driver.

Pure: the files are parsed, never imported. Every import counts wherever it stands: at the
top, inside a function (a lazy one) or under `if TYPE_CHECKING:`. A file that names a
module depends on it, whether it imports it now, later or for its types alone.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"orchestrator": ROOT / "orchestrator", "orchestrator_workers": ROOT / "workers"}
"""Each library package's import name, and its folder."""
CORE = ("orchestrator.runner", "orchestrator.call", "orchestrator.job", "orchestrator.pool")
"""A live call's path: it knows nothing of detached jobs."""
DOORS = (
    "orchestrator",
    "orchestrator.__main__",
    "orchestrator.run",
    "orchestrator.function",
    "orchestrator.testing",
)
"""The top level's ways in, above every room: the public API (named from all of them), the
commands (they start cli/), `distribute()` (a live runner, or a detached one), and the
hooks of this project's tests (they reach into any room)."""


def _modules() -> dict[str, Path]:
    """Every library module by its import name (a package by its own name)."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _type_checking(test: ast.expr) -> bool:
    """Whether an `if` tests `TYPE_CHECKING` (or `typing.TYPE_CHECKING`)."""
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def _statements(tree: ast.Module, *, on_import: bool) -> Iterator[ast.stmt]:
    """Every statement of `tree`, or with `on_import` those that run as it is imported:
    none inside a function, nor under `if TYPE_CHECKING:`."""
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        yield node
        if on_import and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if on_import and isinstance(node, ast.If) and _type_checking(node.test):
            pending.extend(node.orelse)
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                pending.append(child)
            elif isinstance(child, ast.ExceptHandler | ast.match_case):
                pending.extend(child.body)


def _named(module: str, node: ast.stmt) -> Iterator[str]:
    """The library modules that the import statement `node` of `module` names."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name in MODULES)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the package `module` is (or sits in)
            package = module if MODULES[module].stem == "__init__" else module.rpartition(".")[0]
            above = package.rsplit(".", node.level - 1)[0]
            base = f"{above}.{base}" if base else above
        for alias in node.names:
            if f"{base}.{alias.name}" in MODULES:  # `from package import module`
                yield f"{base}.{alias.name}"
            elif base in MODULES:
                yield base


def named_in(module: str, source: str, *, on_import: bool = False) -> frozenset[str]:
    """The library modules that `source`, the text of `module`, imports (`on_import`: see
    `_statements`)."""
    tree = ast.parse(source, module)
    return frozenset(
        name for node in _statements(tree, on_import=on_import) for name in _named(module, node)
    ) - {module}


@functools.cache
def imports(module: str, *, on_import: bool = False) -> frozenset[str]:
    """The library modules `module` imports (`on_import`: see `_statements`)."""
    return named_in(module, MODULES[module].read_text(), on_import=on_import)


def loaded_by(roots: Iterable[str]) -> dict[str, str | None]:
    """Every library module that importing `roots` may load, each with the one that loads
    it first (None for a root).

    A module that an import names may run any of its imports. A package runs as the parent
    of its submodules too, and then only what runs on import counts: `orchestrator` names
    its public API for type checkers and imports each name on first use, which takes an
    import that names it (`from orchestrator import Job`), and that one counts in full.
    """
    came: dict[tuple[str, bool], tuple[str, bool] | None] = {}
    pending: deque[tuple[tuple[str, bool], tuple[str, bool] | None]]
    pending = deque(((root, True), None) for root in roots)
    while pending:
        node, by = pending.popleft()
        if node in came:
            continue
        came[node] = by
        module, named = node
        if named:
            pending.extend(((name, True), node) for name in imports(module))
            parents = [".".join(module.split(".")[:end]) for end in range(1, module.count(".") + 1)]
            pending.extend(((parent, False), node) for parent in parents)
        else:
            pending.extend(((name, True), node) for name in imports(module, on_import=True))
    loaded: dict[str, str | None] = {}
    for (module, _), by in came.items():
        loaded.setdefault(module, by[0] if by is not None else None)
    return loaded


def loop_through(edges: Mapping[str, Iterable[str]], start: str) -> list[str] | None:
    """A shortest loop of `edges` from `start` back to it (`start` at both ends), or None."""
    came: dict[str, str] = {}
    pending = deque((name, start) for name in sorted(edges.get(start, ())))
    while pending:
        node, by = pending.popleft()
        if node in came:
            continue
        came[node] = by
        if node == start:
            loop = [start, by]
            while loop[-1] != start:
                loop.append(came[loop[-1]])
            return loop[::-1]
        pending.extend((name, node) for name in sorted(edges.get(node, ())))
    return None


def cycle(edges: Mapping[str, Iterable[str]]) -> list[str] | None:
    """A loop of `edges` (the first node again at its end), or None."""
    return next(filter(None, (loop_through(edges, node) for node in sorted(edges))), None)


def room(module: str) -> str:
    """The room of the house a module is in: its folder (`orchestrator/`, `orchestrator/show/`,
    `workers/`); a door is a room of its own (`orchestrator/__init__.py`)."""
    path = MODULES[module].relative_to(ROOT)
    if module in DOORS:
        return str(path)
    top = path.parts[0]
    below = path.parts[1] if len(path.parts) > 2 and top == "orchestrator" else ""
    return f"{top}/{below}/" if below else f"{top}/"


def _top(room_name: str) -> bool:
    """Whether a room is the top level, or one of its doors."""
    return room_name == "orchestrator/" or room_name.endswith(".py")


def room_edges(*, with_the_top: bool) -> dict[str, set[str]]:
    """Which rooms import which; without `with_the_top`, the top level's files aside."""
    edges: dict[str, set[str]] = {}
    for module in MODULES:
        for name in imports(module):
            ends = (room(module), room(name))
            aside = not with_the_top and any(map(_top, ends))
            if ends[0] != ends[1] and not aside:
                edges.setdefault(ends[0], set()).add(ends[1])
    return edges


def _chain(loaded: Mapping[str, str | None], module: str) -> str:
    chain = [module]
    while (by := loaded[chain[-1]]) is not None:
        chain.append(by)
    return " -> ".join(reversed(chain))


def test_the_core_path_loads_nothing_of_supervise() -> None:
    """Importing the runner, the call, the job and the pool loads no `orchestrator.supervise`
    module, by any chain of imports."""
    loaded = loaded_by(CORE)
    assert {"orchestrator", "orchestrator.placement", "orchestrator_workers.protocol"} <= set(
        loaded
    )  # the walk reaches what they import, and the package they are in
    supervise = sorted(m for m in loaded if room(m) == "orchestrator/supervise/")
    assert not supervise, f"the core path loads supervise/: {_chain(loaded, supervise[0])}"


def test_no_circle_of_files() -> None:
    """No library file reaches itself again through the files it imports."""
    found = cycle({module: imports(module) for module in MODULES})
    assert found is None, f"a circle of imports: {' -> '.join(found)}"


def test_the_folders_import_one_another_one_way() -> None:
    """connect/, diagnose/, show/, supervise/, cli/ and workers/ import one another one way."""
    found = cycle(room_edges(with_the_top=False))
    assert found is None, f"a loop of folders: {' -> '.join(found)}"


def test_supervise_and_cli_are_in_no_loop_of_folders() -> None:
    """With the top level as one room (its doors apart), supervise/ and cli/ are in no loop
    of folders: they stand on the core, which never reaches up into them."""
    edges = room_edges(with_the_top=True)
    for above in ("orchestrator/supervise/", "orchestrator/cli/"):
        found = loop_through(edges, above)
        assert found is None, f"a loop of folders: {' -> '.join(found)}"


def test_the_rank_side_never_imports_the_driver() -> None:
    """workers/ (`orchestrator_workers`) imports nothing of `orchestrator`."""
    driver = sorted(
        f"{module} -> {name}"
        for module in MODULES
        if room(module) == "workers/"
        for name in imports(module)
        if room(name) != "workers/"
    )
    assert not driver, f"the rank side imports the driver: {driver}"


def test_the_walk_sees_every_kind_of_import() -> None:
    """Lazy and type-only imports are counted, and a loop is found and named."""
    source = """
import orchestrator.errors
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from orchestrator.pool import Pool
def later():
    from orchestrator import placement, Job
    try:
        import orchestrator.supervise.link as link
    except ImportError:
        from . import restart
class Lines:
    from orchestrator.show.text import clock
"""
    assert named_in("orchestrator.call", source) == {
        "orchestrator.errors",
        "orchestrator.pool",
        "orchestrator.placement",
        "orchestrator",
        "orchestrator.supervise.link",
        "orchestrator.restart",
        "orchestrator.show.text",
    }
    assert named_in("orchestrator.call", source, on_import=True) == {
        "orchestrator.errors",
        "orchestrator.show.text",
    }
    assert "orchestrator.supervise.catalog" in imports("orchestrator")  # for types only
    assert cycle({"a": "b", "b": "c", "c": "ab"}) == ["a", "b", "c", "a"]
    assert cycle({"a": "b", "b": "c", "d": "a"}) is None
