"""One module per `mlight` sub-command; each has `add_parser(subparsers)` and `run(args) -> int`."""
