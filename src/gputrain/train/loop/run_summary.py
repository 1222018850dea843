"""What a run says about itself: the decisions with their reasons (log and report) and the summary,
read from the run's parts (train/loop/parts.py)."""

from __future__ import annotations

import logging
import statistics
from typing import Any, Sequence

import torch

from gputrain.config import TrainConfig
from gputrain.data.sources import unused_batch_size_note
from gputrain.metric_direction import metric_figures
from gputrain.report.summary import counted, parameters_text
from gputrain.runtime.devices import device_label
from gputrain.runtime.host_memory import allocator_advice, faults_per_step, steps_measured
from gputrain.runtime.speed import SpeedSwitches
from gputrain.train.loop.callbacks import CallbackList
from gputrain.train.loop.parts import RunParts
from gputrain.train.step.graphs import GraphedStep

log = logging.getLogger("gputrain")


def decisions(t: RunParts) -> list[dict[str, str]]:
    """Every decision of the run with its reason: precision, data, loss, optimizer, speed switches."""
    when, why = t.data.eval_points.describe()  # train/evaluation/points.py
    rows = [{"name": "precision", "value": t.precision.name, "reason": t.precision.reason},
            {"name": "data", "value": t.data.placement.kind, "reason": t.data.placement.reason},
            {"name": "loss", "value": t.step.loss.how, "reason": "the first of compute_loss, pair + loss_fn, "
                                                                "the model's own loss that applies"},
            {"name": "evaluation", "value": when, "reason": why},
            {"name": "optimizer", "value": t.optim.optimizer_desc, "reason": optimizer_reason(t.optim.optimizer_desc)},
            {"name": "schedule", "value": _schedule(t), "reason": "given (scheduler=...)" if "given" in
             _schedule(t) else "TrainConfig.schedule and warmup_steps"}]
    rows += t.speed.decisions()
    rows.append(t.model.modes.decision())  # train/modes.py: eval mode kept where the user set it
    callbacks = _callbacks(t.callbacks)
    if callbacks is not None:
        rows.append({"name": "callbacks", "value": callbacks.describe(),
                     "reason": callbacks.cost() or "hooks at log points: no extra host reads, CUDA graphs unchanged"})
    return rows


def optimizer_reason(description: str) -> str:
    """Why the run has its optimizer(s), from their description (train/optim/build.py's, or a step of
    your own's, train/step/own_step.py): yours by name, one given, or the default AdamW."""
    if "(yours, stepped by step_fn)" in description:
        return "yours (optimizer={name: ...}), each stepped by your step_fn with step.step(name)"
    given = "given" in description or "factory" in description
    return ("given" if given else "the default: AdamW") + (
        ", stepped by your step_fn" if description.endswith("stepped by step_fn") else "")


def _schedule(t: RunParts) -> str:
    return t.optim.schedule_desc or f"{t.config.schedule} (built-in)"


def _callbacks(callbacks: CallbackList) -> CallbackList | None:
    """The run's CallbackList when it has callbacks, else None."""
    return callbacks if len(callbacks) else None


def _frozen(t: RunParts):
    """The run's FrozenBase (checkpoint/frozen.py: parameter counts, what checkpoints hold), from the
    checkpoint's "model" part; None without one."""
    return t.checkpoints.model_part.frozen


