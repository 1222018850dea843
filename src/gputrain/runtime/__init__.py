"""The machine a run uses, decided once: devices, precision, processes and the switches for speed.

- devices: finding, choosing and validating a device; precision: the run's numeric precision (one
  object: autocast, scaler, matmul settings given back); speed: the speed switches with their reasons.
- distributed: several processes under torchrun (setup, wrapping, sync control); launch: a refused
  command under `gputrain fit --nproc N`, said once; slurm: srun's variables and a job that requeues itself;
  ray_train: Ray Train's workers (the device Ray gave, Ray's newest checkpoint) and a cluster with room.
- oom: out-of-memory errors recognized and recovered; host_memory: the steps' page faults.
- compile_regions: torch.compile of the whole model or of its repeated block; compile_cache: compiled
  artifacts kept across processes; recompiles: torch.compile's recompilations with their reasons.
- timing: the measuring protocol's timer (torch's private names: gputrain/torch_compat.py, on the ground
  floor).

A floor under the trainer: nothing here imports train, report or checkpoint.
"""
