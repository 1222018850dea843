"""gputrain's benchmarks, run as modules from the repository root with gputrain importable (the venv
that scripts/setup.sh makes, or PYTHONPATH=src): `python -m benchmarks.train_speed --quick`.

contenders.py holds the contenders that the speed benchmarks share (train_speed.py, real_models.py,
the GPU day's speed part), result_files.py the one JSON writer; gpu_day/ is the GPU day (`bash
benchmarks/gpu_session.sh day`); faults/ is the fault-injection harness (fault_injection.py,
tests/test_faults.py). docs/how-to/measure.md lists every benchmark; their figures: docs/results/ and benchmarks/LOG.md.
"""
