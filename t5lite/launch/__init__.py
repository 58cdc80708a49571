"""Launching pod training jobs: cluster detection, multi-host initialization, launch recipes.

  cluster.py      which cluster this process runs in (TPU VM pod, SLURM, JobSet, Open MPI),
                  from environment variables alone: coordinator, process count, process id
  distributed.py  jax.distributed.initialize from flags or the detected cluster, failing fast
  peers.py        the coordination service in a process of its own; a lost process ends the
                  others with LOST_PROCESS_EXIT_CODE (43)
  commands.py     the per-host commands of a topology (what `t5lite launch` prints or runs)
  cli.py          `t5lite launch`
  recipes/        a TPU VM pod script, a SLURM sbatch script, a Kubernetes JobSet manifest
  README.md       choosing mesh shapes on pods; the launch recipes explained

Exit codes of `t5lite train` that schedulers act on: 0 done, 1 failed, 2 bad setup (config,
flags, mesh, or a distributed runtime that did not come up), PREEMPTED_EXIT_CODE: stopped on
SIGTERM after every process saved the same step; rerun the same command to resume (the
SIGTERM flag itself is t5lite/runtime/preemption.py, which the trainer shares); 43: another
process of the job was lost (peers.py); rerun every process to resume.
"""

PREEMPTED_EXIT_CODE = 42
