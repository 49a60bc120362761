"""Which cases of a large parameter grid run. By default a cover: every value of each axis, and every edge where
the code takes another branch, at least once; the other cases repeat those code paths. MLIGHT_TEST_MATRIX=full
runs the whole grid (before a change to the code under such a grid, or nightly)."""

from __future__ import annotations

import os

FULL = os.environ.get("MLIGHT_TEST_MATRIX") == "full"


def cover(grid: list, default: list) -> list:
    """`grid` under MLIGHT_TEST_MATRIX=full, else `default` (which must be cases of the grid)."""
    missing = [c for c in default if c not in grid]
    assert not missing, f"not cases of the grid: {missing}"
    return list(grid) if FULL else list(default)
