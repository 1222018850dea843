"""One module per `gputrain` subcommand: `add_arguments(parser)` and `run(args) -> int`.

- train: `fit`, `sweep`, `slurm` (prints an sbatch script);
- use the trained model: `eval`, `predict`, `export`, sharing `trained` (a run directory and which weights);
- look inside: `memory`, `profile`, `report` (RUN_DIR/report.html), `bench`;
- the machine: `info`, `doctor`;
- `argtypes`: argument types the subcommands share, each refusing a bad value in one line.
"""
