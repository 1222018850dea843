"""A run's checkpoints: the file format, the sharded format, the store, the named parts, save and resume."""
