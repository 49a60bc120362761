"""Errors a user can cause, each carrying what went wrong and what to do about it; the command line prints
`str(err)` on one line and exits with `exit_code` (anything else is a bug: a traceback with --debug).
"""

from __future__ import annotations


class MlightError(Exception):  # a runtime failure
    exit_code = 1

    def __init__(self, problem: str, hint: str | None = None):
        self.problem, self.hint = problem, hint
        super().__init__(f"{problem} — {hint}" if hint else problem)


class UsageError(MlightError):  # bad input: a flag, a file, a model folder
    exit_code = 2


class ModelError(UsageError):
    """The model folder or checkpoint cannot be used as given."""


class UnsupportedModelError(ModelError):
    """The checkpoint's architecture is not one mlight implements."""


class BudgetError(UsageError):
    """Nothing fits in the memory budget the user gave."""


class GpuMemoryError(MlightError):
    """The GPU cannot hold the run's fixed buffers (resident experts, weight pages) even at a batch of one."""
