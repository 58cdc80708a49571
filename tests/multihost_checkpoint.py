"""A checkpoint round trip through a multi-process job, run by test_multihost.py.

Every process of the job restores SOURCE's newest checkpoint onto the job's mesh (its own
shards only) and saves it, untouched, as the same step in TARGET; the test then reads both in
one process, where they must be identical:

  python tests/multihost_checkpoint.py RUN.gin SOURCE TARGET --coordinator_address=HOST:PORT \
      --num_processes=N --process_id=I
"""
import argparse
import os
import sys


def main(argv: list[str]) -> int:
  from t5lite.cli import gin_config
  from t5lite.launch import distributed
  parser = argparse.ArgumentParser()
  for name in ("gin_file", "source", "target"):
    parser.add_argument(name)
  distributed.add_flags(parser)
  args = parser.parse_args(argv)
  gin_config.parse([args.gin_file], [f"MODEL_DIR='{args.target}'"])
  distributed.initialize(distributed.resolve(args.coordinator_address, args.num_processes,
                                             args.process_id, os.environ),
                         args.initialization_timeout)
  from t5lite.runtime import checkpoints
  from t5lite.train.trainer import Trainer
  trainer = Trainer(gin_config.model_config(), gin_config.train_config())
  source = checkpoints.Checkpointer(args.source, read_only=True)
  state, data_state, step = source.restore_latest(trainer.abstract_state)
  source.close()
  target = checkpoints.Checkpointer(args.target)
  target.save(step, state, data_state)
  target.close()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
