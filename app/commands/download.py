"""`mlight download REPO_ID [--revision R]`: fetch a model into the Hugging Face cache, resumably."""

from __future__ import annotations

import argparse
import sys

from core.errors import UsageError
from core.telemetry import WarningEvent


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("download", help="download a model from the Hugging Face Hub",
                              description="Download the files mlight needs (safetensors, config, tokenizer) into "
                                          "the Hugging Face cache; rerun to resume.")
    p.add_argument("repo_id", help="org/name on the Hugging Face Hub")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    return p


class _Printer:
    """One progress line: rewritten in place on a terminal, a line every 10 % otherwise."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.step = -1

    def __call__(self, ev) -> None:
        if isinstance(ev, WarningEvent):
            print(f"mlight download: warning: {ev.message}", file=sys.stderr, flush=True)
            return
        if getattr(ev, "unit", None) != "B":
            return
        pct = 100 * ev.done // ev.total if ev.total else 100
        rate = getattr(ev, "rate", 0.0)
        text = f"{ev.what}: {ev.done / 1e6:.1f}/{ev.total / 1e6:.1f} MB ({pct}%) {rate / 1e6:.1f} MB/s"
        if self.tty:
            print("\r" + text.ljust(90), end="" if ev.done < ev.total else "\n", file=sys.stderr, flush=True)
        elif pct // 10 != self.step:
            self.step = pct // 10
            print(text, file=sys.stderr, flush=True)


def run(args) -> int:
    from core.io.download import download_model, looks_like_repo_id

    if not looks_like_repo_id(args.repo_id):
        raise UsageError(f"{args.repo_id!r} is not a Hugging Face repo id", "use the form org/name")
    path = download_model(args.repo_id, args.revision, progress=_Printer())
    print(path)
    return 0
