"""What the planner and the runtime must agree on is defined once (core/model/limits.py), and a helper
two modules need lives in one of them: a copy that drifts makes the planner predict one runtime and
the code run another."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "core"
SHARED = {"FUSED_MAX_TOKENS", "FUSED_TOKENS", "FUSED_CHUNK_BYTES", "LOOKAHEAD", "ALIGN", "_ALIGN", "_BLOCK_ELEMS", "CHUNK",
          "SCORE_BLOCK_ELEMS", "LINEAR_CHUNK", "STAGING_ALIGN", "LAYOUT_ALIGN"}
OWN: set = set()  # (module, name) pairs allowed their own copy


def _module_numbers(path: Path) -> set[str]:
    """Names a module binds to a number at its top level (NAME = 64, NAME = 1 << 24)."""
    out = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            numeric = value is not None and all(isinstance(n, (ast.Constant, ast.BinOp, ast.operator))
                                                for n in ast.walk(value) if not isinstance(n, ast.expr_context))
            if numeric:
                out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def test_numbers_the_planner_and_the_runtime_share_are_defined_once():
    where = {}
    for f in sorted(CORE.rglob("*.py")):
        rel = f.relative_to(CORE).as_posix()
        for name in _module_numbers(f) & SHARED:
            if (rel, name) not in OWN:
                where.setdefault(name, []).append(rel)
    assert {n: w for n, w in where.items() if w != ["model/limits.py"]} == {}


def test_one_free_cores_helper():
    defs = [f.relative_to(CORE).as_posix() for f in sorted(CORE.rglob("*.py"))
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
            if isinstance(node, ast.FunctionDef) and node.name in ("free_cores", "llc_bytes")]
    assert sorted(defs) == ["platform.py", "platform.py"]


def test_the_runtime_uses_the_shared_numbers():
    from core.model import attention, fused_moe, limits, linear_attention, weights
    from core.plan import hrm, mixer_costs, planner
    from core.runtime import pipeline, schedule

    assert fused_moe.FUSED_MAX_TOKENS == planner.FUSED_TOKENS == limits.FUSED_MAX_TOKENS
    assert schedule.LOOKAHEAD == hrm.LOOKAHEAD == limits.LOOKAHEAD
    assert pipeline._ALIGN == planner.ALIGN == limits.STAGING_ALIGN
    assert weights._ALIGN == hrm.LAYOUT_ALIGN == limits.LAYOUT_ALIGN  # the planner counts the layout's padding
    assert attention._BLOCK_ELEMS == mixer_costs.SCORE_BLOCK_ELEMS and linear_attention.CHUNK == mixer_costs.CHUNK
