"""Memory against batch size, with and without recompute, and the largest batch
that fits.

Memory across batch sizes and what recomputing blocks in backward saves, measured. Each batch
size runs real training steps on random data of the workload's shape: gputrain's TrainStep built by
the Trainer as `fit --precision fp32 [--recompute]` builds it (fused AdamW, channels_last for
conv nets), with CUDA graphs off so that every figure is an eager step's (a graph keeps its memory
pool for the whole run) and OOM recovery off so that running out of memory ends the search.

- CUDA: peak_bytes = torch.cuda.max_memory_allocated during a step (model, gradients, optimizer
  state, inputs, activations, workspaces). Batch sizes double until torch.cuda.OutOfMemoryError;
  the error is caught, the memory freed, and the next mode goes on. The last batch that ran is the
  largest that fits (within a factor of two).
- Every device, the CPU included: saved_activation_bytes = bytes of tensors autograd saved for
  backward in one forward pass (saved_tensors_hooks), a device-independent measure of activation
  memory. The CPU has no device-memory limit to hit, so no largest batch is reported there.
"""

from __future__ import annotations

from typing import Any

import torch

from gputrain.bench.cases import CASES, get_case
from gputrain.bench.common import accelerators, device_name, free_device_memory, new_result, saved_tensor_bytes
from gputrain.errors import ConfigError
from gputrain.runtime.oom import is_oom
from gputrain.runtime.timing import measure

LR = 1e-3
CUDA_START, CUDA_MAX = 64, 2**20  # doubling from CUDA_START until out of memory (or CUDA_MAX)


def config_for(quick: bool, device: torch.device, workload: str, batch_sizes: list[int] | None,
               max_batch: int | None) -> dict[str, Any]:
    if batch_sizes:
        sizes = sorted(set(batch_sizes))
    elif quick:
        sizes = [4, 8, 16]
    elif device.type == "cuda":
        top = max_batch or CUDA_MAX
        sizes = [CUDA_START * 2**k for k in range(64) if CUDA_START * 2**k <= top]
    else:
        sizes = [16 * 2**k for k in range(6)]  # 16 .. 512: the CPU has no limit to find
    return {"workload": workload, "batch_sizes": sizes, "mlp_width": 256 if quick else 4096,
            "optimizer": f"AdamW lr {LR}", "precision": "fp32", "quick": quick}


def run_memory(device: str = "auto", quick: bool = False, workload: str = "cifar-cnn",
               batch_sizes: list[int] | None = None, max_batch: int | None = None) -> dict[str, Any]:
    """Peak memory and saved-activation bytes per batch size, without and with recompute (blocks
    computed again in backward). Rows: one per (recompute, batch size); summary: largest batch per mode."""
    if workload not in CASES:
        raise ConfigError(f"unknown benchmark workload {workload!r}: choose from {', '.join(CASES)}")
    gpus, no_gpu = accelerators(device)
    dev = gpus[0] if gpus else torch.device("cpu")
    cuda = dev.type == "cuda"
    cfg = config_for(quick, dev, workload, batch_sizes, max_batch)
    result = new_result("memory", "Memory against batch size, with and without recompute",
                        cfg, gpus, no_gpu)
    result["config"]["device"] = str(dev)
    result["config"]["device_name"] = device_name(dev)
    case = get_case(workload, mlp_width=cfg["mlp_width"])
    modes = [False, True]
    largest: dict[str, Any] = {}
    for recompute in modes:
        label = "recompute" if recompute else "plain"
        fits = None
        for B in cfg["batch_sizes"]:
            row = {"workload": workload, "device": str(dev), "recompute": recompute, "batch": B}
            figures = _one_batch(case, B, dev, recompute)
            if figures is None:  # out of memory: the larger sizes will not fit either
                free_device_memory(dev)
                result["rows"].append({**row, "status": "out of memory", "recomputed": None})
                break
            fits = B
            result["rows"].append({**row, "status": "measured", **figures})
        if cuda:
            tried_all = fits == cfg["batch_sizes"][-1]
            largest[label] = {"largest_batch": fits, "hit_out_of_memory": not tried_all,
                              "note": (f"no out-of-memory up to {fits} (the largest size tried)" if tried_all
                                       else f"{fits} fits, {fits * 2 if fits else cfg['batch_sizes'][0]} does not")}
        else:
            largest[label] = {"largest_batch": None,
                              "note": f"not measured on {dev.type}: no device-memory limit to hit"}
        free_device_memory(dev)
    result["summary"]["largest_batch"] = largest
    _add_ratios(result["rows"])
    result["notes"] += [
        "saved_activation_bytes: tensors saved for backward in one forward pass (saved_tensors_hooks; "
        "parameters excluded): an honest, device-independent measure of activation memory.",
        "peak_bytes (CUDA only): torch.cuda.max_memory_allocated during one training step, everything included.",
        "step_s: median seconds per training step (recompute runs the forward again in backward).",
    ]
    if not cuda:
        result["notes"].append(f"Device memory is not measurable on {dev.type}: peak_bytes and the largest "
                               f"batch are not reported. {no_gpu or ''}".strip())
    else:
        result["summary"]["device_total_bytes"] = int(torch.cuda.get_device_properties(dev).total_memory)
    return result


