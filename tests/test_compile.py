"""`t5lite compile`: the run's train step compiled for a TPU topology on this CPU host.

These tests need libtpu (the `tpu` extra, which `make test` installs): without it they fail,
they do not skip. On a CPU host libtpu prints warnings about TPU_ACCELERATOR_TYPE /
TPU_WORKER_HOSTNAMES when it loads; they are noise.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys

import jax
import numpy as np
import pytest

from helpers import tiny
from t5lite import cli
from t5lite.errors import ConfigError
from t5lite.families import family_of
from t5lite.runtime import partitioning as part
from t5lite.runtime import topologies
from t5lite.train.aot import compiler as aot_compile
from t5lite.train import step_program
from t5lite.train.aot import cost as aot_cost
from t5lite.train.trainer import TrainConfig

# One layer a stack: compile time grows with the layers, and no test here needs two.
ONE_LAYER = ["--gin.ModelConfig.num_encoder_layers=1", "--gin.ModelConfig.num_decoder_layers=1"]
GIN = ["--gin_file=gin/runs/pretrain.gin", "--gin_file=gin/models/tiny.gin",
       "--gin.BATCH_SIZE=8", "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
       *ONE_LAYER]
# Big enough that matmuls dominate XLA's count (see test_flops_*), small enough to compile in
# seconds.
MODEL = tiny(d_model=256, d_ff=1024, num_heads=4, d_kv=64, vocab_size=1024,
             num_encoder_layers=1, num_decoder_layers=1)
SMALL = tiny(num_encoder_layers=1, num_decoder_layers=1)  # MODEL 8x narrower
LENGTHS = {"inputs": 128, "targets": 32}


def test_libtpu_is_installed():
  try:
    import libtpu  # noqa: F401
  except ImportError:
    pytest.fail("libtpu is missing: `make test` installs it (pip install -e '.[test,tpu]')")


def _config(**changes) -> TrainConfig:
  return TrainConfig(**{"model_dir": "unused", "train_steps": 1, "batch_size": 8,
                        "mixture_or_task_name": "unused", "task_feature_lengths": LENGTHS,
                        **changes})


# TPU compiles: the tests that take these are slow (helpers/durations.py).
SLOW_FIXTURES = ("v5e_report", "data_parallel_report")
DATA_PARALLEL = part.MeshConfig(data=4)  # what _config()'s default (data=-1) is on v5e:2x2


@pytest.fixture(scope="module")
def data_parallel_report(tmp_path_factory):
  """The tiny T5 on v5e:2x2 as data=4, its HLO written: one compile (each takes ~10 s) for the
  tests of the untimed ops and of microbatches."""
  return aot_compile.compile_for_tpu(MODEL, _config(mesh=DATA_PARALLEL), "v5e:2x2",
                                     emit_hlo=str(tmp_path_factory.mktemp("hlo")))


@pytest.fixture(scope="module")
def v5e_report():
  """The tiny T5 on v5e:2x2 (4 chips) as data=2 x tensor=2: params split over 'tensor'. A TPU
  compile is not served from JAX's cache (17-21 s on a warm 2-core Zen 3 EPYC): in
  SLOW_FIXTURES."""
  config = _config(mesh=part.MeshConfig(data=2, fsdp=1, tensor=2))
  return aot_compile.compile_for_tpu(MODEL, config, "v5e:2x2")


def _hand_param_bytes(model_config, tensor: int) -> int:
  """One device's params: every parameter's f32 bytes, its vocab / mlp / heads dimension cut
  over the tensor axis (logical_axis_rules without fsdp), everything else replicated."""
  family = family_of(model_config)
  split = {"vocab": tensor, "mlp": tensor, "heads": tensor}
  shapes = jax.tree.leaves(family.abstract_params())
  names = jax.tree.leaves(family.param_logical_axes(),
                          is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  total = 0
  for shape, axes in zip(shapes, names, strict=True):
    elements = math.prod(shape.shape)
    for axis in axes:
      elements //= split.get(axis, 1)
    total += elements * 4
  return total


def test_params_bytes_per_device_are_the_hand_computed_shards(v5e_report):
  r = v5e_report
  assert (r["topology"], r["devices"], r["chip"]) == ("v5e:2x2", 4, "v5e")
  assert r["mesh"] == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 2}
  hand = _hand_param_bytes(MODEL, tensor=2)
  assert r["params_bytes_per_device"] == hand
  # A quarter of the params is not a model split 2 ways: the check has teeth.
  whole = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(family_of(MODEL).abstract_params()))
  assert whole / 2 < hand < whole
  # XLA's arguments: the train state and the batch (TPU layouts may pad small arrays).
  batch = sum(8 // 2 * n * 4 for n in (128,) * 3 + (32,) * 5)  # 8 features, rows over data=2
  assert r["argument_bytes"] >= r["state_bytes_per_device"] + batch
  assert r["argument_bytes"] < 1.1 * (r["state_bytes_per_device"] + batch)
  assert r["alias_bytes"] > 0.9 * r["state_bytes_per_device"]  # the donated state
  assert r["bytes_per_device"] == (r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"]
                                   - r["alias_bytes"] + r["code_bytes"])
  assert r["hbm_bytes"] == 16 * 1024**3 and r["fits"] is True
  assert r["margin_bytes"] == r["hbm_bytes"] - r["bytes_per_device"]
  assert r["compile_s"] > 0


def test_flops_agree_with_the_cost_model(v5e_report):
  """XLA's flops per device against Family.flops_per_example x batch / devices: within 5%.
  The gap is what the matmul-only cost model leaves out (norms, softmax, activations, the
  loss, the optimizer update: linear in params and tokens, not their product), so it shrinks
  as the model grows (test_the_flops_gap_is_the_non_matmul_work)."""
  r = v5e_report
  analytic = (family_of(MODEL).flops_per_example(
      {"encoder_input_tokens": 128, "decoder_target_tokens": 32}) * 8 / 4)
  assert r["analytic_flops_per_device"] == pytest.approx(analytic)
  assert r["flops_per_device"] == pytest.approx(analytic, rel=0.05)
  assert r["flops_per_device"] > analytic  # XLA counts the extra work, never less


def test_the_flops_gap_is_the_non_matmul_work(v5e_report):
  """The model 8x narrower: the same extra work is a larger share."""
  small = aot_compile.compile_for_tpu(SMALL, _config(), "v5e:2x2")
  gap_small = small["xla_over_analytic_flops"] - 1
  gap_big = v5e_report["xla_over_analytic_flops"] - 1
  assert 0 < gap_big < gap_small < 0.3


def test_estimated_mfu_is_model_flops_over_xla_time(v5e_report):
  r = v5e_report
  expected = r["analytic_flops_per_device"] / (r["optimal_seconds"] * 197e12)
  assert r["estimated_mfu"] == pytest.approx(expected) and 0 < expected < 1
  # `t5lite compile`'s table (the CLI prints it: test_pod_presets, and the model too big
  # below) has the estimate's row.
  assert "(XLA's estimate)" in aot_compile.table(r) and "HBM per chip" in aot_compile.table(r)


def test_the_pallas_attention_kernel_compiles_for_tpu_per_shard(tmp_path):
  """attention_implementation='pallas' in bfloat16 lowered and compiled by libtpu for v5e:2x2
  as data 2 x tensor 2: Mosaic takes t5lite's shared-bias kernel (lengths padded to 128,
  T5's table, masks from segment ids), each shard of batch and heads runs it (shard_map),
  the program fits, and every kernel carries its cost for XLA's step-time estimate."""
  config = _config(mesh=part.MeshConfig(data=2, fsdp=1, tensor=2))
  model = MODEL.replace(attention_implementation="pallas", dtype="bfloat16")
  report = aot_compile.compile_for_tpu(model, config, "v5e:2x2", emit_hlo=str(tmp_path),
                                       fit_only=True)
  assert report["fits"] is True
  hlo = (tmp_path / "train_step.v5e_2x2.hlo.txt").read_text()
  # A forward and a backward kernel for each of the 3 attentions (the encoder's, the
  # decoder's self- and cross-attention).
  assert hlo.count('custom_call_target="tpu_custom_call"') == 3 * 2
  # The encoder's forward kernel on one shard: 4 rows x 2 heads x 128 x 128 scores, two
  # matmuls with the head dim 64 counted as the matrix unit's 128.
  assert f'"flops":"{2 * 2 * 4 * 2 * 128 * 128 * 128}"' in hlo
  assert hlo.count('"cost_estimate"') == 3 * 2


