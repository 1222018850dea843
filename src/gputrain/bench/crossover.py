"""Where the GPU starts to win: one MLP training step on the CPU vs the GPU over width x data size.

The iris-mlp workload's lesson as a picture: an iris MLP (4 features, 150 samples, a few dozen hidden units)
trains slower on an RTX 3080 Ti than on a CPU, because each step is a few dozen tiny kernels whose
launch cost (microseconds each) exceeds their arithmetic. The grid runs from that corner to CIFAR
size (3072 features, large batches, 4096 wide), where the GPU is tens to hundreds of times faster.

A step is gputrain's own training step (TrainStep: forward, backward, fused AdamW, fp32) on one
batch already on the device (no host transfer in the figure), built by the Trainer as `fit` builds
it. GPU modes, each against the same CPU step:
  gpu_eager       the step with CUDA graphs off, kernels launched one by one from Python
  gpu_graph       the same step captured once in a CUDA graph and replayed (one launch per step),
                  what `fit` does by default on CUDA
  gpu_eager_sync  the eager step plus a read of the loss every step: deliberately the tutorials' loop
                  (loss.item() per step, a host sync per step), not what fit does
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from gputrain.bench.common import accelerators, device_name, free_device_memory, new_result, on_device
from gputrain.runtime.timing import measure

if TYPE_CHECKING:
    from gputrain.train import Trainer

# (label, features, classes, batch): iris-sized to CIFAR-sized problems
DEFAULT_DATA = (("iris", 4, 3, 150), ("digits", 64, 10, 256), ("mnist", 784, 10, 512),
                ("cifar", 3072, 10, 512), ("cifar", 3072, 10, 2048))
QUICK_DATA = (("iris", 4, 3, 150), ("mnist", 784, 10, 256))
DEFAULT_WIDTHS = (16, 64, 256, 1024, 4096)
QUICK_WIDTHS = (16, 256)
GPU_MODES = ("gpu_eager", "gpu_graph", "gpu_eager_sync")


def mlp(features: int, width: int, classes: int) -> nn.Sequential:
    """features -> width -> width -> classes with ReLU: the iris-mlp workload's MLP, scaled."""
    return nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, classes))


def step_flops(features: int, width: int, classes: int, batch: int) -> int:
    """Matmul FLOPs of one training step (2 per multiply-add): forward 2 B W, weight gradients
    2 B W, input gradients 2 B (W - the first layer's weights: the data needs no gradient)."""
    first = features * width
    weights = first + width * width + width * classes
    return 2 * batch * weights * 3 - 2 * batch * first


def config_for(quick: bool = False, widths: list[int] | None = None) -> dict[str, Any]:
    return {
        "data": [dict(zip(("label", "features", "classes", "batch"), d)) for d in (QUICK_DATA if quick else DEFAULT_DATA)],
        "widths": sorted(set(widths)) if widths else list(QUICK_WIDTHS if quick else DEFAULT_WIDTHS),
        "model": "MLP features-width-width-classes, ReLU; AdamW lr 1e-3; cross-entropy; fp32",
        "warmup": 2 if quick else 5,
        "repeats": 3 if quick else 7,
        "min_sample_s": 2e-3 if quick else 20e-3,
        "budget_s": 0.5 if quick else 4.0,
        "quick": quick,
    }


def _trainer(features: int, width: int, classes: int, batch: int, device: torch.device, graphs: bool = False):
    """A Trainer on one full batch (the same tensors every step), fp32, with CUDA graphs on or off."""
    from gputrain.config import TrainConfig
    from gputrain.train import Trainer

    torch.manual_seed(0)  # the same initial weights and data on every device
    model = mlp(features, width, classes)
    x = torch.randn(batch, features)
    y = torch.randint(0, classes, (batch,))
    config = TrainConfig(device=str(device), precision="fp32", batch_size=batch, steps=10**9, log_every=10**9,
                         cuda_graphs=graphs, data_on_device=True, oom_recovery=False, seed=0)
    return Trainer(model, (x, y), loss_fn=nn.CrossEntropyLoss(), config=config)


def training_step(trainer: Trainer) -> Callable[[], None]:
    """The trainer's step as `fit` runs it; when graphed, warmed up and captured before timing."""
    if trainer.graph_status() == "on":  # cuda-only: graphs run on CUDA only
        from gputrain.train.step.graphs import WARMUP_STEPS

        for _ in range(WARMUP_STEPS + 1):  # eager warm-up steps, then the capture
            trainer.train_one_step()
        if (status := trainer.graph_status()) != "on":  # the capture failed
            raise RuntimeError(status.removeprefix("off: "))
    return trainer.train_one_step