def announce(t: RunParts) -> None:
    """The run's decisions in the run log (the main process), once its first step is done."""
    if not t.is_main:
        return
    log.info("device: %s", device_label(t.device))
    log.info("precision: %s", t.precision.reason)
    log.info("data: %s", t.data.placement.reason)
    log.info("loss: %s", t.step.loss.how)  # the model's own loss: the call its first step made
    if t.data.eval is not None:
        log.info("evaluation: %s (%s)", *t.data.eval_points.describe())
    batch = t.data.batch_size  # the data's own (a user DataLoader's), None: the iterable's
    log.info("optimizer: %s; %d steps of %s x %d%s%s", t.optim.optimizer_desc, t.data.total_steps,
             batch if batch is not None else "the data's own batches", t.config.accumulate,
             " samples" if batch is not None else "",
             f" x {t.dist.world_size} processes" if t.dist.world_size > 1 else "")
    if (frozen := _frozen(t)) is not None:
        log.info("parameters: %s", parameters_text(frozen.trainable, frozen.frozen))
        if frozen.frozen and t.run_dir:
            log.info("checkpoints: %s", frozen.reason)
    for row in t.speed.decisions():
        log.info("%s: %s (%s)", row["name"], row["value"], row["reason"])
    callbacks = _callbacks(t.callbacks)
    if callbacks is not None:
        log.info("callbacks: %s", callbacks.describe())
        if callbacks.cost():
            log.warning("callbacks: %s", callbacks.cost())

def graph_status(graphed: GraphedStep | None, speed: SpeedSwitches) -> str:
    """"on", or "off: why" (the speed decision's reason, or the capture's failure)."""
    if graphed is None:
        return f"off: {speed.reasons['cuda_graphs']}"
    return "on" if graphed.failed is None else f"off: {graphed.failed}"

