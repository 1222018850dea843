"""Why a run is as fast and as big as it is: measurements of the step `fit` runs, and what to change.

probe: the training step built as the Trainer builds it (at lr 0), which memory, batch_search and
autotune measure; memory_stats, saved_tensors, estimate, advice: what a step holds in memory and what
saves some; batch_search: the largest batch that fits; profile, trace, syncs, verdict: where a
step's time goes and what bounds it; autotune: the fastest switch set, tried on the real workload;
gpu_util, telemetry, peaks, info, doctor: the machine, its live state and its peak figures. Nothing
here imports bench or commands.
"""
