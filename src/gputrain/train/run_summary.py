"""What a run says about itself: the decisions with their reasons (log and report) and the summary.

Functions of the Trainer `t` that read its parts and state.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from gputrain.runtime.devices import device_label
from gputrain.runtime.host_memory import allocator_advice, faults_per_step

log = logging.getLogger("gputrain")


def decisions(t) -> list[dict[str, str]]:
    """Every decision of the run with its reason: precision, data, loss, optimizer, speed switches."""
    rows = [{"name": "precision", "value": t.precision.name, "reason": t.precision.reason},
            {"name": "data", "value": t.placement.kind, "reason": t.placement.reason},
            {"name": "loss", "value": t.loss.how, "reason": "the first of compute_loss, pair + loss_fn, "
                                                                "the model's own loss that applies"},
            {"name": "optimizer", "value": t.optimizer_desc, "reason": "given" if "given" in
             t.optimizer_desc or "factory" in t.optimizer_desc else "the default: AdamW"},
            {"name": "schedule", "value": _schedule(t), "reason": "given (scheduler=...)" if "given" in
             _schedule(t) else "TrainConfig.schedule and warmup_steps"}]
    rows += t.speed.decisions()
    callbacks = _callbacks(t)
    if callbacks is not None:
        rows.append({"name": "callbacks", "value": callbacks.describe(),
                     "reason": callbacks.cost() or "hooks at log points: no extra host reads, CUDA graphs unchanged"})
    return rows


def _schedule(t) -> str:
    return getattr(t, "schedule_desc", None) or f"{t.config.schedule} (built-in)"


def _callbacks(t):
    """The run's CallbackList when it has callbacks, else None (also for trainer-like stand-ins)."""
    callbacks = getattr(t, "callbacks", None)
    return callbacks if callbacks is not None and len(callbacks) else None

def announce(t) -> None:
    if not t.is_main:
        return
    log.info("device: %s", device_label(t.device))
    log.info("precision: %s", t.precision.reason)
    log.info("data: %s", t.placement.reason)
    log.info("loss: %s", t.loss.how)
    batch = getattr(t, "batch_size", t.config.batch_size)  # the data's own (a user DataLoader's), None: the iterable's
    log.info("optimizer: %s; %d steps of %s x %d%s%s", t.optimizer_desc, t.total_steps,
             batch if batch is not None else "the iterable's own batches", t.config.accumulate,
             " samples" if batch is not None else "",
             f" x {t.dist.world_size} processes" if t.dist.world_size > 1 else "")
    for row in t.speed.decisions():
        log.info("%s: %s (%s)", row["name"], row["value"], row["reason"])
    callbacks = _callbacks(t)
    if callbacks is not None:
        log.info("callbacks: %s", callbacks.describe())
        if callbacks.cost():
            log.warning("callbacks: %s", callbacks.cost())

def graph_status(t) -> str:
    if t.graphed is None:
        return f"off: {t.speed.reasons['cuda_graphs']}"
    return "on" if t.graphed.failed is None else f"off: {t.graphed.failed}"

def summarize(t, elapsed: float, peak: int, stopped: bool, start_step: int = 0) -> None:
    """The History's summary; `start_step`: where this process's loop began (a resumed run's)."""
    recs, st = t.history.records, t.state
    splits = t.train_step.splits
    if splits > 1:
        t.warnings.append(f"out of memory: micro-batches were cut in {splits} (same effective batch)")
    if st.nonfinite_steps:
        t.warnings.append(f"{st.nonfinite_steps} step(s) had a non-finite loss or gradient"
                             + (" and were skipped" if t.config.on_nan == "skip" else ""))
    if t.recompiles is not None:
        report = t.recompiles.report()
        summary_recompiles = {k: report[k] for k in ("recompilations", "graph_breaks", "compile_time_s", "events",
                                                     "summary") if k in report}
        if report.get("recompilations") or report.get("graph_breaks"):
            t.warnings.append(report["summary"])
    else:
        summary_recompiles = None
    page_faults = faults_per_step([r for r in recs if r["step"] > start_step])  # this process's counts only
    if (advice := allocator_advice(page_faults)) is not None:
        t.warnings.append(advice)
        if t.is_main:  # in the terminal too: the advice is about how Python is started next time
            log.warning("%s", advice)
    for spike in t.spikes.spikes:
        t.warnings.append(f"loss spike at step {spike['step']}: {spike['loss']:.4g} "
                             f"({spike['loss'] / spike['median']:.1f}x the recent median)")
    summary: dict[str, Any] = {
        "workload": t.config.name,
        "device": device_label(t.device),
        "device_memory_bytes": device_memory(t.device),
        "precision": t.precision.name,
        "precision_reason": t.precision.reason,
        "data": t.placement.kind,
        "data_reason": t.placement.reason,
        "loss": t.loss.how,
        "optimizer": t.optimizer_desc,
        "steps": st.step,
        "total_steps": t.total_steps,
        "stopped_early": stopped,
        "stopped_by": st.stopped_by or None,
        "schedule": _schedule(t),
        "callbacks": callbacks.describe() if (callbacks := _callbacks(t)) is not None else None,
        "time_s": elapsed,
        "samples": st.samples_seen,
        "samples_per_s": steady_rate(t, elapsed),
        "peak_memory_bytes": peak or None,
        "host_page_faults_per_step": page_faults,  # minor faults (runtime/host_memory.py); None: not counted
        "world_size": t.dist.world_size,
        "batch_size": getattr(t, "batch_size", t.config.batch_size),
        "accumulate": t.config.accumulate,
        "effective_batch": (getattr(t, "batch_size", t.config.batch_size) or 0) * t.config.accumulate
                           * t.dist.world_size or None,
        "oom_splits": splits,
        "nonfinite_steps": st.nonfinite_steps,
        "on_nan": t.config.on_nan,
        "loss_spikes": list(t.spikes.spikes),
        "cuda_graphs": t.graph_status(),
        "channels_last": t.speed.channels_last,
        "compile": t.speed.compile,
        "recompilations": summary_recompiles,
        "recompute": t.recomputed,  # modules whose activations backward recomputes
        "task": t.task,
        "decisions": t.decisions(),
        "warnings": list(t.warnings),
    }
    if t.checkpointer.timings:  # how long the loop stood still per checkpoint, and how long writing took
        summary.update(t.checkpointer.summary())
    if recs:
        summary["final_loss"] = recs[-1].get("loss")
        eval_keys = sorted({k for r in recs for k in r if k.startswith("eval_")})
        for key in eval_keys:
            vals = [r[key] for r in recs if isinstance(r.get(key), (int, float))]
            if vals:
                summary[f"final_{key}"] = vals[-1]
                summary[f"best_{key}"] = min(vals) if key == "eval_loss" else max(vals)
    t.history.summary = summary

def steady_rate(t, elapsed: float) -> float:
    rates = [r["samples_per_s"] for r in t.history.records if r.get("samples_per_s")]
    # The first interval includes warm-up (allocation, autotuning, capture); report the rest.
    if len(rates) > 2:
        rates = rates[1:]
    return sorted(rates)[len(rates) // 2] if rates else t.state.samples_seen / max(elapsed, 1e-9)


def device_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


