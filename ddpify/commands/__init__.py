"""One module per subcommand: `add_parser(subparsers)` sets `run`, which returns the exit code."""
