"""Training: optimizers, schedules, train state, step fns, the loop and in-training evals.

The mesh, checkpoints, MODEL_DIR and metric writers it uses live in t5lite/runtime/, which
eval and export share."""
