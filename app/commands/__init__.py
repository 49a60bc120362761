"""One module per `mlight` sub-command: `add_parser(subparsers) -> ArgumentParser` and `run(args) -> int`."""
