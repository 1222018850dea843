"""`gputrain predict RUN_DIR --data ...`: a run's model applied to data; the outputs go to a file."""

from __future__ import annotations

import argparse
from pathlib import Path

from gputrain.commands import trained
from gputrain.commands.argtypes import positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    trained.add_run_arguments(p)
    p.add_argument("--data", required=True, metavar="test|train|FILE",
                   help="the workload's test or train split, or a .pt / .npy file of inputs (raw, as the workload "
                        "stores them: its normalization is applied)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where the outputs go: .pt (torch.save) or .npy (default RUN_DIR/predictions.pt)")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--batch-size", type=positive_int, default=256)


def run(args) -> int:
    import torch

    from gputrain.batch import describe
    from gputrain.errors import ConfigError
    from gputrain.io.preflight import check_output_file
    from gputrain.train.evaluation.inference import predict, save_outputs
    from gputrain.workloads.run_data import run_data

    if args.out:  # before the model is built or run: a bad --out costs nothing
        check_output_file(args.out, "--out", example="predictions.pt", run_dir=args.run_dir)
    r = trained.load(args)
    out = Path(args.out) if args.out else r.run_dir / "predictions.pt"
    data = run_data(r, args.data, targets=False)
    w = r.workload
    with data.blame("predict"):
        outputs = predict(r.model, data.data, loss_fn=w.loss_fn, compute_loss=w.compute_loss,
                          batch_size=args.batch_size, device=args.device)
    try:
        save_outputs(outputs, out)
    except (OSError, RuntimeError) as exc:  # torch.save says a failed write as a RuntimeError (a full disk: .pt)
        why = (exc.strerror or str(exc)) if isinstance(exc, OSError) else \
            "torch.save's write failed: the disk is full, or a file-size limit was reached"
        raise ConfigError(f"--out {out}: cannot write the predictions ({why}); nothing was written: free space or "
                          "choose another --out") from None
    print(trained.describe(r))
    shape = f"{tuple(outputs.shape)} {outputs.dtype}" if isinstance(outputs, torch.Tensor) else describe(outputs)
    print(f"predictions {shape} -> {out}")
    return 0
