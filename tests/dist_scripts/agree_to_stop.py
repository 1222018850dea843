"""gputrain.train.loop.signals.agree_to_stop in 2 processes over gloo; started by tests/test_signals.py.

usage: agree_to_stop.py RANK WORLD_SIZE STORE_FILE OUT_DIR

Only rank 1 receives a signal (SIGUSR1, sent to itself inside StopSignals); every rank must then
agree to stop at the same call. Then the path an NCCL job takes (a gloo side group, made once and
cached), forced by making the default backend read "nccl". Writes OUT_DIR/rank-R.json.
"""

import datetime
import json
import os
import signal
import sys
import time

import torch.distributed as dist

from gputrain.runtime.distributed import DistInfo
from gputrain.train.loop import signals


def main(rank, world, store_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    info = DistInfo(True, rank, rank, world, dist.get_backend())
    seen = {}
    with signals.StopSignals() as stop:
        seen["before"] = signals.agree_to_stop(stop.requested is not None, info)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.monotonic() + 5
            while stop.requested is None and time.monotonic() < deadline:
                time.sleep(0.001)
        seen["local"] = stop.requested is not None
        seen["agreed"] = signals.agree_to_stop(stop.requested is not None, info)
        seen["exit_code"] = stop.exit_code
    seen["side_group_before"] = signals._side_group is not None

    # An NCCL default group cannot all-reduce a CPU tensor: agree_to_stop makes a gloo group.
    real = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        seen["nccl_agreed"] = [signals.agree_to_stop(rank == 1, info), signals.agree_to_stop(False, info)]
        first = signals._side_group
        signals.agree_to_stop(False, info)
        seen["side_group_made_once"] = first is not None and signals._side_group is first
        seen["side_group_is_gloo"] = real(first[1]()) == "gloo"
    finally:
        dist.get_backend = real
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()  # no rank closes its sockets while another still reads from them
    dist.destroy_process_group()
    seen_after = signals._side_group is None or signals._side_group[1]() is None
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump({**seen, "side_group_freed": seen_after}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
