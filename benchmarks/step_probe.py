"""Where a gputrain step's time goes on a CUDA GPU: the host or the GPU.

For each workload: wall time per step of gputrain.fit with CUDA graphs and without, the GPU time of
the captured step alone (back-to-back replays of the graph: no host work between them), and a
minimal hand loop over tensors on the device. Wall much above replay-only means the host bounds
the step (Python, launches, the data pipeline); close to it means the GPU does (the bar: wall
within 1.3x of replay). With resident data the graph also assembles each batch (data/deferred.py). --profile adds
cProfile's top host functions for one graphed run.

Usage (needs CUDA):
  python -m benchmarks.step_probe [--steps 3000] [--workloads iris-mlp,synthetic-cifar] [--profile]

A short warm-up run per workload keeps cuDNN's algorithm search out of the figures; each
run's own warm-up steps and capture stay in, so use enough steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from benchmarks import train_speed as ts
from benchmarks.contenders import Length, hand_loop
from gputrain import TrainConfig
from gputrain.train.loop.trainer import Trainer
from gputrain.workloads import get_workload

BATCH = {"iris-mlp": None, "synthetic-cifar": 64, "mnist1d-cnn": 64, "digits-cnn": 64}


def trainer_for(name: str, steps: int, **extra) -> tuple[Trainer, object, object]:
    wl = get_workload(name, **ts.workload_options(name))
    splits = ts.train_only(wl.make_data())
    torch.manual_seed(0)
    batch = BATCH.get(name) or splits.num_train
    cfg = TrainConfig(device="cuda", batch_size=batch, steps=steps, lr=ts.LR, log_every=1000, **extra)
    return Trainer(wl.make_model(), splits, loss_fn=wl.loss_fn, config=cfg), wl, splits


def replay_only_us(trainer: Trainer, n: int = 500) -> float | None:
    """Microseconds per replay of the captured full-batch step, back to back."""
    if trainer.parts.step.graphed is None or trainer.parts.step.graphed.graph is None:
        return None
    g = trainer.parts.step.graphed.graph
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--workloads", default=",".join(BATCH))
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_probe needs a CUDA GPU")
        return 2
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.steps} steps per run")
    dev = torch.device("cuda")
    for name in args.workloads.split(","):
        trainer_for(name, 50)[0].run()  # warm-up: cuDNN's algorithm search for this workload's shapes
        for graphs in (True, False):
            trainer, wl, splits = trainer_for(name, args.steps, cuda_graphs=graphs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = trainer.run()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.steps * 1e6
            replay = replay_only_us(trainer)
            deferred = bool(getattr(trainer.parts.data.train, "defer", False))
            print(f"{name:16s} graphs {'on ' if graphs else 'off'}: {wall:8.1f} us/step wall"
                  + (f", {replay:.1f} us/step replay only, wall/replay {wall / replay:.2f}x" if replay else "")
                  + f" ({h.summary['precision']}, data {h.summary['data']}"
                  + (", batches assembled in the graph" if graphs and deferred else "") + ")")
        spec = ts.workload_spec(name, BATCH.get(name))
        epochs = max(1, args.steps * spec.batch // spec.inputs.shape[0])
        hand_loop(spec, dev, Length.of_epochs(spec, 1), ts.PLAIN)  # warm-up
        torch.cuda.synchronize()
        length = Length.of_epochs(spec, epochs)
        run = hand_loop(spec, dev, length, ts.PLAIN)  # its model, setup and steps: the call's wall time
        print(f"{name:16s} hand loop fp32: {run.wall_s / length.steps * 1e6:8.1f} us/step")
        if args.profile:
            trainer, _, _ = trainer_for(name, args.steps)
            prof = cProfile.Profile()
            prof.enable()
            trainer.run()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
            print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