def _run(capsys, *args) -> tuple[int, str, str]:
  code = cli.main(["compile", *args])
  out = capsys.readouterr()
  return code, out.out, out.err


def test_a_model_too_big_for_the_chip_reports_does_not_fit(capsys):
  code, out, err = _run(capsys, "--topology", "v5e:2x2", *GIN, "--gin.ModelConfig.d_model=8192",
                        "--gin.ModelConfig.d_ff=147456", "--gin.ModelConfig.num_heads=8",
                        "--gin.ModelConfig.d_kv=128")
  assert code == 0, err
  report = json.loads(out.strip().splitlines()[-1])
  assert report["fits"] is False
  assert report["bytes_per_device"] > report["hbm_bytes"] == 16 * 1024**3
  assert report["margin_bytes"] < 0
  assert report["params_bytes_per_device"] > 26 * 1024**3  # 7.9B f32 params, replicated
  assert "does not fit" in out


@pytest.mark.parametrize("name", ["v7:2x2", "v5e:2x2x2", "tpu-v5e-8", "v5e:3x3"])
def test_an_unknown_topology_lists_the_generations_and_the_format(capsys, name):
  code, out, err = _run(capsys, "--topology", name, *GIN)
  assert code == 2 and "Traceback" not in err
  line = err.strip().splitlines()[-1]
  assert line.startswith("t5lite compile: error:") and repr(name) in line
  assert "v4, v5e, v5p, v6e" in line and "v5e:16x16" in line and "v4:4x4x8" in line


