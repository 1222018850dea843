"""One module per `gputrain` subcommand: `add_arguments(parser)` and `run(args) -> int`."""
