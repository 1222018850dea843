"""What to change to need less memory, and what each change saves.

`recommendations(estimate, device_total_bytes, precision, device)`: 16-bit autocast (bf16, or fp16 on a
GPU without bf16), gradient accumulation,
recompute (blocks computed again in backward) and a smaller batch, each priced in bytes from a memory estimate
(`gputrain.diagnostics.estimate.estimate_memory`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gputrain.diagnostics.estimate import activation_bytes_at, max_batch_from_estimate, precision_of


def recommendations(estimate: dict[str, Any], device_total_bytes: int | None, precision=None,
                    device: torch.device | None = None) -> list[dict[str, Any]]:
    """Ways to need less memory, each with the bytes it saves at the estimate's batch size.

    `device`: the GPU the run trains on; one below compute capability 8.0 (V100, T4) has no bf16, and
    fit refuses it there, so the 16-bit advice is fp16 with loss scaling.
    Each item: action ("bf16" | "fp16" | "accumulate" | "recompute" | "smaller-batch"), what (one line),
    how (the setting), saves_bytes (> 0), total_bytes_after, fits_after (None without a device total).
    Sorted by bytes saved, largest first. Only changes that save something are listed.
    """
    prec = precision_of(precision)[0] if precision is not None else estimate.get("precision", "fp32")
    B = estimate["batch_size"]
    total = estimate["total_bytes"]
    act = estimate["activation_bytes"]
    per = estimate["activation_bytes_per_sample"]
    budget = device_total_bytes
    recs: list[dict[str, Any]] = []

    def add(action: str, what: str, how: str, saves: float) -> None:
        saves = int(saves)
        if saves <= 0:
            return
        after = total - saves
        recs.append({"action": action, "what": what, "how": how, "saves_bytes": saves,
                     "total_bytes_after": after, "fits_after": None if budget is None else after <= budget})

    if prec not in ("bf16", "fp16"):
        measured = estimate.get("bf16_activation_bytes_per_sample") is not None
        bf16_act = activation_bytes_at(estimate, B, bf16=True)  # fp16 stores the same 16 bits
        half = "bf16"
        if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
            half = "fp16"
        scaled = " with loss scaling" if half == "fp16" else ""
        add(half, f"train with {half} autocast{scaled}: saved activations are stored in 16 bits "
            + ("(measured)" if measured else "(about half)"),
            f"--precision {half} (TrainConfig(precision='{half}'))", act - bf16_act)

    if B >= 2:
        k = 2
        if budget is not None and total > budget:
            while k < B and total - per * (B - math.ceil(B / k)) > budget:
                k *= 2
            k = min(k, B)
        micro = math.ceil(B / k)
        add("accumulate", f"gradient accumulation: {k} micro-batches of {micro} keep the effective batch of {B}; "
            "activations scale with the micro-batch",
            f"--batch-size {micro} --accumulate {k}", per * (B - micro))

    blocks = [b for b in estimate.get("blocks", []) if b["activation_bytes_per_sample"] > 0]
    if blocks:
        # Per sample: without recompute every block's activations are stored. With it, each
        # block keeps its input, and backward holds one recomputed block at a time beside the
        # activations outside the blocks (`rest`).
        inside = sum(b["activation_bytes_per_sample"] for b in blocks)
        inputs = sum(b["input_bytes_per_sample"] for b in blocks)
        rest = max(0.0, per - inside)
        after = inputs + max(max(b["activation_bytes_per_sample"] for b in blocks), rest)
        names = ", ".join(b["name"] for b in blocks[:4]) + (", ..." if len(blocks) > 4 else "")
        add("recompute", f"recompute {len(blocks)} block(s) ({names}): keep each "
            "block's input, compute the rest again in backward (about one more forward pass)",
            "--recompute (TrainConfig(recompute=True))", (rest + inside - after) * B)

    if B >= 2:
        if budget is not None and total > budget:
            fit = max_batch_from_estimate(estimate, budget)
            if 1 <= fit < B:
                add("smaller-batch", f"a batch of {fit} fits (the learning rate may need scaling down with it)",
                    f"--batch-size {fit}", per * (B - fit))
        else:
            add("smaller-batch", f"a batch of {B // 2} halves the activations (the learning rate may need scaling)",
                f"--batch-size {B // 2}", per * (B - B // 2))
    recs.sort(key=lambda r: r["saves_bytes"], reverse=True)
    return recs
