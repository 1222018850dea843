"""`gputrain export RUN_DIR --format safetensors|hf|onnx`: a run's trained weights as a file others load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gputrain.commands import trained

DEFAULT_NAMES = {"safetensors": "model.safetensors", "hf": "hf", "onnx": "model.onnx"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    trained.add_run_arguments(p)
    p.add_argument("--format", choices=["safetensors", "hf", "onnx"], default="safetensors",
                   help="safetensors (weights, loadable with safetensors.torch.load_file), hf (save_pretrained, "
                        "Hugging Face models), onnx (torch.onnx.export, checked with onnxruntime when installed)")
    p.add_argument("--out", default=None, metavar="PATH",
                   help="file (or folder for hf); default RUN_DIR/export/model.safetensors | hf/ | model.onnx")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")


def run(args) -> int:
    from gputrain import export
    from gputrain.io.preflight import check_output_dir, check_output_file

    if args.out:  # before the model is built: a bad --out costs nothing
        if args.format == "hf":
            check_output_dir(args.out, "--out", run_dir=args.run_dir)
        else:
            check_output_file(args.out, "--out", example=DEFAULT_NAMES[args.format], run_dir=args.run_dir)
    r = trained.load(args)
    out = Path(args.out) if args.out else r.run_dir / "export" / DEFAULT_NAMES[args.format]
    info: dict = {"format": args.format, "path": str(out), "weights": r.weights, "step": r.step,
                  "checkpoint": str(r.checkpoint), "workload": r.workload.name, "part": r.part}
    if args.format == "safetensors":
        export.export_safetensors(r.model.state_dict(), out, metadata={
            "workload": r.workload.name, "weights": r.weights, "step": str(r.step), "format": "pt",
            **({"part": r.part} if r.part else {})})
    elif args.format == "hf":
        export.export_hf(r.model, out)
    else:
        info.update(export.export_onnx(r.model, _example_inputs(r), out, part=r.part))
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(f"{trained.describe(r)}\nexported ({args.format}) -> {out}")
        if args.format == "onnx":
            check = info.get("check")
            diff = info.get("max_abs_diff")
            print(f"checked with {check}" + (f": max |onnxruntime - torch| {diff:.2e}" if diff is not None else ""))
    return 0


def _example_inputs(r):
    """A few test (else train) samples as the model takes them (normalized), on the CPU: the inputs
    of a pair (for a loss_fn, and for a part of the model: a step of your own's pair is not the
    part's call), a dict batch without its labels, or the batch."""
    import torch

    from gputrain.data import BatchTransform, make_loader
    from gputrain.train.step.loss import is_pair

    splits = r.workload.make_data()
    data = splits.test if splits.test is not None else splits.train
    loader, _ = make_loader(data, 4, device=torch.device("cpu"), train=False,
                            transform=BatchTransform(splits.mean, splits.std, key=splits.transform_key).for_eval())
    batch = next(iter(loader.iter_epoch(0, 0)))
    if is_pair(batch) and (r.workload.loss_fn is not None or r.part is not None):
        return batch[0]
    if isinstance(batch, dict):
        return {k: v for k, v in batch.items() if k != "labels"}
    return batch
