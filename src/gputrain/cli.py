"""The `gputrain` command line: parses arguments and hands each subcommand to its module.

Each subcommand lives in gputrain/commands/<name>.py with `add_arguments(parser)` and
`run(args) -> int`. Modules load only when their command runs, so `gputrain info` stays fast.
Library code returns data; the command modules render it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gputrain.errors import GputrainError, StopRequested

COMMANDS = {
    "info": "show PyTorch's build, every device and live GPU telemetry",
    "doctor": "check this machine's GPU setup and measure it",
    "fit": "train a built-in or user workload",
    "bench": "benchmarks: matmul, transfer, crossover, precision, memory",
    "memory": "estimate and measure a workload's memory; find the largest batch",
    "profile": "profile a few training steps and say what bounds them",
    "report": "write RUN_DIR/report.html: a run's curves, speed decisions, memory and warnings on one page",
    "slurm": "print an sbatch script that trains a workload on N nodes x G GPUs (requeues itself, resumes), or a "
             "sweep's job array (--sweep: each task one more worker of its study)",
    "eval": "evaluate a run's trained weights (best or last, EMA when kept) on its data",
    "predict": "apply a run's trained model to data and write the outputs to a file",
    "export": "write a run's trained weights as safetensors, a Hugging Face folder or ONNX",
    "sweep": "search hyperparameters with Optuna: each trial a run directory, the study in SQLite (resumable) or "
             "a database that workers on several machines join (--storage)",
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors ("gputrain fit: error: ...") and exit code 2."""

    def error(self, message: str):
        if message.endswith("expected one argument"):  # argparse takes "--flag --value" for two flags
            message += "; a value that starts with '-' is written --flag=VALUE"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gputrain", description="Train PyTorch models on the GPU correctly and fast.")
    from gputrain.version import __version__

    parser.add_argument("--version", action="version", version=f"gputrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=f"gputrain.commands.{name}")
        importlib.import_module(f"gputrain.commands.{name}").add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Build only the chosen subcommand's parser when we can: importing every command module costs
    # time (bench and profile pull in matplotlib).
    parser = _parser_for(argv)
    args = parser.parse_args(argv)
    args._argv = list(argv)  # what a launcher (fit --nproc) passes on to its processes
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except StopRequested as exc:  # a stop signal: checkpointed; the last line says how to resume
        print(f"gputrain {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except GputrainError as exc:  # said once under fit --nproc (runtime/launch.py)
        __import__("gputrain.runtime.launch").runtime.launch.say_refusal(f"gputrain {args.command}: error: {exc}")
        return 2
    except KeyboardInterrupt:
        print(f"gputrain {args.command}: interrupted", file=sys.stderr)
        return 130


def _parser_for(argv: list[str]) -> argparse.ArgumentParser:
    first = next((a for a in argv if not a.startswith("-")), None)
    if first not in COMMANDS:
        return build_parser()
    from gputrain.version import __version__

    parser = _Parser(prog="gputrain", description="Train PyTorch models on the GPU correctly and fast.")
    parser.add_argument("--version", action="version", version=f"gputrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=f"gputrain.commands.{name}")
        if name == first:
            importlib.import_module(f"gputrain.commands.{name}").add_arguments(p)
    return parser
