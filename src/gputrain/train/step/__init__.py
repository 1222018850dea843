"""One optimizer step: how a batch becomes a loss, the pieces a step is made of, the two steps made
of them, and what the first step decides.

- `loss`: the loss rule (compute_loss, a pair with loss_fn, or a model that returns its loss).
- `micro`: the step's micro-batches, their weights, gradient sync on the last, OOM splitting.
- `totals`: the device accumulators (loss sum, named losses, non-finite count, state probe).
- `nonfinite`: on_nan="skip" decided on the device.
- `train_step`: `TrainStep`, the built-in step (and the step's one host read, `read_totals`).
- `own_step`: your own step (`step_fn`) made of the same pieces.
- `graphs`: `GraphedStep`, either step replayed from a CUDA graph.
- `first_step`: the first step's gate (snapshot, probe, retry once, fall back) over its deciders:
  `layout` (channels_last) and `autocast_decider` (an automatic autocast the first step refuses).
- `recompute`: blocks that run their forward again in backward.
- `carried_state`: state a step carries to the next, saved with checkpoints.
"""
