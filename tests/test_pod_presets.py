"""The pod presets gin/runs/pods/*.gin: each names its TPU topology (POD_TOPOLOGY), builds its
run for that pod's chips, and — compiled by `t5lite compile` alone — fits.

Compiling every preset takes about an hour on a 2-core CPU (`make pod-presets` does it and
prints each report's JSON line); CI compiles the smallest one.
"""
from __future__ import annotations

import glob
import json
import os
import re

import pytest

from t5lite import cli
from t5lite.cli import gin_config
from t5lite.runtime import topologies

PRESETS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "gin", "runs",
                                        "pods", "*.gin")))
REQUIRED = ["--gin.MODEL_DIR='unused'", "--gin.MIXTURE_OR_TASK_NAME='unused'"]


def test_there_are_presets_for_every_t5_1_1_size_and_v4_v5e_v5p():
  names = {os.path.basename(p)[:-4] for p in PRESETS}
  for size in ("small", "base", "large", "xl", "xxl"):
    for chip in ("v4", "v5e", "v5p"):
      assert f"t5_1_1_{size}_{chip}" in names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: os.path.basename(p)[:-4])
def test_a_preset_names_its_topology_and_its_mesh_fills_it(path):
  gin_config.parse([path], ["MODEL_DIR='unused'", "MIXTURE_OR_TASK_NAME='unused'"])
  topology = gin_config.macro("POD_TOPOLOGY")
  chip, _ = topologies.parse(topology)
  assert os.path.basename(path).endswith(f"_{chip.name}.gin")
  config = gin_config.train_config()
  data, fsdp, expert, tensor = config.mesh.resolve(topologies.chips_in(topology))
  assert data * fsdp * expert * tensor == topologies.chips_in(topology)
  assert config.batch_size % (data * fsdp * expert) == 0
  model = gin_config.model_config()
  if expert > 1:  # an expert axis splits a Mixture-of-Experts model's experts
    assert model.moe is not None and model.moe.num_experts % expert == 0
  text = open(path).read()
  # The header quotes the command and the estimate it printed.
  assert f"t5lite compile --gin_file=gin/runs/pods/{os.path.basename(path)}" in text
  assert re.search(r"estimated MFU [\d.]+%", text) and "per chip" in text


def test_the_smallest_preset_compiles_alone_and_fits(capsys, tmp_path):
  """`t5lite compile --gin_file=PRESET` with no --topology: the preset's POD_TOPOLOGY, its
  table, its JSON line and its HLO. With --fit_only (the loop-free costing compiles, a minute
  each here, are tested on tiny models in test_compile.py; `make pod-presets` reports every
  preset's estimate)."""
  path = [p for p in PRESETS if p.endswith("t5_1_1_small_v5e.gin")][0]
  assert cli.main(["compile", f"--gin_file={path}", "--fit_only", *REQUIRED,
                   "--emit-hlo", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  report = json.loads(out.strip().splitlines()[-1])
  for key in ("fits", "bytes_per_device", "hbm_bytes", "flops_per_device", "optimal_seconds",
              "estimated_mfu", "compile_s", "topology", "devices", "mesh", "argument_bytes",
              "output_bytes", "temp_bytes", "analytic_flops_per_device"):
    assert key in report, key
  assert "HBM per chip" in out and "fits" in out
  assert (tmp_path / "train_step.v5e_2x2.hlo.txt").read_text().startswith("HloModule")
  assert report["topology"] == "v5e:2x2" and report["devices"] == 4
  assert report["fits"] is True and report["bytes_per_device"] < report["hbm_bytes"]
  # The preset's header quotes what the full compile printed: the same memory figure.
  header = re.search(r"fits: ([\d.]+) GiB per chip", open(path).read())
  assert report["bytes_per_device"] / 1024**3 == pytest.approx(float(header.group(1)), rel=0.02)
  assert report["cost_skipped"] == "--fit_only" and report["estimated_mfu"] is None
  assert "scanned layers" in report["xla_cost_counts_loop_bodies_once"]
  assert "no MFU estimate" in out
