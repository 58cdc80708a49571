"""T5X checkpoints (msgpack or tensorstore) and their config.gin, read without T5X."""
