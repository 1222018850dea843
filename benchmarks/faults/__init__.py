"""Fault injection: `gputrain fit` runs killed, stopped, damaged and starved, then resumed and their
final checkpoints compared bit by bit with an uninterrupted run's (harness.py; dcp.py for sharded
checkpoints; tiny.py, the workload they train). benchmarks/fault_injection.py runs the trials in full
counts, tests/test_faults.py a short version of each in the default suite.
"""
