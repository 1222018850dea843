"""The GPU day: one device command, `bash benchmarks/gpu_session.sh day` (session.sh here), that
proves fit on a GPU and measures the speed table, in parts that each have a budget.

day.py runs the parts, each in a process of its own: (a) smoke.py, (b) the conformance zoo's tests,
(c) syncs.py, (d) speed.py, (e) first_step.py, (f) float8.py; report.py reads the day's JSON into
its goals, its Markdown summary and the next device call.
"""
