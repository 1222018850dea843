"""Built-in workloads (data + model + loss + tuned defaults) and the user's own.

    from gputrain.workloads import get_workload, list_workloads, resolve_workload
    w = get_workload("mnist1d-cnn")          # or resolve_workload("mypkg.tasks:make_workload")
    data, model = w.make_data(), w.make_model()

- `base`: what a workload is (`Workload`: data + model + loss + defaults, under a name);
  `registry`: workloads by name, the built-in ones and the user's own "module:function".
- `datasets`: the built-in workloads' data (nothing is downloaded); `text`: character-level token data;
  `models`: the built-in workloads' models; `real_models`: ResNet-18 and a small GPT, for speed work.
- `from_run`: a trained workload model back from its run directory (eval, predict, export);
  `run_data`: the data those commands run on, checked against the workload's.
"""

from gputrain.workloads.base import DataSplits, Workload
from gputrain.workloads.registry import (
    WORKLOADS,
    get_workload,
    list_workloads,
    load_user_workload,
    resolve_workload,
)

__all__ = ["Workload", "DataSplits", "get_workload", "resolve_workload", "load_user_workload",
           "list_workloads", "WORKLOADS"]
