"""What training, evaluation and export share about running a model: the device mesh and
where arrays live (partitioning), agreement between the processes of a job (processes),
SIGTERM as a flag from the CLI's start to the last step (preemption), and a run's MODEL_DIR:
its checkpoints (checkpoints; params for eval, infer and export: checkpoint_reader), their
checksums and the run's log file (integrity), its one writer (lease), its model config,
vocabulary (model_dir) and metrics (metrics_writer); how the `t5lite` command sets up a
process that computes on the CPU (cpu_host).

Below train/, eval/ and export/, so each of them can read and write MODEL_DIRs and lay out
params without importing another; above models/, data/ and families/.
"""
