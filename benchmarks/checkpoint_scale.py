#!/usr/bin/env python
"""What a checkpoint costs at scale: computed from stated assumptions, not measured on a cluster.

For a 7B and a 70B model trained with AdamW (gputrain's bf16: autocast over fp32 weights, so the
checkpoint holds fp32 weights and AdamW's two fp32 moments, 12 bytes per parameter) on 8, 64 and
512 GPUs (8 per node), the table gives, for the sharded (DCP) format:

  - the checkpoint's size per rank (every rank writes its own part: total / GPUs);
  - the write time: a node writes its ranks' parts at the per-node bandwidth to shared storage;
  - the time training is blocked per save: without async, the write plus the read-back hash of
    the rank's files (sha256, one core per rank); with async, the copy of the rank's part to pinned
    host memory at the device-to-host bandwidth (the write and the hash happen in the background);
  - the pinned host memory an async save needs per node (the node's parts, kept between saves);
  - the stop-signal agreement every 10 steps: one all-reduce of one integer over gloo (TCP), modelled
    as a ring of N ranks, 2 (N - 1) steps of one message latency each (a tree would take 2 log2 N);
and, for comparison, today's one-file format: the full state gathered to rank 0, which writes it
alone at one node's bandwidth.

Two inputs are measured on the machine that runs this script (and printed as such): the sha256
rate of one core, and, with --measure-gloo, a 1-integer gloo all-reduce among 2 and 4 processes on
loopback (the per-hop latency of one machine; the table uses the stated network latency).

    python benchmarks/checkpoint_scale.py                 # the markdown table for docs/distributed.md
    python benchmarks/checkpoint_scale.py --measure-gloo --json results/checkpoint_scale.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9

ASSUMPTIONS = {
    "bytes_per_param": 12.0,  # fp32 weights 4 + AdamW exp_avg 4 + exp_avg_sq 4 (bf16 autocast keeps fp32 state)
    "gpus_per_node": 8,
    "node_write_GBps": 5.0,  # one node to the shared file system (a 100-200 Gb/s link, a parallel FS client)
    "d2h_GBps_per_gpu": 20.0,  # device -> pinned host memory per GPU, all 8 GPUs of a node copying at once
    "network_latency_us": 30.0,  # one small TCP message between nodes (gloo), per step of the ring
    "local_latency_us": 10.0,  # the same within one node (loopback TCP), when all ranks share a node
    "gpu_memory_GB": 80.0,  # H100: whether the sharded training state fits at all
}
MODELS = {"7B": 7e9, "70B": 70e9}
GPUS = (8, 64, 512)
AGREE_EVERY = 10  # train/loop/trainer.py SIGNAL_SYNC_EVERY


def sha256_rate(mb: int = 256) -> float:
    """Bytes per second one core hashes (sha256), measured here: burn-in, then the median of 5."""
    data = os.urandom(mb * 2**20)
    hashlib.sha256(data[: 16 * 2**20]).hexdigest()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        times.append(time.perf_counter() - t0)
    return len(data) / sorted(times)[2]


_GLOO_SCRIPT = r"""
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
flag = torch.zeros(1, dtype=torch.int32)
for _ in range(50):
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
times = []
for _ in range(500):
    t0 = time.perf_counter()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    times.sort()
    print(times[len(times) // 2])
dist.destroy_process_group()
"""


def gloo_allreduce_s(nproc: int) -> float:
    """Median seconds of a 1-integer gloo all-reduce (MAX) among nproc processes on loopback."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(_GLOO_SCRIPT)
    try:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={nproc}", f.name], capture_output=True, text=True, env=env,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        return float(done.stdout.strip().splitlines()[-1])
    finally:
        os.unlink(f.name)


def rows(a: dict, hash_Bps: float) -> list[dict]:
    out = []
    for name, params in MODELS.items():
        total = params * a["bytes_per_param"]
        for gpus in GPUS:
            nodes = max(1, gpus // a["gpus_per_node"])
            per_rank = total / gpus
            per_node = total / nodes
            write_s = per_node / (a["node_write_GBps"] * GB)
            hash_s = per_rank / hash_Bps
            stage_s = per_rank / (a["d2h_GBps_per_gpu"] * GB)
            # Every step of the ring waits for its slowest link: a network hop once there are several nodes.
            hop_us = a["network_latency_us"] if nodes > 1 else a["local_latency_us"]
            agree_s = 2 * (gpus - 1) * hop_us * 1e-6
            # Training state on the GPU: the checkpointed fp32 state plus fp32 gradients (4 B/param), sharded.
            on_gpu = (total + 4 * params) / gpus
            out.append({
                "model": name, "gpus": gpus, "nodes": nodes, "total_GB": total / GB, "per_rank_GB": per_rank / GB,
                "write_s": write_s, "hash_s": hash_s, "blocked_sync_s": write_s + hash_s, "blocked_async_s": stage_s,
                "pinned_per_node_GB": per_node / GB, "agree_ms_per_10_steps": agree_s * 1e3,
                "agree_ms_per_step": agree_s * 1e3 / AGREE_EVERY,
                "one_file_write_s": total / (a["node_write_GBps"] * GB), "one_file_rank0_host_GB": total / GB,
                "fits_gpu": on_gpu / GB <= a["gpu_memory_GB"], "state_per_gpu_GB": on_gpu / GB,
            })
    return out


def _t(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min"


def markdown(table: list[dict]) -> str:
    lines = ["| model | GPUs (nodes) | size per rank | write (DCP) | blocked per save, blocking | blocked per save, "
             "async | pinned host memory per node (async) | stop agreement every 10 steps | one file today: "
             "rank 0 writes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        fits = "" if r["fits_gpu"] else f" (training state {r['state_per_gpu_GB']:.0f} GB per GPU: does not fit 80 GB)"
        lines.append(
            f"| {r['model']} | {r['gpus']} ({r['nodes']}) | {r['per_rank_GB']:.2f} GB{fits} | {_t(r['write_s'])} | "
            f"{_t(r['blocked_sync_s'])} | {_t(r['blocked_async_s'])} | {r['pinned_per_node_GB']:.0f} GB | "
            f"{r['agree_ms_per_10_steps']:.1f} ms ({r['agree_ms_per_step']:.2f} ms per step) | "
            f"{_t(r['one_file_write_s'])}, {r['one_file_rank0_host_GB']:.0f} GB on one host |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, value in ASSUMPTIONS.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    ap.add_argument("--measure-gloo", action="store_true", help="also time a gloo all-reduce on loopback (2, 4 procs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    a = {key: getattr(args, key) for key in ASSUMPTIONS}
    hash_Bps = sha256_rate()
    table = rows(a, hash_Bps)
    print(markdown(table))
    print()
    print("Assumptions (stated): " + ", ".join(f"{k} = {v}" for k, v in a.items()))
    print(f"Measured here ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs): sha256 "
          f"{hash_Bps / GB:.2f} GB/s on one core")
    measured = {"sha256_GBps_one_core": hash_Bps / GB}
    if args.measure_gloo:
        for n in (2, 4):
            seconds = gloo_allreduce_s(n)
            measured[f"gloo_allreduce_1int_{n}proc_loopback_us"] = seconds * 1e6
            print(f"Measured here: a 1-integer gloo all-reduce among {n} processes on loopback: {seconds * 1e6:.0f} us "
                  "(median of 500)")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "assumptions": a,
                                               "measured": measured, "rows": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
