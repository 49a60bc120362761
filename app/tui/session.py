"""What the user has chosen so far, shared by the screens (one Session per app)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs

from app.tui.backend import EngineChoices, MachineView, ModelView, PlanView, PromptsView


@dataclass
class Options:
    """The `mlight-app` command line: pre-fills the screens (a contract; see main.py)."""

    model: str | None = None
    prompts: str | None = None
    out: str | None = None
    gpu_mem: float | None = None  # GB
    cpu_mem: float | None = None  # GB
    max_new_tokens: int | None = None  # for prompts that set none (None: the backend's default, 128)


def results_dir() -> Path:
    """Where results go unless the user names a file: $MLIGHT_RESULTS_DIR, else `mlight/` in the user's documents
    folder; not the working folder, which may be a source checkout."""
    env = os.environ.get("MLIGHT_RESULTS_DIR")
    if env:
        return Path(env).expanduser()
    return platformdirs.user_documents_path() / "mlight"


@dataclass
class Session:
    options: Options
    machine: MachineView | None = None
    model: ModelView | None = None
    prompts: PromptsView | None = None
    plan: PlanView | None = None
    out_path: Path | None = None
    out_auto: bool = True  # out_path is the default for the prompts file (it follows a newly chosen one)
    choices: EngineChoices = field(default_factory=EngineChoices)  # the Plan screen's Advanced choices
    skip_agreed: bool = False  # the user agreed to skip the prompts file's bad lines (asked once, before running)
    run_state: str = ""  # "" | running | paused | done | stopped | failed
    failure: str = ""  # what the last failed run's error was about: "" | "dtype" (the CPU lacks a feature)

    def default_out(self) -> Path:
        if self.options.out:
            return Path(self.options.out).expanduser()
        name = (self.prompts.path.stem if self.prompts is not None else "results") + ".results.jsonl"
        return results_dir() / name

    def chosen_out(self) -> Path:
        if self.out_path is not None and not self.out_auto:
            return self.out_path
        return self.default_out()