def test_no_topology_and_no_pod_topology_macro_says_how_to_name_one(capsys):
  code, out, err = _run(capsys, *GIN)
  assert code == 2 and "Traceback" not in err
  line = err.strip().splitlines()[-1]
  assert "needs --topology NAME" in line and "POD_TOPOLOGY" in line


def test_a_mesh_that_does_not_match_the_topology_says_both_numbers(capsys):
  code, out, err = _run(capsys, "--topology", "v5e:2x2", *GIN, "--gin.MeshConfig.data=8")
  assert code == 2
  line = err.strip().splitlines()[-1]
  assert "v5e:2x2 has 4 devices" in line and "needs 8 devices" in line


def test_without_libtpu_it_says_how_to_install_it(capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "libtpu", None)  # `import libtpu` raises ImportError
  code, out, err = _run(capsys, "--topology", "v5e:2x2", *GIN)
  assert code == 2 and "Traceback" not in err
  line = err.strip().splitlines()[-1]
  assert "needs libtpu" in line and 'pip install -e ".[tpu]"' in line


def test_cuda_lowers_the_train_step_without_libtpu(capsys, monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "libtpu", None)
  code, out, err = _run(capsys, "--platform", "cuda", "--devices", "4", *GIN,
                        "--gin.MeshConfig.tensor=2", "--emit-hlo", str(tmp_path))
  assert code == 0, err
  report = json.loads(out.strip().splitlines()[-1])
  assert report["lowered"] is True and report["compiled"] is False
  assert report["mesh"] == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 2}
  assert "lowered for CUDA only" in out
  text = (tmp_path / "train_step.cuda.stablehlo.txt").read_text()
  assert "mhlo.num_partitions = 4" in text


def test_decode_program_compiles_for_the_run_decode_settings():
  config = _config(decode=dataclasses.replace(_config().decode, batch_size=8,
                                              max_decode_length=16))
  r = aot_compile.compile_for_tpu(MODEL, config, "v5e:2x2", program="decode")
  assert r["program"] == "decode" and r["fits"] is True
  assert (r["decode_batch_size"], r["max_decode_length"]) == (8, 16)
  assert r["flops_per_device"] > 0 and r["estimated_mfu"] is None
  assert r["argument_bytes"] >= r["params_bytes_per_device"]
  assert np.isfinite(r["bytes_per_device"])


