"""The floor plan of docs/architecture.md, checked: layers import only downward, no
module imports in a circle (imports under TYPE_CHECKING and inside functions
included), subpackages are private with empty `__init__.py`s, the top level holds at
most 16 modules, no module is over 500 lines, and nothing in the repository points
outside it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lazyckpt"

LAYERS: list[set[str]] = [
    {"_errors", "_text", "_sizes", "_display"},
    {"_array"},
    {"_storage"},
    {"_engine"},
    {"_lazy", "_html"},
    {"_orbax", "_safetensors", "_weights"},
    {"_open", "_save"},
    {"_placement"},
    {"_device"},
    {
        "_read",
        "_device_put",
        "_surgery",
        "_rename",
        "_dequantize",
        "_convert",
        "_measure",
    },
    {"_explore"},
    {"_cli"},
    {"__init__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The lazyckpt modules that `name` imports, wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in modules else base)
    return {m for m in out if m in modules and m not in (name, "lazyckpt")}


def _layer(module: str) -> int:
    parts = module.split(".")
    return RANK[parts[1] if len(parts) > 1 else "__init__"]


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


def test_every_module_has_a_layer() -> None:
    unknown = sorted(m for m in GRAPH if m != "lazyckpt" and m.split(".")[1] not in RANK)
    assert not unknown, f"add these to LAYERS and docs/architecture.md: {unknown}"


def test_layers_import_only_downward() -> None:
    upward = [
        f"{a} -> {b}"
        for a, targets in sorted(GRAPH.items())
        for b in sorted(targets)
        if _layer(b) > _layer(a)
    ]
    assert not upward, upward


def test_no_module_imports_in_a_circle() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                circles.append([*trail[trail.index(target) :], target])
            elif target not in state:
                visit(target, [*trail, target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not circles, circles


def test_subpackages_are_private_and_empty() -> None:
    for init in PACKAGE.glob("*/__init__.py"):
        assert init.parent.name.startswith("_"), init
        assert init.read_text().strip() == "", f"{init} must stay empty"


ROOM = "lazyckpt._storage.http"
"""The network's room: the modules that speak HTTP, the Hub resolver, the relay."""


def _in_room(module: str) -> bool:
    return module == ROOM or module.startswith(f"{ROOM}.")


def _network_offences(name: str, package: str, source: str) -> list[str]:
    """What module `name` (in `package`, its text `source`) does that reaches the
    network around storage: speaks HTTP outside the room (`http.client`, `http.server`,
    `huggingface_hub`, however imported), names a module of the room in a string outside
    `_storage` (an `importlib` call, an entry of `__init__._LAZY`), or, in `_storage`
    outside the room, re-exports one of its names (`from ...http.x import y as y`)."""
    in_storage = name == "lazyckpt._storage" or name.startswith("lazyckpt._storage.")
    out = []
    for node in ast.walk(ast.parse(source)):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            modules = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            if in_storage and not _in_room(name) and _in_room(base):
                again = [alias.name for alias in node.names if alias.asname == alias.name]
                if again:
                    out.append(f"{name}:{node.lineno} re-exports {base}'s {again}")
        speaks = [m for m in modules if m.split(".")[0] == "huggingface_hub"]
        speaks += [m for m in modules if m in ("http.client", "http.server")]
        if speaks and not _in_room(name):
            out.append(
                f"{name}:{getattr(node, 'lineno', '?')} speaks HTTP outside {ROOM}: {speaks}"
            )
        if (
            not in_storage
            and isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(ROOM)
        ):
            out.append(f"{name}:{node.lineno} names {node.value!r} in a string")
    return out


def test_the_network_is_one_room_behind_storage() -> None:
    """The modules that speak HTTP (`http.client`, `http.server`, `huggingface_hub`)
    live in `_storage/http/`, and only `_storage` imports that room, by no other way
    (a string for `importlib`) and by no re-export of its names: formats and the
    engine ask storage for files and byte ranges by name (`Store`, `folders`, `probes`)."""
    offences = [
        offence
        for name, path in sorted(_modules().items())
        for offence in _network_offences(
            name, name if path.name == "__init__.py" else name.rpartition(".")[0], path.read_text()
        )
    ]
    assert not offences, offences
    reaching = [
        f"{a} -> {b}"
        for a, targets in sorted(GRAPH.items())
        for b in sorted(targets)
        if _in_room(b) and not a.startswith("lazyckpt._storage")
    ]
    assert not reaching, reaching


def test_the_top_level_holds_at_most_16_modules() -> None:
    """A concern that spans several modules gets a room (a subpackage), so that the
    top level stays a short list of verbs and foundations."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 16, f"{len(top)} modules at the top level: {top}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name)
def test_no_module_is_over_500_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 500


def test_nothing_points_outside_the_repository() -> None:
    outside = re.compile(r"ORBAX_FORMAT|\.\./shared|\bspec §")
    files = [
        p
        for folder in ("lazyckpt", "tests", "docs", "benchmarks")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in (".py", ".md", ".yml", ".toml") and p != Path(__file__)
    ]
    files += [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "mkdocs.yml"]
    hits = [f"{p.relative_to(ROOT)}" for p in files if outside.search(p.read_text())]
    assert not hits, hits
