"""What the user has chosen so far, shared by the screens (one Session per app)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.tui.backend import MachineView, ModelView, PlanView, PromptsView


@dataclass
class Options:
    """The `mlight-app` command line: pre-fills the screens (a contract; see main.py)."""

    model: str | None = None
    prompts: str | None = None
    out: str | None = None
    gpu_mem: float | None = None  # GB
    cpu_mem: float | None = None  # GB


@dataclass
class Session:
    options: Options
    machine: MachineView | None = None
    model: ModelView | None = None
    prompts: PromptsView | None = None
    plan: PlanView | None = None
    out_path: Path | None = None
    run_state: str = ""  # "" | running | paused | done | stopped | failed

    def default_out(self) -> Path:
        if self.options.out:
            return Path(self.options.out).expanduser()
        if self.prompts is not None:  # in the working folder: the prompts may sit somewhere read-only
            return Path(self.prompts.path.stem + ".results.jsonl")
        return Path("results.jsonl")
