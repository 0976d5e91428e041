"""House rules that keep the layout simple, checked on the source:

- services never import each other, and the shared package never imports a service;
- services import the shared package's contract, SDK and runtime, never its tools (``flywheel.ops``,
  the CLI and the user's commands, is the roof: nothing below it leans on it);
- environments import the contract and the SDK alone, and the shared package imports no
  environment (a tool that needs one finds it by entry point, as the CLI's importers do);
- the shared package's layers import downward only: ``flywheel.contract`` imports neither
  ``flywheel.sdk`` nor ``flywheel.ops``; ``flywheel.sdk`` does not import ``flywheel.ops``;
- no import cycles between modules of the shared package and the services;
- an import inside a function either keeps something heavy out of start-up (a package of
  ``HEAVY``, or a module of ours that loads one) or says why it is there.

Every import counts, at module level or inside a function, except those under ``if
TYPE_CHECKING:`` (annotations only: nothing runs them).
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parents[2]
SERVICES = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists())
LAYERS = ("contract", "sdk", "runtime", "ops")  # each may import the ones before it


def module_name(path: Path) -> str:
    """The importable name of a source file of the shared package or a service."""
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "shared":
        parts = list(rel.with_suffix("").parts[1:])
    else:  # services/<name>/... is the package flywheel_<name>
        parts = [f"flywheel_{rel.parts[1]}", *rel.with_suffix("").parts[2:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> Iterator[Path]:
    yield from (ROOT / "shared").rglob("*.py")
    for name in SERVICES:
        yield from (p for p in (ROOT / "services" / name).rglob("*.py") if "migrations" not in p.parts)


def imports(path: Path) -> set[str]:
    """The modules ``path`` imports (absolute names), leaving out imports under TYPE_CHECKING."""
    tree = ast.parse(path.read_text(), str(path))
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            type_only.update(id(n) for n in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    """Module -> the modules of the shared package and the services it imports."""
    paths = list(sources())
    known = {module_name(p) for p in paths}
    return {module_name(p): {m for m in imports(p) if m in known and m != module_name(p)} for p in paths}


def test_services_exist_as_the_design_lays_out() -> None:
    # The design's five, and the orchestrator that owns runs ("in the trainer service or its own").
    assert SERVICES == ["gateway", "inference", "orchestrator", "sandbox", "scorer", "trainer"]


def test_no_service_imports_another() -> None:
    for module, deps in graph().items():
        if not module.startswith("flywheel_"):
            continue
        own = module.split(".")[0]
        bad = {d for d in deps if d.startswith("flywheel_") and d.split(".")[0] != own}
        assert not bad, f"{module} imports {sorted(bad)}: talk over the bus, or move shared code to shared/flywheel"


def test_shared_package_imports_no_service() -> None:
    for module, deps in graph().items():
        if module.startswith("flywheel.") or module == "flywheel":
            bad = {d for d in deps if d.startswith("flywheel_")}
            assert not bad, f"{module} imports services: {sorted(bad)}"


def test_services_lean_on_contract_sdk_and_runtime_alone() -> None:
    for module, deps in graph().items():
        if module.startswith("flywheel_"):
            tools = {d for d in deps if d == "flywheel.ops" or d.startswith("flywheel.ops.")}
            assert not tools, (f"{module} imports {sorted(tools)}: the tools are the roof; move what a service "
                               "needs into flywheel.runtime")


ENVIRONMENTS = sorted(p.name for p in (ROOT / "environments").iterdir() if (p / "__init__.py").exists())


def environment_sources() -> Iterator[tuple[str, Path]]:
    """(environment, source file) of each environment package, leaving out its tests."""
    for name in ENVIRONMENTS:
        for path in (ROOT / "environments" / name).rglob("*.py"):
            if "tests" not in path.relative_to(ROOT / "environments" / name).parts:
                yield name, path


def test_environments_import_the_contract_and_the_sdk_alone() -> None:
    assert ENVIRONMENTS, "the environments folder holds packages"
    for name, path in environment_sources():
        ours = {m for m in imports(path) if m == "flywheel" or m.startswith(("flywheel.", "flywheel_"))}
        bad = {m for m in ours if not m.startswith(("flywheel.contract", "flywheel.sdk"))}
        assert not bad, (f"{path.relative_to(ROOT)} ({name}) imports {sorted(bad)}: an environment is a stranger's "
                         "code; it reaches the platform through flywheel.sdk and flywheel.contract alone")


def test_the_shared_package_and_the_services_import_no_environment() -> None:
    for path in sources():
        found = {m.split(".")[0] for m in imports(path)} & set(ENVIRONMENTS)
        assert not found, (f"{path.relative_to(ROOT)} imports the environment(s) {sorted(found)}: find an "
                           "environment by its id (entry points), never by import")


def test_the_shared_packages_layers_import_downward_only() -> None:
    modules = {m for m in graph() if m.startswith("flywheel.")}
    assert {m.split(".")[1] for m in modules} == set(LAYERS), "every module of shared/flywheel is in a layer"
    for module, deps in graph().items():
        if not module.startswith("flywheel."):
            continue
        layer = LAYERS.index(module.split(".")[1])
        above = {d for d in deps if d.startswith("flywheel.") and LAYERS.index(d.split(".")[1]) > layer}
        assert not above, (f"{module} ({LAYERS[layer]}) imports {sorted(above)}, a layer above it: move the shared "
                           "part down, or the importing code up")


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``edges`` (module -> modules it imports) as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dep in sorted(edges.get(module, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_no_import_cycles() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_rules_catch_what_they_are_for(tmp_path: Path) -> None:
    # The checks above can fail: an import under TYPE_CHECKING does not count, one in a function does,
    # and a cycle is found.
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from flywheel.sdk import x\n"
                                   "def f():\n    from flywheel.ops import cli\n")
    assert imports(tmp_path / "a.py") == {"typing", "typing.TYPE_CHECKING", "flywheel.ops", "flywheel.ops.cli"}
    assert find_cycle({"p": {"q"}, "q": {"r"}, "r": {"p"}, "s": {"p"}}) == ["p", "q", "r", "p"]
    assert find_cycle({"p": {"q"}, "q": set(), "s": {"p", "q"}}) is None


# --- imports inside functions ---------------------------------------------------------------

# Packages whose import costs start-up time, or that an extra may leave out. A function may
# import one of these, or a module of ours that imports one when it is imported, so that
# `--help`, the CLI's other commands and the contract stay quick to load.
HEAVY = {"torch", "transformers", "tokenizers", "safetensors", "accelerate", "numpy", "gguf", "vllm", "deepspeed",
         "fastapi", "starlette", "uvicorn", "httpx", "openai", "mcp", "sqlalchemy", "alembic", "aiosqlite", "asyncpg",
         "docker", "matplotlib", "datasets", "pyarrow", "bm25s", "opentelemetry", "yaml", "nats", "pydantic",
         "pydantic_settings", "peft"}
# Any other import inside a function says why, on its line or in the comment just above it.
REASON = "imported here:"


def load_time_imports(path: Path) -> set[str]:
    """What importing ``path`` imports: its statements outside functions, classes and TYPE_CHECKING."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or (
                isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.Import):
                found.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                found.add(n.module)
                found.update(f"{n.module}.{a.name}" for a in n.names)
    return found


