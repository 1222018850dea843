"""The same training run in fp32, tf32, bf16 and fp16: throughput, memory and final loss, vs fp32.

Each precision trains a fresh copy of the model from the same initial weights, on the same batches
(device-resident, visited in the same seeded order), with the same optimizer (AdamW, lr 1e-3),
through gputrain's own Trainer and TrainStep with the switches `gputrain fit --precision P` would
use (CUDA graphs, channels_last, fused AdamW where fit turns them on). Precisions the device cannot
run are listed with resolve_precision's reason instead of numbers.

Figures: samples/s from the median of timed chunks of steps (warm-up steps excluded); peak memory
on CUDA = max_memory_allocated during training minus what was allocated before the model was built
(the data set); activation bytes = tensors saved for backward in one step, measured with
saved_tensors_hooks (device-independent, so it is reported on the CPU too).
"""

from __future__ import annotations

from typing import Any

import torch

from gputrain.bench.cases import CASES, get_case
from gputrain.bench.common import accelerators, device_name, free_device_memory, new_result, saved_tensor_bytes
from gputrain.bench.settings import PRECISIONS
from gputrain.errors import ConfigError
from gputrain.runtime.precision import resolve_precision
from gputrain.runtime.timing import clock, summarize

LR = 1e-3


def config_for(quick: bool = False, workloads: list[str] | None = None, steps: int | None = None,
               batch_size: int | None = None, precisions: list[str] | None = None) -> dict[str, Any]:
    return {
        "workloads": list(workloads or CASES),
        "precisions": list(precisions or PRECISIONS),
        "steps": steps or (4 if quick else 60),  # timed steps per precision
        "warmup_steps": 1 if quick else 5,
        "chunks": 2 if quick else 6,  # timed steps are split into chunks: median/min/max over chunks
        "batch_size": batch_size or (16 if quick else 256),
        "distinct_batches": 2 if quick else 8,  # the data cycles over this many batches
        "mlp_width": 256 if quick else 4096,
        "optimizer": f"AdamW lr {LR}",
        "quick": quick,
    }


def _train(case, prec, device: torch.device, x: torch.Tensor, y: torch.Tensor, cfg: dict[str, Any]) -> dict[str, Any]:
    """Train `steps` (+ warm-up) steps at one precision; returns this precision's figures."""
    from gputrain.config import TrainConfig
    from gputrain.train import Trainer

    cuda = device.type == "cuda"
    B = cfg["batch_size"]
    base = None  # device bytes allocated before the run (CUDA only)
    if cuda:
        free_device_memory(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    torch.manual_seed(0)
    loss_fn = torch.nn.CrossEntropyLoss()
    config = TrainConfig(device=str(device), precision=prec.name, batch_size=B, steps=10**9, log_every=10**9, lr=LR,
                         data_on_device=True, seed=0)
    trainer = Trainer(case.make_model(), (x, y), loss_fn=loss_fn, config=config)
    elapsed = clock(device)
    try:
        for _ in range(cfg["warmup_steps"]):
            trainer.train_one_step()
        first_loss = float(trainer.parts.step.body.totals.take()[0]) / max(1, cfg["warmup_steps"])
        per_chunk = max(1, cfg["steps"] // cfg["chunks"])
        samples = []
        for _ in range(cfg["chunks"]):
            trainer.parts.step.body.totals.take()
            samples.append(elapsed(trainer.train_one_step, per_chunk) / per_chunk)  # seconds per step
        final_loss = float(trainer.parts.step.body.totals.take()[0]) / per_chunk  # mean loss over the last chunk
        peak = int(torch.cuda.max_memory_allocated(device) - base) if base is not None else None
        model = trainer.parts.model.model
        saved = saved_tensor_bytes(lambda: _forward(model, loss_fn, trainer.parts.precision, x[:B], y[:B]),
                                   exclude=list(model.parameters()))
        graphs = trainer.graph_status()
    finally:
        trainer.close()
    t = summarize(samples)
    out = {"status": "measured", "precision": prec.name, "reason": prec.reason, **t,
           "steps": per_chunk * cfg["chunks"], "samples_per_s": B / t["median_s"],
           "samples_per_s_best": B / t["min_s"], "first_loss": first_loss, "final_loss": final_loss,
           "peak_memory_bytes": peak, "saved_activation_bytes": saved, "cuda_graphs": graphs}
    if not cuda:
        out["peak_memory_note"] = f"not measured on {device.type} (no device allocator counter)"
    return out


def _forward(model, loss_fn, run_precision, xb, yb):
    with run_precision.autocast():
        return loss_fn(model(xb), yb)


def run_precision(device: str = "auto", quick: bool = False, workloads: list[str] | None = None,
                  steps: int | None = None, batch_size: int | None = None,
                  precisions: list[str] | None = None) -> dict[str, Any]:
    """Train each workload at each precision on the GPU (else the CPU). Rows: one per
    (workload, precision), with ratios against fp32 of the same workload in this run."""
    cfg = config_for(quick, workloads, steps, batch_size, precisions)
    for p in cfg["precisions"]:
        if p not in PRECISIONS:
            raise ConfigError(f"unknown precision {p!r} for bench precision: choose from {', '.join(PRECISIONS)}")
    gpus, no_gpu = accelerators(device)
    dev = gpus[0] if gpus else torch.device("cpu")
    result = new_result("precision", "Training throughput, memory and loss by precision", cfg, gpus, no_gpu)
    result["config"]["device"] = str(dev)
    result["config"]["device_name"] = device_name(dev)
    for name in cfg["workloads"]:
        case = get_case(name, mlp_width=cfg["mlp_width"])
        x, y = case.make_data(cfg["batch_size"] * cfg["distinct_batches"], dev)
        rows = []
        for p in cfg["precisions"]:
            row = {"workload": name, "description": case.description, "device": str(dev), "precision": p}
            try:
                prec = resolve_precision(p, dev)
            except ConfigError as exc:
                rows.append({**row, "status": f"skipped: {exc}"})
                continue
            rows.append({**row, **_train(case, prec, dev, x, y, cfg)})
            free_device_memory(dev)  # this precision's model and optimizer are gone with _train's frame
        _add_ratios(rows)
        result["rows"] += rows
        del x, y
        free_device_memory(dev)
    result["notes"] += [
        f"Device: {dev} ({device_name(dev)}); each precision trains a fresh model from the same weights on the same batches.",
        "Each step is gputrain's TrainStep with fit's switches for that precision (cuda_graphs per row).",
        "samples/s from the median seconds per step over timed chunks; warm-up steps are not timed.",
        "Ratios are against fp32 of the same workload, measured in this run.",
        "saved_activation_bytes: tensors saved for backward in one step (saved_tensors_hooks; parameters excluded).",
    ]
    if dev.type != "cuda":
        result["notes"].append(f"Peak device memory is not measured on {dev.type}; {no_gpu or ''}".rstrip("; "))
    return result


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    base = next((r for r in rows if r["precision"] == "fp32" and r.get("status") == "measured"), None)
    for r in rows:
        if r.get("status") != "measured" or base is None:
            continue
        r["speedup_vs_fp32"] = r["samples_per_s"] / base["samples_per_s"]
        if r["peak_memory_bytes"] and base["peak_memory_bytes"]:
            r["memory_vs_fp32"] = r["peak_memory_bytes"] / base["peak_memory_bytes"]
        if base["saved_activation_bytes"]:
            r["activations_vs_fp32"] = r["saved_activation_bytes"] / base["saved_activation_bytes"]
        r["final_loss_minus_fp32"] = r["final_loss"] - base["final_loss"]
