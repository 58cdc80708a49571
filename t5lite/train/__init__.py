"""Training: partitioning (mesh, logical axis rules), optimizers, train state, step fns, loop,
checkpoints and metric writers."""