def heavy_modules() -> set[str]:
    """Our modules that import a HEAVY package when imported, directly or through another of ours."""
    loads = {module_name(p): load_time_imports(p) for p in sources()}
    heavy = {m for m, deps in loads.items() if any(d.split(".")[0] in HEAVY for d in deps)}
    while more := {m for m, deps in loads.items() if m not in heavy and deps & heavy}:
        heavy |= more
    return heavy


def unexplained_function_imports(source: str, heavy: set[str]) -> list[tuple[int, str]]:
    """(line, statement) of each import inside a function of ``source`` that loads nothing heavy and
    does not say why."""
    lines = source.splitlines()
    bad = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                names = [n.module, *(f"{n.module}.{a.name}" for a in n.names)]
            else:
                continue
            if any(name.split(".")[0] in HEAVY or name in heavy for name in names):
                continue
            said = [lines[n.lineno - 1]]
            above = n.lineno - 2
            while above >= 0 and lines[above].strip().startswith("#"):
                said.append(lines[above])
                above -= 1
            if not any(REASON in line.lower() for line in said):
                bad.append((n.lineno, lines[n.lineno - 1].strip()))
    return bad


def test_imports_inside_functions_keep_start_up_light_or_say_why() -> None:
    heavy = heavy_modules()
    assert {"flywheel_trainer.engines", "flywheel_gateway.app", "flywheel.contract.settings"} <= heavy
    assert "flywheel.contract.events" not in heavy
    bad = [f"{p.relative_to(ROOT)}:{line}: {statement}" for p in sources()
           for line, statement in unexplained_function_imports(p.read_text(), heavy)]
    assert not bad, ("imports inside functions that keep nothing heavy out of start-up: move them to the top of "
                     f"the module, or say why in a comment above them ('# {REASON} ...'):\n" + "\n".join(bad))


def test_an_import_inside_a_function_without_a_reason_is_found() -> None:
    source = ("def f():\n    import json\n    import torch\n    # imported here: only this path needs it\n"
              "    import csv\n    from flywheel_trainer import engines\n    import os  # Imported here: why\n")
    assert unexplained_function_imports(source, {"flywheel_trainer.engines"}) == [(2, "import json")]


def test_settings_are_read_by_settings_load() -> None:
    # Settings.load() turns a bad FLYWHEEL_* value into a message naming it; Settings() raises
    # pydantic's error instead.
    bare = [f"{p.relative_to(ROOT)}:{i}" for p in sources() if p.name != "settings.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"(?<![\w.])Settings\(\)", line)]
    assert not bare, "Settings() where Settings.load() belongs: " + ", ".join(bare)