def test_loops_are_costed_from_loop_free_compiles():
  """XLA's cost analysis counts a while loop's body once: the compiled program of a scanned
  model counts one layer per stack (far below the cost model); the whole step's flops come
  from loop-free compiles extrapolated in depth, equal to the unscanned program's own."""
  # Half MODEL's width: the comparison is of XLA's counts with each other. One decoder layer:
  # two loop-free compiles, (1, 1) and (2, 1); the extrapolation over two stacks of different
  # depths is test_the_whole_step_is_the_loop_free_costs_extrapolated_in_depth's.
  model = MODEL.replace(d_model=128, d_ff=512, num_heads=2, num_encoder_layers=4,
                        num_decoder_layers=1)
  unscanned = aot_compile.compile_for_tpu(model, _config(), "v5e:2x2")
  scanned = aot_compile.compile_for_tpu(model.replace(scan_layers=True), _config(), "v5e:2x2")
  assert unscanned["cost_from"] == "the compiled program"
  assert "xla_flops_compiled_program" not in unscanned
  assert scanned["cost_from"].startswith("2 loop-free compiles extrapolated over scanned")
  assert scanned["xla_flops_compiled_program"] < 0.6 * scanned["analytic_flops_per_device"]
  assert scanned["flops_per_device"] == pytest.approx(unscanned["flops_per_device"], rel=1e-4)
  assert scanned["xla_over_analytic_flops"] == pytest.approx(
      unscanned["xla_over_analytic_flops"], rel=1e-4)
  assert scanned["optimal_seconds"] > 0 and 0 < scanned["estimated_mfu"] < 1


def test_microbatches_are_costed_per_microbatch_times_their_number(data_parallel_report):
  config = _config(mesh=DATA_PARALLEL, step=dataclasses.replace(_config().step, microbatches=2))
  whole = data_parallel_report
  micro = aot_compile.compile_for_tpu(MODEL, config, "v5e:2x2")
  assert "2 microbatches" in micro["cost_from"]
  # The same model work; the optimizer update is counted once per microbatch (a few % here).
  assert micro["flops_per_device"] == pytest.approx(whole["flops_per_device"], rel=0.05)
  assert micro["flops_per_device"] >= whole["flops_per_device"]


@pytest.mark.parametrize("depths,points", [
    ((4, 3), [(1, 1), (2, 1), (1, 2)]), ((4, 4), [(1, 1), (2, 2)]), ((1, 1), [(1, 1)])])
def test_the_loop_free_programs_of_an_encoder_decoder(depths, points):
  model = MODEL.replace(scan_layers=True, num_encoder_layers=depths[0],
                        num_decoder_layers=depths[1])
  runs = aot_cost.unrolled_programs(model, _config(batch_size=8))
  assert [(m.num_encoder_layers, m.num_decoder_layers) for m, _, _ in runs] == points
  assert all(not m.scan_layers and t.step.microbatches == 1 for m, t, _ in runs)


def test_the_whole_step_is_the_loop_free_costs_extrapolated_in_depth_times_the_microbatches():
  """whole_step_cost with a stand-in compile cost, affine in each stack's layers: a 4-layer
  encoder and a 3-layer decoder from the costs at (1, 1), (2, 1) and (1, 2), times 2
  microbatches, each program costed at its microbatch's 4 of the batch's 8 rows."""
  seen = []

  def compile_cost(model, train):
    seen.append((model.num_encoder_layers, model.num_decoder_layers, train.batch_size,
                 train.step.microbatches, model.scan_layers))
    return (100.0 + 10 * model.num_encoder_layers + 7 * model.num_decoder_layers,
            1.0 + 0.5 * model.num_encoder_layers + 0.25 * model.num_decoder_layers)
  model = MODEL.replace(scan_layers=True, num_encoder_layers=4, num_decoder_layers=3)
  config = _config(step=dataclasses.replace(_config().step, microbatches=2))
  flops, seconds = aot_cost.whole_step_cost(model, config, compile_cost)
  assert seen == [(1, 1, 4, 1, False), (2, 1, 4, 1, False), (1, 2, 4, 1, False)]
  assert flops == 2 * (100 + 10 * 4 + 7 * 3)
  assert seconds == pytest.approx(2 * (1.0 + 0.5 * 4 + 0.25 * 3))


