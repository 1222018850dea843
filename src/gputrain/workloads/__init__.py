"""Built-in workloads (data + model + loss + tuned defaults) and the user's own.

    from gputrain.workloads import get_workload, list_workloads, resolve_workload
    w = get_workload("mnist1d-cnn")          # or resolve_workload("mypkg.tasks:make_workload")
    data, model = w.make_data(), w.make_model()
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