def _time(make: Callable[[], Callable[[], Any]], device: torch.device, cfg: dict[str, Any]) -> dict[str, Any]:
    try:
        with on_device(device):  # graph capture uses the current device's streams
            fn = make()
            return {"status": "measured", **measure(fn, device, warmup=cfg["warmup"], repeats=cfg["repeats"],
                                                    min_sample_s=cfg["min_sample_s"], budget_s=cfg["budget_s"])}
    except torch.cuda.OutOfMemoryError:
        return {"status": "out of memory"}
    except RuntimeError as exc:  # a failed capture: report it, keep the grid going
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {"status": f"failed: {first}"}
    finally:
        free_device_memory(device)


def _modes(gpu: torch.device | None, shape: tuple[int, int, int, int]) -> dict[str, Callable[[], Callable]]:
    cpu = torch.device("cpu")
    modes: dict[str, Callable[[], Callable]] = {"cpu": lambda: training_step(_trainer(*shape, cpu))}
    if gpu is None:
        return modes
    modes["gpu_eager"] = lambda: training_step(_trainer(*shape, gpu))
    if gpu.type == "cuda":
        modes["gpu_graph"] = lambda: training_step(_trainer(*shape, gpu, graphs=True))

    def with_sync():
        trainer = _trainer(*shape, gpu)

        def step() -> None:
            trainer.train_one_step()
            trainer.parts.step.body.totals.loss_sum.item()  # the tutorials' per-step loss read: a host <-> device sync

        return step

    modes["gpu_eager_sync"] = with_sync
    return modes


def run_crossover(device: str = "auto", quick: bool = False, widths: list[int] | None = None) -> dict[str, Any]:
    """Time one training step per (data, width) cell on the CPU and the GPU (eager, graphed, synced).

    Rows hold per-mode timings (median/min/max/n in seconds) and speed-ups (CPU time / GPU time);
    summary["crossover"] gives, per data size, the smallest width at which each GPU mode wins.
    """
    cfg = config_for(quick, widths)
    gpus, no_gpu = accelerators(device)
    gpu = gpus[0] if gpus else None
    result = new_result("crossover", "One training step, CPU vs GPU, over MLP width x data size", cfg, gpus, no_gpu)
    for d in cfg["data"]:
        for width in cfg["widths"]:
            shape = (d["features"], width, d["classes"], d["batch"])
            row: dict[str, Any] = {"data": d["label"], "features": d["features"], "classes": d["classes"],
                                   "batch": d["batch"], "width": width,
                                   "params": sum(p.numel() for p in mlp(d["features"], width, d["classes"]).parameters()),
                                   "flops_per_step": step_flops(d["features"], width, d["classes"], d["batch"]),
                                   "times": {}, "speedup": {}}
            for mode, make in _modes(gpu, shape).items():
                on = torch.device("cpu") if mode == "cpu" or gpu is None else gpu  # GPU modes come with a GPU only
                row["times"][mode] = _time(make, on, cfg)
            if gpu is None:
                for mode in GPU_MODES:
                    row["times"][mode] = {"status": no_gpu}
            elif "gpu_graph" not in row["times"]:
                row["times"]["gpu_graph"] = {"status": f"n/a: CUDA graphs need a CUDA device, not {gpu.type}"}
            cpu_t = row["times"]["cpu"].get("median_s")
            for mode in GPU_MODES:
                g = row["times"][mode].get("median_s")
                row["speedup"][mode] = cpu_t / g if (cpu_t and g) else None
            result["rows"].append(row)
    result["summary"]["crossover"] = _crossover(result["rows"], cfg) if gpu is not None else no_gpu
    if gpu is not None:
        result["summary"]["gpu_name"] = device_name(gpu)
    result["notes"] += [
        "One step = gputrain's TrainStep (forward + backward + fused AdamW) on one batch already on the device; "
        "fp32 on both sides.",
        "gpu_eager_sync deliberately runs the tutorials' loop (a loss read every step), not what fit does.",
        "Speed-up = CPU step time / GPU step time (medians), measured side by side in this run; > 1: the GPU wins.",
        "gpu_graph: the whole step replayed from one CUDA graph; gpu_eager_sync: eager plus loss.item() per step.",
        f"CPU threads: {torch.get_num_threads()}.",
    ]
    if gpu is None:
        result["notes"].append(f"GPU cells: {no_gpu}; CPU step times only.")
    return result


def _crossover(rows: list[dict[str, Any]], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Per data size: the smallest width at which each GPU mode beats the CPU (None: never in the grid)."""
    out = []
    for d in cfg["data"]:
        cells = [r for r in rows if r["data"] == d["label"] and r["batch"] == d["batch"]]
        entry = {"data": d["label"], "features": d["features"], "batch": d["batch"]}
        for mode in GPU_MODES:
            wins = [r["width"] for r in cells if (r["speedup"].get(mode) or 0) > 1]
            entry[f"{mode}_wins_from_width"] = min(wins) if wins else None
        out.append(entry)
    return out
