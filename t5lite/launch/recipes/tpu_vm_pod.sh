#!/bin/bash
# t5lite training on a Cloud TPU VM pod slice (e.g. a v4-32: 4 hosts x 4 chips).
#
#   TPU_NAME=my-v4-32 ZONE=us-central2-b GCS_BUCKET=my-bucket t5lite/launch/recipes/tpu_vm_pod.sh \
#     --gin_file=gin/runs/pretrain.gin --gin_file=gin/models/t5_1_1/base.gin \
#     --gin.MIXTURE_OR_TASK_NAME=c4_span_corruption --gin.MODEL_DIR=gs://my-bucket/t5_base
#
# (`t5lite launch --kind=tpu_vm --name=my-v4-32 --dry-run -- <flags>` prints the command.)
# Every worker needs the repo checked out at $WORKDIR (relative to the login folder) and
# t5lite installed (`pip install -e .` plus jax[tpu]). gcloud runs the same command on all
# workers; each finds its process id and the coordinator (worker 0, port 8482) itself, from
# the TPU VM metadata (t5lite/launch/cluster.py, kind tpu_vm).
#
# MODEL_DIR: best a gs:// URL (the `gcs` extra on every worker): checkpoints are committed as
# objects with a bucket's own guarantees (docs/storage.md). A folder every worker sees at the
# same path works too: an NFS or Filestore share, or the bucket mounted with GCS FUSE, which
# this script does when GCS_BUCKET is set (at /gcs/$GCS_BUCKET on every worker, unless it is
# mounted there already; then MODEL_DIR=/gcs/$GCS_BUCKET/<run>), e.g. for data read as files.
# gcsfuse must be installed on the workers (https://cloud.google.com/storage/docs/cloud-storage-fuse/install)
# and the TPU VM's service account able to write to the bucket. The run checks at start that
# all workers see MODEL_DIR, and stops (exit 2) if not.
#
# A maintenance event or preemption notice sends SIGTERM: the workers agree on one step, all
# save it and exit 42. Run this script again (after the slice is back) to resume from there.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME to the name of the TPU VM}"
: "${ZONE:?set ZONE, e.g. us-central2-b}"
WORKDIR=${WORKDIR:-t5lite}
PYTHON=${PYTHON:-python3}

on_all_workers() {
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" ${PROJECT:+"--project=$PROJECT"} \
    --worker=all --command="$1"
}

if [ -n "${GCS_BUCKET:-}" ]; then
  mount_point="/gcs/$GCS_BUCKET"
  on_all_workers "mountpoint -q $mount_point || { sudo mkdir -p $mount_point && \
sudo chown \$(id -u):\$(id -g) $mount_point && \
gcsfuse --implicit-dirs --rename-dir-limit=100000 $GCS_BUCKET $mount_point; }"
fi

printf -v flags ' %q' "$@"
on_all_workers "cd $WORKDIR && $PYTHON -m t5lite.cli train$flags"
