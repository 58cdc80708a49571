#!/bin/bash
# t5lite training on a Cloud TPU VM pod slice (e.g. a v4-32: 4 hosts x 4 chips).
#
#   TPU_NAME=my-v4-32 ZONE=us-central2-b t5lite/launch/recipes/tpu_vm_pod.sh \
#     --gin_file=gin/runs/pretrain.gin --gin_file=gin/models/t5_1_1/base.gin \
#     --gin.MIXTURE_OR_TASK_NAME=c4_span_corruption --gin.MODEL_DIR=gs://my-bucket/t5_base
#
# (`t5lite launch --kind=tpu_vm --name=my-v4-32 --dry-run -- <flags>` prints the command.)
# Every worker needs the repo checked out at $WORKDIR (relative to the login folder) and
# t5lite installed (`pip install -e .` plus jax[tpu]); MODEL_DIR on GCS. gcloud runs the same
# command on all workers; each finds its process id and the coordinator (worker 0, port 8482)
# itself, from the TPU VM metadata (t5lite/launch/cluster.py, kind tpu_vm).
#
# A maintenance event or preemption notice sends SIGTERM: the workers agree on one step, all
# save it and exit 42. Run this script again (after the slice is back) to resume from there.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME to the name of the TPU VM}"
: "${ZONE:?set ZONE, e.g. us-central2-b}"
WORKDIR=${WORKDIR:-t5lite}
PYTHON=${PYTHON:-python3}

printf -v flags ' %q' "$@"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" ${PROJECT:+"--project=$PROJECT"} \
  --worker=all --command="cd $WORKDIR && $PYTHON -m t5lite.cli train$flags"
