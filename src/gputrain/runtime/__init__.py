"""The machine a run uses, decided once: devices, precision, processes and the switches for speed.

devices: finding, choosing and validating a device; precision: the run's numeric precision (one
object: autocast, scaler, matmul settings given back); speed: the speed switches with their reasons;
distributed: several processes under torchrun (setup, wrapping, sync control); slurm: srun's
variables and a job that requeues itself; oom: out-of-memory errors recognized and recovered;
recompiles: torch.compile's recompilations with their reasons; host_memory: the steps' page faults;
timing: the measuring protocol's timer; torch_compat: every private torch name, resolved once. A
floor under the trainer: nothing here imports train, report or checkpoint.
"""
