"""core's packages import in one direction: model ← plan ← runtime ← io; errors, telemetry and platform below all."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "core"
ORDER = ("model", "plan", "runtime", "io")  # each may import those before it, never after
LEAVES = ("errors.py", "platform.py", "telemetry.py")  # loose modules under all four packages


def _core_imports(path: Path) -> set[str]:
    """Modules under `core` that a file imports (absolute imports, at any depth in the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n == "core" or n.startswith("core.")}
    return found


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ORDER else None


@pytest.mark.parametrize("pkg", ORDER)
def test_package_imports_only_downward(pkg):
    allowed = set(ORDER[:ORDER.index(pkg) + 1])
    bad = []
    for f in sorted((CORE / pkg).rglob("*.py")):
        for m in _core_imports(f):
            target = _package(m)
            if target is not None and target not in allowed:
                bad.append(f"{f.relative_to(CORE.parent)} imports {m}")
    assert not bad, "\n".join(bad)


def test_shared_leaf_modules_import_no_package():
    for leaf in LEAVES:
        assert not {m for m in _core_imports(CORE / leaf) if _package(m)}, leaf
    # the OS module sits below everything, errors and telemetry included
    assert not _core_imports(CORE / "platform.py")


def test_core_is_a_handful_of_packages():
    loose = sorted(p.name for p in CORE.glob("*.py") if p.name != "__init__.py")
    assert loose == list(LEAVES)
    for pkg in ORDER:
        doc = ast.get_docstring(ast.parse((CORE / pkg / "__init__.py").read_text(encoding="utf-8")))
        assert doc and "Imports:" in doc, f"core/{pkg}/__init__.py must say what it may import"


def test_the_check_catches_an_upward_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from core.runtime.engine import Engine\n", encoding="utf-8")
    assert _package(next(iter(_core_imports(f)))) == "runtime"
