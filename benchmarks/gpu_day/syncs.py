"""Steady-state host syncs of gputrain's step, counted per case (part (c) of `gpu_session.sh day`).

For each case a Trainer is built and run past its start (the warm-up steps, cuDNN's search, the CUDA
graph's capture), then `--steps` more iterations of the loop's own body (`Trainer.run_steps(1)` each:
data, step, scheduler, callbacks' per-step work, the loop's checks) are watched:

  cuda  torch.cuda.set_sync_debug_mode("warn"): every synchronizing CUDA call, with the source line
        that made it (gputrain.diagnostics.syncs.detect_syncs)
  cpu   every read of a tensor's value on the host, each of which would sync on a GPU
        (gputrain.diagnostics.syncs.count_host_reads): the same script exercised without a GPU

The goal is 0 in every row; a sync found is named with its file:line. Log points and evaluations are
kept out of the window (log_every and eval_every beyond it): each reads the loss sums once by design.

Cases: the default step (digits CNN, the workload's defaults), EMA, the built-in cosine schedule with
warm-up, a torch LR scheduler of your own, callbacks with EarlyStopping, your own step (a GAN with two
optimizers, docs/examples/own_step.py), resident input (data_on_device=True) and DataLoader input
(a DataLoader of your own over a Dataset).

    python -m benchmarks.gpu_day.syncs --device cuda --json syncs.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.result_files import write_json

ROOT = Path(__file__).resolve().parents[2]
WARMUP = 10  # steps before the window: the capture and every first-time cost are in them


def _digits():
    from gputrain.workloads import get_workload

    wl = get_workload("digits-cnn")
    return wl, wl.make_data()


def _config(device: str, steps: int, **extra):
    from gputrain import TrainConfig

    far = 10 * (WARMUP + steps)  # no log point and no evaluation inside the window
    return TrainConfig(device=device, batch_size=64, steps=far, log_every=far, eval_every=far, loggers=(), **extra)


def _plain(device: str, steps: int, callbacks=None, **extra) -> dict[str, Any]:
    wl, splits = _digits()
    return {"model": wl.make_model(), "train_data": splits, "loss_fn": wl.loss_fn,
            "eval_data": splits.test, "callbacks": callbacks, "config": _config(device, steps, **extra)}


def _examples():
    """docs/examples/own_step.py, the docs' example of a step of your own (docs/how-to/own-step.md), loaded from its file."""
    spec = importlib.util.spec_from_file_location("own_step", ROOT / "docs" / "examples" / "own_step.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # as an import would (pickle finds it)
    spec.loader.exec_module(module)
    return module


def _own_step(device: str, steps: int) -> dict[str, Any]:
    examples = _examples()
    model = examples.GAN()
    return {"model": model, "train_data": examples.digits(), "step_fn": examples.gan_step,
            "optimizer": examples.gan_optimizers(model), "config": _config(device, steps)}


def _user_loader(device: str, steps: int) -> dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    wl, splits = _digits()
    x, y = splits.train
    x = (x.float() - torch.tensor(splits.mean).view(1, -1, 1, 1)) / torch.tensor(splits.std).view(1, -1, 1, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, drop_last=True)
    return {"model": wl.make_model(), "train_data": loader, "loss_fn": wl.loss_fn,
            "config": _config(device, steps)}


def cases(device: str, steps: int) -> dict[str, Callable[[], dict[str, Any]]]:
    """name -> a function giving Trainer's keyword arguments (fresh model and data each call)."""
    from gputrain import EMA, EarlyStopping

    def cosine_scheduler(opt):
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)

    return {
        "default step (digits-cnn, defaults)": lambda: _plain(device, steps),
        "EMA": lambda: _plain(device, steps, callbacks=[EMA(decay=0.99)]),
        "schedule cosine + warm-up (built in)": lambda: _plain(device, steps, schedule="cosine", warmup_steps=5),
        "scheduler of your own (CosineAnnealingLR)": lambda: {**_plain(device, steps), "scheduler": cosine_scheduler},
        "callbacks with EarlyStopping": lambda: _plain(device, steps, callbacks=[
            EarlyStopping(metric="eval_loss", patience=2), EMA(decay=0.99)]),
        "your own step (GAN, two optimizers)": lambda: _own_step(device, steps),
        "resident input (data_on_device=True)": lambda: _plain(device, steps, data_on_device=True),
        "DataLoader input (your own DataLoader)": lambda: _user_loader(device, steps),
    }


def count_case(make: Callable[[], dict[str, Any]], device: str, steps: int) -> dict[str, Any]:
    """Build the trainer, run WARMUP steps, then count the next `steps` iterations' syncs (host reads)."""
    from gputrain.diagnostics.syncs import count_host_reads, detect_syncs
    from gputrain.train.loop.trainer import Trainer

    kwargs = make()
    trainer = Trainer(kwargs.pop("model"), kwargs.pop("train_data"), **kwargs)
    try:
        trainer.run_steps(WARMUP)
        # A partial, not a lambda: a frame of this file would be the "user code" every sync is
        # attributed to; this way the line named is the user's (own step) or gputrain's.
        one = functools.partial(trainer.run_steps, 1)
        if device.startswith("cuda"):
            found = detect_syncs(one, steps=steps, warmup=0, device=device)
        else:
            found = count_host_reads(one, steps=steps)
        return {"status": "ok", "counted": found["kind"], "steps": found["steps"], "syncs": found["total"],
                "sites": [{"where": f"{s['file']}:{s['line']}", "function": s["function"], "code": s["code"],
                           "what": s["what"], "count": s["count"]} for s in found["sites"]],
                "graph_status": trainer.graph_status(), "precision": trainer.parts.precision.name}
    finally:
        trainer.close()


def consume_sync_debug_notice() -> None:
    """torch warns once per process, when the sync debug mode is first set, that it is a prototype;
    the warning's text says "synchronization", which detect_syncs would count as a sync of the first
    case. Set the mode once here, with that warning silenced, so that every case counts syncs only."""
    if torch.cuda.is_available():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.cuda.set_sync_debug_mode("warn")
            torch.cuda.set_sync_debug_mode(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=50, help="steady steps counted per case (default 50)")
    ap.add_argument("--only", default=None, help="run only the cases whose name contains this text")
    ap.add_argument("--json", type=Path, required=True, help="where the rows go (rewritten after each case)")
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("gputrain").setLevel(logging.WARNING)
    consume_sync_debug_notice()
    result: dict[str, Any] = {
        "part": "syncs", "status": "ok", "device": args.device, "steps": args.steps, "warmup_steps": WARMUP,
        "method": ("torch.cuda.set_sync_debug_mode('warn'), each warning's source line" if args.device.startswith("cuda")
                   else "host reads (gputrain.diagnostics.syncs.count_host_reads): what would sync on a GPU"),
        "goal": "0 syncs per case", "rows": []}
    for name, make in cases(args.device, args.steps).items():
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        try:
            row = {"case": name, **count_case(make, args.device, args.steps)}
        except Exception as exc:  # one broken case must not cost the others their figures
            traceback.print_exc()
            row = {"case": name, "status": "error", "error": f"{type(exc).__name__}: {exc}"}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        result["rows"].append(row)
        where = "; ".join(f"{s['where']} ({s['what']}) x{s['count']}" for s in row.get("sites", []))
        print(f"{name:45s} {row['status']:6s} syncs {row.get('syncs')!s:>4s}  {where or row.get('error', '')}", flush=True)
        write_json(args.json, result)
    if any(r["status"] != "ok" for r in result["rows"]):
        result["status"] = "failures"
    write_json(args.json, result)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
