"""gputrain's benchmarks, run as modules from the repository root with gputrain importable (the venv
that scripts/setup.sh makes, or PYTHONPATH=src): `python -m benchmarks.train_speed --quick`.

gpu_day/ is the GPU day (`bash benchmarks/gpu_session.sh day`); faults/ is the fault-injection
harness (fault_injection.py, tests/test_faults.py). README.md lists every benchmark with its figures.
"""