def _one_batch(case, B: int, dev: torch.device, recompute: bool) -> dict[str, Any] | None:
    """Figures of one batch size (a fresh model from seed 0), or None when it ran out of memory."""
    from gputrain.config import TrainConfig
    from gputrain.train import Trainer

    cuda = dev.type == "cuda"
    trainer = None
    try:
        free_device_memory(dev)
        torch.manual_seed(0)
        x = torch.randn(B, *case.input_shape)
        y = torch.randint(0, 10, (B,))
        config = TrainConfig(device=str(dev), precision="fp32", batch_size=B, steps=10**9, log_every=10**9, lr=LR,
                             cuda_graphs=False, oom_recovery=False, data_on_device=True, recompute=recompute,
                             seed=0)
        trainer = Trainer(case.make_model(), (x, y), loss_fn=torch.nn.CrossEntropyLoss(), config=config)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        trainer.train_one_step()  # the first step at this size: its peak is the figure (also creates AdamW state)
        peak = int(torch.cuda.max_memory_allocated(dev)) if cuda else None
        model, xd, yd = trainer.parts.model.model, x.to(dev), y.to(dev)
        if trainer.parts.speed.channels_last:
            xd = xd.contiguous(memory_format=torch.channels_last)
        loss_fn = torch.nn.CrossEntropyLoss()
        saved = saved_tensor_bytes(lambda: loss_fn(model(xd), yd), exclude=list(model.parameters()))
        t = measure(trainer.train_one_step, dev, warmup=0, repeats=3, min_sample_s=0.0, max_inner=1)
        recomputed = list(trainer.parts.model.recomputed)
    except (RuntimeError, MemoryError) as exc:
        if is_oom(exc):
            return None
        raise
    finally:
        if trainer is not None:
            trainer.close()
    return {"peak_bytes": peak, "saved_activation_bytes": saved, "saved_bytes_per_sample": saved / B,
            "step_s": t["median_s"], "step_min_s": t["min_s"], "step_max_s": t["max_s"], "n": t["n"],
            "recomputed": recomputed}


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    plain = {r["batch"]: r for r in rows if not r["recompute"] and r["status"] == "measured"}
    for r in rows:
        base = plain.get(r["batch"])
        if not r["recompute"] or r["status"] != "measured" or base is None:
            continue
        if base["saved_activation_bytes"]:
            r["activations_vs_plain"] = r["saved_activation_bytes"] / base["saved_activation_bytes"]
        if r["peak_bytes"] and base["peak_bytes"]:
            r["peak_vs_plain"] = r["peak_bytes"] / base["peak_bytes"]
        r["time_vs_plain"] = r["step_s"] / base["step_s"]
