"""Evaluation.

- `evaluate`: the loss, built-in accuracy and the user's metrics over a whole eval set, on the device.
- `points`: when a run evaluates (eval_every, epoch ends, the run's end).
- `inference`: `evaluate` and `predict` for a trained model, batched on the device.
"""