def summarize(t: RunParts, elapsed: float, peak: int, stopped: bool, start_step: int = 0) -> None:
    """The History's summary; `start_step`: where this process's loop began (a resumed run's)."""
    recs, st = t.history.records, t.state
    splits = t.step.body.micro.splits
    if splits > 1:
        t.warnings.append(f"out of memory: micro-batches were cut in {splits} (same effective batch)")
    if st.nonfinite_steps:
        t.warnings.append(f"{counted(st.nonfinite_steps, 'step')} had a non-finite loss or gradient"
                             + (" and were skipped" if t.config.on_nan == "skip" else ""))
    if t.model.compile is not None:
        report = t.model.compile.watcher.report()
        summary_recompiles = {k: report[k] for k in ("recompilations", "graph_breaks", "compile_time_s", "events",
                                                     "summary") if k in report}
        if report.get("recompilations") or report.get("graph_breaks"):
            t.warnings.append(report["summary"])
    else:
        summary_recompiles = None
    page_faults = faults_per_step(recs, start_step)  # this process's training steps only
    samples_per_s = steady_rate(recs, st.samples_seen, elapsed)
    step_s = st.samples_seen / st.step / samples_per_s if st.step and samples_per_s else None
    advice: list[str] = []  # report.html's; the terminal's only where measured to matter (runtime/host_memory.py)
    if (allocator := allocator_advice(page_faults, step_s, steps_measured(recs, start_step))) is not None:
        advice.append(allocator.text)
        if t.is_main and allocator.in_terminal:
            log.warning("%s", allocator.text)
    batch_size, mean_batch = t.data.batch_size, None
    if batch_size is None and st.step:  # the data's own batches: their mean size, as they came
        mean_batch = st.samples_seen / (st.step * t.config.accumulate * t.dist.world_size)
        note = unused_batch_size_note(t.data.train, t.config.batch_size,
                                      TrainConfig.__dataclass_fields__["batch_size"].default, mean_batch)
        if note is not None:
            t.warnings.append(note)
            if t.is_main:
                log.warning("%s", note)
    for spike in t.guards.spikes.spikes:
        t.warnings.append(f"loss spike at step {spike['step']}: {spike['loss']:.4g} "
                             f"({spike['loss'] / spike['median']:.1f}x the recent median)")
    summary: dict[str, Any] = {
        "workload": t.config.name,
        "device": device_label(t.device),
        "device_memory_bytes": device_memory(t.device),
        "precision": t.precision.name,
        "precision_reason": t.precision.reason,
        "data": t.data.placement.kind,
        "data_reason": t.data.placement.reason,
        "loss": t.step.loss.how,
        "optimizer": t.optim.optimizer_desc,
        "steps": st.step,
        "total_steps": t.data.total_steps,
        "stopped_early": stopped,
        "stopped_by": st.stopped_by or None,
        "schedule": _schedule(t),
        "callbacks": callbacks.describe() if (callbacks := _callbacks(t.callbacks)) is not None else None,
        "time_s": elapsed,
        "samples": st.samples_seen,
        "samples_per_s": samples_per_s,
        "samples_per_s_how": SAMPLES_PER_S_HOW,
        "peak_memory_bytes": peak or None,
        "host_page_faults_per_step": page_faults,  # minor faults (runtime/host_memory.py); None: not counted
        "world_size": t.dist.world_size,
        "batch_size": batch_size,  # None: the data's own batches (an iterable's, a DataLoader's with batch_size=None)
        "batch_size_mean": mean_batch,  # those batches' mean size, read from them (None: batch_size says it)
        "accumulate": t.config.accumulate,
        "effective_batch": (batch_size or 0) * t.config.accumulate * t.dist.world_size or None,
        "oom_splits": splits,
        "nonfinite_steps": st.nonfinite_steps,
        "on_nan": t.config.on_nan,
        "loss_spikes": list(t.guards.spikes.spikes),
        "cuda_graphs": graph_status(t.step.graphed, t.speed),
        "channels_last": t.speed.channels_last,
        "compile": t.speed.compile,
        "recompilations": summary_recompiles,
        "recompute": t.model.recomputed,  # modules whose activations backward recomputes
        "task": t.task,
        "decisions": _as_ran(decisions(t), t),
        "startup": t.startup.report(),  # the time before the first step, by part (train/loop/startup_costs.py)
        "warnings": list(t.warnings),
        "advice": advice,
    }
    if (frozen := _frozen(t)) is not None:  # parameters that train, and what a checkpoint holds of the rest
        summary.update({"parameters": frozen.trainable + frozen.frozen, "trainable_parameters": frozen.trainable,
                        "frozen_parameters": frozen.frozen, "checkpoint_contents": frozen.reason})
    if t.checkpoints.writer.timings:  # how long the loop stood still per checkpoint, and how long writing took
        summary.update(t.checkpoints.writer.summary())
    names = t.step.body.totals.names if t.step.own else ()  # a step of your own: its losses and rates
    if names and recs:  # each loss's last logged mean (a loss returned on some steps only: where it was)
        summary["step_losses"] = {k: next(r[k] for r in reversed(recs) if k in r) for k in names
                                  if any(k in r for r in recs)}
        summary["learning_rates"] = {k[3:]: v for k, v in recs[-1].items() if k.startswith("lr_")} or None
    summary.update(metric_figures(recs, t.control.metric_direction))
    summary["evaluation"] = t.data.eval_points.describe()[0]
    t.history.summary = summary


def _as_ran(rows: list[dict[str, str]], t: RunParts) -> list[dict[str, str]]:
    """The decisions as the run went: CUDA graphs decided on but then not captured (a step of your
    own that reads step.index, a failed capture) are off, with why."""
    status = graph_status(t.step.graphed, t.speed)
    if t.step.graphed is None or not status.startswith("off: "):
        return rows
    return [{**row, "value": "off", "reason": status[len("off: "):]} if row["name"] == "cuda_graphs" else row
            for row in rows]


# samples/s in the summary: the log points' figures (each the samples of its interval over the
# interval's time, evaluation and logging left out), their median after the first (warm-up:
# allocation, autotuning, capture); the only one when there is one.
SAMPLES_PER_S_HOW = "median of the log points' samples/s after the first"


def steady_rate(records: Sequence[dict[str, Any]], samples_seen: int, elapsed: float) -> float:
    rates = [r["samples_per_s"] for r in records if r.get("samples_per_s")]
    if len(rates) > 1:
        rates = rates[1:]
    return statistics.median(rates) if rates else samples_seen / max(elapsed, 1e-9)


def device_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


