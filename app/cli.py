"""`mlight` — the headless command line: run, plan, hw, bench, download. Every error a user can cause ends as
one line on stderr and exit code 2 (bad input) or 1 (runtime failure)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import platform as stdlib_platform
import sys

from core import __version__, platform
from core.errors import MlightError

# sub-command -> (module, one-line help). A module is imported only when its command is chosen, and torch only
# when it runs, so that `mlight --help` and `mlight run --help` stay well under a second.
COMMANDS = {
    "run": ("app.commands.run", "generate for a prompts file into JSONL or CSV, resumably"),
    "plan": ("app.commands.plan", "choose batch sizes and placement for a model on a machine"),
    "hw": ("app.commands.hw", "show the detected and measured hardware"),
    "bench": ("app.commands.bench", "measure schedules on a workload and compare with the planner's prediction"),
    "download": ("app.commands.download", "download a model from the Hugging Face Hub"),
}
EPILOG = "`mlight COMMAND --help` for a command's options; `mlight-app` for the terminal app."


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line, like every other user error: what is wrong and where the options are listed."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} — `{self.prog} --help` lists the options\n")


class VersionAction(argparse.Action):
    """--version: mlight's version, then what a bug report needs (Python, OS, the torch build and its GPU)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_report())
        parser.exit()


def version_report() -> str:
    lines = [f"mlight {__version__}",
             f"python {stdlib_platform.python_version()} on {stdlib_platform.system()} {stdlib_platform.machine()}"]
    try:
        import torch
    except Exception as e:  # noqa: BLE001 — a broken torch install is exactly what this should show
        lines.append(f"torch: cannot be imported ({type(e).__name__}: {e})")
        return "\n".join(lines)
    if torch.version.cuda is None:
        gpu = "CPU-only build"
    elif torch.cuda.is_available():
        gpu = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU: {torch.cuda.get_device_name(0)}"
    else:
        gpu = f"CUDA {torch.version.cuda} build, no usable GPU (driver missing or too old?)"
    lines.append(f"torch {torch.__version__} ({gpu})")
    from core.plan.hardware import nvml_gpus  # the driver's view, whatever torch was built for

    nvidia = nvml_gpus() if torch.version.cuda is None else []
    if nvidia:  # the Windows default from PyPI, or an install that picked the wrong build
        lines.append(f"note: this machine has an {nvidia[0]['name']}, which a CPU-only torch cannot use: reinstall with "
                     "mlight's installer, or `uv tool install mlight --torch-backend auto --reinstall`")
    return "\n".join(lines)


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, dict]:
    parser = OneLineParser(prog="mlight", description="Batch inference for MoE LLMs on one GPU + CPU RAM.",
                           epilog=EPILOG)
    parser.add_argument("--version", action=VersionAction,
                        help="show the versions of mlight, Python and torch, and exit")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if a in COMMANDS), None)
    modules = {}
    for name, (modname, line) in COMMANDS.items():
        if wanted != name:
            sub.add_parser(name, help=line)  # listed in --help; parsed fully only when chosen
            continue
        mod = importlib.import_module(modname)
        sp = mod.add_parser(sub)
        sp.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
        modules[name] = mod
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    return until_the_reader_leaves(run_command, sys.argv[1:] if argv is None else argv)


def until_the_reader_leaves(fn, argv: list[str]) -> int:
    """Run a console script's body; a reader that stops early (`| head -1`) ends it quietly, not with a traceback."""
    try:
        try:
            return fn(argv)
        finally:  # also before SystemExit (--help, --version): the flush at exit would raise past us
            sys.stdout.flush()
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):  # the interpreter flushes stdout once more at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # give it somewhere harmless to go
        return 0


def run_command(argv: list[str]) -> int:
    platform.utf8_console()
    parser, modules = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    debug = args.debug or "--debug" in argv
    args.argv = list(argv)  # `mlight run --tensor-parallel K` starts its ranks with the same arguments
    try:
        if getattr(args, "kernels", None):  # `run` and `bench` --kernels: before anything loads a kernel
            from core.model.kernels import set_mode

            set_mode(args.kernels)
        return int(modules[args.command].run(args) or 0)
    except MlightError as e:
        if debug:
            raise
        print(f"mlight {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"mlight {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
