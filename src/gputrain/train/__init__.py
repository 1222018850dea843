"""The training core: the step, its CUDA-graph wrapper, the loss rule, evaluation, the trainer, fit.

Nothing here imports workloads, bench or diagnostics.
"""

from gputrain.train.fit import fit, fit_workload
from gputrain.train.trainer import Trainer

__all__ = ["Trainer", "fit", "fit_workload"]
