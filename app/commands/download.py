"""`mlight download REPO_ID [--revision R]`: fetch a model into the Hugging Face cache, resumably."""

from __future__ import annotations

import argparse

from core.errors import UsageError


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("download", help="download a model from the Hugging Face Hub",
                              description="Download the files mlight needs (safetensors, config, tokenizer) into "
                                          "the Hugging Face cache; rerun to resume.")
    p.add_argument("repo_id", help="org/name on the Hugging Face Hub")
    p.add_argument("--revision", help="branch, tag or commit (default: main)")
    return p


def run(args) -> int:
    from app.commands.run import _ProgressLine
    from core.io.download import download_model, looks_like_repo_id

    if not looks_like_repo_id(args.repo_id):
        raise UsageError(f"{args.repo_id!r} is not a Hugging Face repo id", "use the form org/name")
    print(download_model(args.repo_id, args.revision, progress=_ProgressLine("download", logged=True)))
    return 0