def test_ops_xla_cannot_time_are_added_back(data_parallel_report):
  """A data-parallel step: XLA:TPU's raw optimal_seconds is near minus the number of
  ConcatBitcast custom calls; each counts -1 s, and they are added back."""
  r = data_parallel_report
  untimed = open(r["hlo_path"]).read().count('custom_call_target="ConcatBitcast"')
  assert untimed > 0 and r["xla_optimal_seconds_raw"] < -1
  assert r["optimal_seconds"] == pytest.approx(r["xla_optimal_seconds_raw"] + untimed)
  assert 0 < r["optimal_seconds"] < 0.01 and 0 < r["estimated_mfu"] < 1


def test_compiler_options_reach_xla(tmp_path):
  """TrainConfig.compiler_options go to the train step's compile: XLA:TPU's async collective
  fusion turned off, the FSDP step's all-gathers are no longer async collectives."""
  fsdp = {"mesh": part.MeshConfig(data=1, fsdp=4), "fsdp": True}
  off = {"xla_tpu_enable_async_collective_fusion": False}
  hlo = {}
  for name, options in (("default", None), ("off", off)):
    r = aot_compile.compile_for_tpu(SMALL, _config(**fsdp, compiler_options=options), "v5e:2x2",
                                    emit_hlo=str(tmp_path / name))
    hlo[name] = open(r["hlo_path"]).read()
  assert hlo["default"].count('"AsyncCollectiveStart"') > 0
  assert hlo["off"].count('"AsyncCollectiveStart"') == 0
  assert r["compiler_options"] == off and "compiler options" in aot_compile.table(r)


def test_an_option_xla_does_not_know_is_refused_in_one_line(capsys):
  code, out, err = _run(capsys, "--topology", "v5e:2x2", *GIN,
                        "--gin.TrainConfig.compiler_options={'xla_tpu_no_such_option': True}")
  line = err.strip()
  assert code == 2 and "\n" not in line, err
  assert "'xla_tpu_no_such_option'" in line and "compiler_options" in line and "tpu" in line
  # The train loop compiles through the same function: on this CPU, another backend's name.
  cpu = jax.jit(lambda x: x + 1, compiler_options=aot_compile.NO_WINDOWED_EINSUMS)
  with pytest.raises(ConfigError, match="XLA for cpu has no option 'xla_tpu_enable_windowed"):
    step_program.compile_lowered(cpu.lower(1.0))
  with pytest.raises(ConfigError, match="compiler_options"):
    _config(compiler_options=["xla_tpu_enable_windowed_einsum_for_all_gather"])
  with pytest.raises(ConfigError, match="compiler_options"):
    _config(compiler_options={"xla_option": [1, 2]})


def test_windowed_einsum_loops_are_counted_and_void_the_estimate(v5e_report):
  """XLA:TPU's windowed einsums (a matmul split into a loop that overlaps its all-gather or
  reduce-scatter; chosen for big operands, e.g. T5 1.1 xl at 64 rows a chip) are loops whose
  bodies its cost analysis counts once: a report whose costed program has one gives no MFU
  and says what to set. The loop lines as libtpu 0.0.42.1 writes them."""
  hlo = """ENTRY %main {
  %while.78 = (bf16[64,114,2048]{1,2,0:T(8,128)(2,1)S(1)}, u32[]{:T(128)}) while(%tuple.5), condition=%wide.windowed_dot_general_cond_ag.clone, body=%wide.windowed_dot_general_body_ag.clone.sunk
  %while.90 = (bf16[64,512,2048]{1,2,0:T(8,128)(2,1)}, u32[]{:T(128)}) while(%tuple.9), condition=%wide.windowed_dot_general_cond_rs.3.clone, body=%wide.windowed_dot_general_body_rs.3.clone.sunk
  %while.91 = (s32[]) while(%tuple.10), condition=%cond.1, body=%scan_body.1
}"""
  assert aot_cost.windowed_einsum_loops(hlo) == 2
  assert v5e_report["windowed_einsum_loops"] == 0 and v5e_report["estimated_mfu"] > 0
  voided = {**v5e_report, **aot_compile._windowed_einsums(2)}
  assert voided["estimated_mfu"] is None
  assert "2 matmuls into windowed einsum loops" in aot_compile.table(voided)
  assert "xla_tpu_enable_windowed_einsum_for_all_gather" in voided["cost_note"]
  assert aot_compile._windowed_einsums(0) == {}


