"""The house's layout: rooms by job, the direction of imports between them, one door per name.

Each folder under ``kvflow/`` is a room whose ``__init__`` docstring says what it holds and what
it may import; this test holds the rooms to it:

* ``core`` imports only ``core`` (its purity is ``test_purity.py``'s);
* ``executors`` and ``tiers`` import only ``core`` (and themselves);
* ``log`` imports only ``core``; ``replay`` and ``inspect`` only ``core`` and ``log``;
* nothing imports ``cli`` but ``cli`` (and ``kvflow.__main__``, which runs it);
* torch is imported only in ``executors`` (the core and every other room run without it);
* the top floor holds only the public face, ``__main__`` and the version;
* every name is imported from the module that defines it: no module inside kvflow imports a
  name through another module that merely imported it (no re-exports, no aliases of modules).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvflow"

# room -> the rooms it may import (itself always allowed)
ALLOWED = {
    "core": set(),
    "log": {"core"},
    "engine": {"core", "log"},
    "executors": {"core"},
    "tiers": {"core"},
    "replay": {"core", "log"},
    "inspect": {"core", "log"},
    "simulate": {"core", "log", "engine", "executors", "tiers"},
    "integrations": {"core", "log", "engine", "executors", "tiers"},
    "cli": {"core", "log", "engine", "executors", "tiers", "replay", "inspect", "simulate", "integrations"},
}
# the two public faces: users import from them; kvflow's own modules never do
FACES = {"kvflow", "kvflow.executors"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_file(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    if (path / "__init__.py").exists():
        return path / "__init__.py"
    if path.with_suffix(".py").exists():
        return path.with_suffix(".py")
    return None


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


def kvflow_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every ``import kvflow...`` / ``from kvflow... import`` anywhere in
    the file (functions and TYPE_CHECKING blocks included), plus the modules that importlib is
    asked for by a literal string."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "kvflow"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kvflow":
            found.append((node.lineno, node.module or "", [a.name for a in node.names]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("kvflow."):
            target = node.value.partition(":")[0]
            if all(part.isidentifier() for part in target.split(".")) and module_file(target) is not None:  # a module named in a string (lazy imports)
                found.append((node.lineno, target, []))
    return found


def imported_rooms(path: Path) -> list[tuple[int, str]]:
    out = []
    for line, module, names in kvflow_imports(path):
        targets = [module] + [f"{module}.{n}" for n in names if module_file(f"{module}.{n}") is not None]
        for target in targets:
            room = room_of(target)
            if room is not None:
                out.append((line, room))
    return out


@pytest.mark.parametrize("module", sorted(m for m in MODULES if room_of(m) is not None))
def test_rooms_import_only_what_their_docstring_allows(module: str) -> None:
    room = room_of(module)
    assert room in ALLOWED, f"{module}: a room with no declared imports ({room})"
    allowed = ALLOWED[room] | {room}
    path = MODULES[module]
    bad = [f"{path.relative_to(ROOT)}:{line}: imports kvflow.{r}" for line, r in imported_rooms(path) if r not in allowed]
    assert bad == []


def test_torch_is_imported_only_by_the_executors() -> None:
    bad = []
    for module, path in MODULES.items():
        if room_of(module) == "executors":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(n.split(".")[0] == "torch" for n in names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == []


def test_nothing_imports_the_cli() -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for module, path in MODULES.items()
        if room_of(module) != "cli" and module != "kvflow.__main__"
        for line, room in imported_rooms(path)
        if room == "cli"
    ]
    assert bad == []


def test_the_direction_check_sees_a_wrong_import(tmp_path: Path) -> None:
    # guard against a vacuous check: an import the rules forbid is found, inside a function too
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kvflow.engine.sync import SyncEngine\n    import kvflow.cli.main\n")
    assert [room for _, room in imported_rooms(bad)] == ["engine", "cli"]


def test_the_top_floor_holds_only_the_face() -> None:
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py", "_version.py"]


@pytest.mark.parametrize("room", sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()))
def test_every_room_says_what_it_holds_and_may_import(room: str) -> None:
    doc = ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text(encoding="utf-8")))
    assert doc and "May import" in doc


def _definitions(module: str) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """The names ``module`` defines, and those it binds by ``from kvflow... import``."""
    path = module_file(module)
    assert path is not None, module
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined: set[str] = set()
    imported: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Name,)) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvflow"):
            for a in node.names:
                imported[a.asname or a.name] = (node.module or "", a.name)
    return defined, imported


@pytest.mark.parametrize("module", sorted(MODULES))
def test_one_door_per_name(module: str) -> None:
    """Every ``from kvflow.x import name`` inside kvflow names the module that defines ``name``
    (or a submodule of ``kvflow.x``), never a module that imported it from elsewhere, and never
    one of the public faces."""
    if module in FACES or module == "kvflow.__main__":
        return
    bad = []
    for line, source, names in kvflow_imports(MODULES[module]):
        if not names:
            continue
        if source in FACES and source != "kvflow":
            bad.append(f"line {line}: imports from the face {source}")
            continue
        defined, _ = _definitions(source)
        for name in names:
            if name in defined or module_file(f"{source}.{name}") is not None:
                continue
            bad.append(f"line {line}: {name} is not defined in {source}")
    assert bad == []


def test_no_module_re_exports_a_name_it_imports() -> None:
    """``from kvflow.x import name as name`` is the re-export idiom: a second door. (The public
    faces, ``kvflow`` and ``kvflow.executors``, load their names lazily instead.)"""
    bad = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvflow"):
                bad += [f"{module}: {a.name} as {a.asname}" for a in node.names if a.asname == a.name]
    assert bad == []
