"""One optimizer step: how a batch becomes a loss, the step that runs it, and what it decides on the
first batch.

- `loss`: the loss rule (compute_loss, a pair with loss_fn, or a model that returns its loss).
- `train_step`: `TrainStep`, the step contract (micro-batches, weights, no_sync, clip, optimizer, OOM split).
- `own_step`: your own step (`step_fn`), run by the same machinery.
- `graphs`: `GraphedStep`, the whole step replayed from a CUDA graph.
- `precision_gate`, `layout`: automatic precision and channels_last, proven on the model's first batch.
- `recompute`: blocks that run their forward again in backward.
- `carried_state`: state a step carries to the next, saved with checkpoints.
"""
