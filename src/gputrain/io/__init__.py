"""Files, written whole or not at all, and read back with a clear line when they are wrong.

atomic: every file gputrain writes goes through it (a temporary file renamed into place); run_layout:
the names of what a run directory holds (config.toml, history.json, checkpoints/, ...); preflight:
run directories and output paths, checked before anything is written; history: a run's History
(history.json); data_files:
a user's .pt / .npy data, read safely; toml_file: TOML read with the line of each key, and written
back. A floor under the trainer: nothing here imports train, report or checkpoint.
"""
