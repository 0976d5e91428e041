"""House rules that keep the layout simple: services never import each other, and the
shared package never imports a service."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
SERVICES = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists())


def imported_modules(folder: Path) -> set[str]:
    found: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
    return found


def test_services_exist_as_the_design_lays_out() -> None:
    assert SERVICES == ["gateway", "inference", "sandbox", "scorer", "trainer"]


def test_no_service_imports_another() -> None:
    for name in SERVICES:
        others = {f"flywheel_{s}" for s in SERVICES if s != name}
        bad = {m for m in imported_modules(ROOT / "services" / name) if m.split(".")[0] in others}
        assert not bad, f"services/{name} imports {sorted(bad)}: talk over the bus, or move shared code to shared/flywheel"


def test_shared_package_imports_no_service() -> None:
    services = {f"flywheel_{s}" for s in SERVICES}
    bad = {m for m in imported_modules(ROOT / "shared" / "flywheel") if m.split(".")[0] in services}
    assert not bad, f"shared/flywheel imports services: {sorted(bad)}"