@pytest.mark.parametrize("pack", [True, False])
def test_the_abstract_batch_is_what_the_run_converter_makes(pack):
  """Keys, dtypes and lengths of the compiled step's batch = a real converted row's."""
  import grain

  config = _config(pack=pack, task_feature_lengths={"inputs": 8, "targets": 6})
  mesh = part.make_mesh(part.MeshConfig(data=-1), jax.devices()[:2])
  program = step_program.build(family_of(tiny()), config, mesh, part.logical_axis_rules())
  examples = [{"inputs": np.array([5, 6, 7, 1]), "targets": np.array([8, 9, 1])}] * 4
  row = next(iter(program.converter(grain.MapDataset.source(examples),
                                    config.task_feature_lengths)))
  batch = program.abstract_batch()
  assert sorted(batch) == sorted(row)
  for key, value in row.items():
    assert batch[key].dtype == value.dtype and batch[key].shape == (8, value.shape[-1]), key


def test_untimed_ops_counts_what_xla_cost_analysis_counts():
  """The entry's ConcatBitcasts, a loop body's once, and the fewest of a conditional's
  branches (XLA costs a conditional as its costliest branch)."""
  cc = 'custom_call_target="ConcatBitcast"'
  hlo = f"""HloModule m
%body (p: f32[]) -> f32[] {{
  %a = f32[] custom-call(), {cc}
}}
%cond (p: f32[]) -> pred[] {{
  %c = pred[] constant(true)
}}
%branch_a (p: f32[]) -> f32[] {{
  %x = f32[] custom-call(), {cc}
}}
%branch_b (p: f32[]) -> f32[] {{
  %x = f32[] custom-call(), {cc}
  %y = f32[] custom-call(), {cc}
  %z = f32[] custom-call(), {cc}
}}
%never_called (p: f32[]) -> f32[] {{
  %x = f32[] custom-call(), {cc}
}}
ENTRY %main (p: f32[]) -> f32[] {{
  %s = f32[] custom-call(), {cc}
  %t = f32[] custom-call(), {cc}
  %w = f32[] while(%p), condition=%cond, body=%body
  %k = f32[] conditional(%i, %p, %p), branch_computations={{%branch_a, %branch_b}}
  %o = f32[] custom-call(), custom_call_target="AssumeGatherIndicesInBound"
}}
"""
  assert aot_cost.untimed_ops(hlo) == 2 + 1 + 1


def test_v4_compiles_with_its_chip_figures():
  """v5e is compiled above; v4's smallest slice (megacore: one device per chip, three axes)
  with its HBM and peak in the estimate. v5p takes v4's path and v6e v5e's in t5lite
  (t5lite.runtime.topologies): test_each_generation_has_its_chip_figures_and_a_mesh checks
  their figures and meshes without a compile of its own."""
  r = aot_compile.compile_for_tpu(SMALL, _config(mesh=part.MeshConfig(data=4)), "v4:2x2x1")
  assert r["devices"] == 4 and r["mesh"] == {"data": 4, "fsdp": 1, "expert": 1, "tensor": 1}
  assert r["hbm_bytes"] == 32 * 1024**3 and r["peak_flops_per_chip"] == 275e12
  assert r["fits"] is True and r["optimal_seconds"] > 0
  assert r["estimated_mfu"] == pytest.approx(
      r["analytic_flops_per_device"] / (r["optimal_seconds"] * 275e12))


@pytest.mark.parametrize("topology,hbm_gib,peak", [
    ("v4:2x2x1", 32, 275e12), ("v5p:2x2x1", 95, 459e12), ("v6e:2x2", 32, 918e12),
    ("v5e:2x2", 16, 197e12)])
def test_each_generation_has_its_chip_figures_and_a_mesh(topology, hbm_gib, peak):
  """Each generation's smallest slice as libtpu describes it (4 devices: one a chip, v4 and
  v5p's megacore included), its HBM and peak, and the mesh a data=4 run makes on it."""
  chip = topologies.chip_of(topology)
  assert chip.hbm_bytes == hbm_gib * 1024**3 and chip.peak_flops == peak
  devices = topologies.topology_devices(topology)
  assert len(devices) == 4 == topologies.chips_in(topology)
  mesh = part.make_mesh(part.MeshConfig(data=4), devices)
  assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "expert": 1, "tensor": 1}
