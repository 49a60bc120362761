"""`mlight-app [--model M] [--prompts F] [--out F] [--gpu-mem GB] [--cpu-mem GB] [--max-new-tokens N]`: the
flags pre-fill the screens; with both --model and --prompts the app opens on the Plan step."""

from __future__ import annotations

import argparse
import signal
import sys

from app.cli import OneLineParser, VersionAction, until_the_reader_leaves
from app.commands.run import _positive, gigabytes
from app.tui.session import Options
from core import platform


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="mlight-app", description="The mlight terminal app: plan and run a batch of "
                                "prompts through a Mixture-of-Experts model on this machine.")
    p.add_argument("--model", metavar="M", help="checkpoint folder, Hugging Face repo id, or 'demo' (default: chosen on the Model step)")
    p.add_argument("--prompts", metavar="F", help="prompts file (.txt, .jsonl, .csv, .tsv), or 'demo' (default: chosen on the Prompts step)")
    p.add_argument("--out", metavar="F", help="results file (.jsonl or .csv) (default: NAME.results.jsonl for prompts file NAME, in "
                   "$MLIGHT_RESULTS_DIR or Documents/mlight)")
    p.add_argument("--gpu-mem", metavar="GB", type=gigabytes(0),
                   help="GPU memory budget in GB (default: the GPU's free memory)")
    p.add_argument("--cpu-mem", metavar="GB", type=gigabytes(0),
                   help="CPU memory budget in GB (default: the RAM available now)")
    p.add_argument("--max-new-tokens", metavar="N", type=_positive,
                   help="tokens to generate per prompt, unless its line sets max_new_tokens (default: 128; "
                        "also on the Plan step)")
    p.add_argument("--version", action=VersionAction, help="show the versions of mlight, Python and torch, and exit")
    return p


def parse_options(argv: list[str] | None = None) -> Options:
    return Options(**vars(build_parser().parse_args(argv)))  # the flags' names are Options' fields


def main(argv: list[str] | None = None) -> int:
    return until_the_reader_leaves(run_app, sys.argv[1:] if argv is None else argv)


def run_app(argv: list[str]) -> int:
    from app.tui import glyphs
    from app.tui.app import create_app

    options = parse_options(argv)
    glyphs.setup()  # ASCII where the console cannot show ✓ ✗ ⏎ (before any screen is built)
    app = create_app(options)
    exit_on_stop_signals(app)
    app.run()
    if platform.terminal() == "legacy-console":
        print("mlight-app: tip: Windows Terminal shows this app best; this console lacks some of its symbols")
    return 0


def exit_on_stop_signals(app) -> None:
    """SIGTERM or Ctrl-Break would end the process with the terminal still in the app's mode: end the app the
    way quitting does instead (Ctrl-C reaches the app as a key)."""
    for sig in platform.stop_signals():
        if sig != signal.SIGINT:
            signal.signal(sig, lambda signum, frame: app.exit())


if __name__ == "__main__":
    sys.exit(main())
