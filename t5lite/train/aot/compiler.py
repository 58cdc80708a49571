"""`t5lite compile --topology NAME`: compile a run's train step for a TPU pod from a CPU host.

    t5lite compile --topology v5e:16x16 --gin_file=gin/runs/pretrain.gin \\
        --gin_file=gin/models/t5_1_1/xl.gin --gin.BATCH_SIZE=2048 --gin.MeshConfig.fsdp=16

It takes a run's gin flags, as `t5lite train` does, and compiles the exact program that
`t5lite train` would run on that pod: the mesh (TrainConfig.mesh) over the topology's devices,
the run's logical axis rules, the train state born sharded (abstract: ShapeDtypeStructs with
their shardings, never materialized), a global batch of the run's feature converter's
features, and the same jitted `windowed_train_step` with the same shardings and donation
(t5lite.train.step_program builds it for both). Then it reports, per device:

  * XLA's memory analysis: arguments (train state + batch), outputs, temporaries, the bytes
    donated arguments give back (alias), the generated code, their total, against the chip's
    HBM: fits yes/no with the margin. A program XLA itself refuses for lack of HBM is
    reported as not fitting, with XLA's numbers, rather than as a crash.
  * XLA's cost analysis: flops per device beside t5lite's analytic cost model
    (Family.flops_per_example x global batch / devices), and `optimal_seconds`, XLA's own
    estimate of the step time; the estimated MFU it implies is analytic model FLOPs /
    (optimal_seconds x chips x peak bf16). An estimate from the compiler, not a measurement.
    XLA counts a loop's body once: for scanned layers or microbatches the whole step's
    figures come from loop-free compiles of 1 and 2 layers, extrapolated (t5lite.train.aot.cost).

The table ends with one JSON line (keys: fits, bytes_per_device, hbm_bytes, flops_per_device,
analytic_flops_per_device, optimal_seconds, estimated_mfu, compile_s, ...). `--emit-hlo DIR`
writes the optimized HLO; `--program decode` compiles the decoding program (encoder, prefill
and the decode loop) for the run's TrainConfig.decode settings instead. `--platform cuda`
needs no libtpu: it lowers (does not compile) the train step for CUDA GPUs over an abstract
mesh of --devices GPUs, to check that it traces; there is no memory or cost analysis then.
Distillation and PEFT runs (whose steps read a teacher or base from disk) are not compiled yet.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from t5lite.errors import ConfigError
from t5lite.families import family_of
from t5lite.models.config import ModelConfig
from t5lite.runtime import partitioning as part
from t5lite.runtime import topologies
from t5lite.runtime.model_dir import check_location
from t5lite.train import recipes, step_program
from t5lite.train.aot import cost as aot_cost
from t5lite.train.loop import step_memory
from t5lite.util import atomic, paths


def main(args, model_config: ModelConfig, config, log: Callable[[str], None] = print) -> int:
  """The CLI verb: compile, print the table and the JSON line."""
  check_location(args.emit_hlo, "--emit_hlo")
  if args.platform == "cuda":
    report = lower_for_cuda(model_config, config, args.devices, program=args.program,
                            emit_hlo=args.emit_hlo)
  else:
    if not args.topology:
      raise ConfigError("t5lite compile needs --topology NAME, e.g. --topology v5e:16x16 "
                        f"({', '.join(topologies.EXAMPLES.values())}), or a gin file that sets "
                        "POD_TOPOLOGY (the presets in gin/runs/pods/ do)")
    report = compile_for_tpu(model_config, config, args.topology, num_slices=args.num_slices,
                             program=args.program, emit_hlo=args.emit_hlo,
                             fit_only=getattr(args, "fit_only", False))
  log(table(report))
  log(json.dumps(report, sort_keys=True))
  return 0


# --- building the program ------------------------------------------------------------------

def _check_supported(config) -> recipes.Recipe:
  """The run's recipe, if its step compiles without reading anything (the plain run's)."""
  recipe = recipes.recipe_of(config)
  if not recipe.compiles_ahead:
    if config.recipe is not None:
      raise ConfigError(f"t5lite compile does not compile the {recipe.name!r} recipe's runs "
                        "(its step may read from disk: Recipe.compiles_ahead): compile the "
                        "plain run")
    raise ConfigError("t5lite compile does not compile distillation or PEFT runs yet (their "
                      "steps read a teacher or a base from disk): compile the plain run")
  return recipe


def _program(model_config: ModelConfig, config, mesh) -> step_program.StepProgram:
  recipe = _check_supported(config)
  part.check_batch_size(config.batch_size, mesh)
  rules = part.logical_axis_rules(fsdp=config.fsdp)
  family = family_of(model_config, config.step.loss_options())
  return step_program.build(family, config, mesh, rules,
                            trainable_mask=functools.partial(recipe.trainable_mask, family))


def _decode_call(model_config: ModelConfig, config, program: step_program.StepProgram):
  """(jitted generate program, its abstract args) for TrainConfig.decode's settings."""
  from t5lite.models.decoding import search as decoding
  d = config.decode
  lengths = config.task_feature_lengths
  method = d.method
  if (method == "sample" and d.temperature == 0.0) or (method == "beam" and d.num_beams == 1):
    method = "greedy"  # as t5lite.generate canonicalizes
  settings = {"greedy": dict(temperature=0.0),
              "sample": dict(temperature=float(d.temperature), top_k=int(d.top_k),
                             top_p=float(d.top_p)),
              "beam": dict(num_beams=int(d.num_beams), alpha=float(d.alpha))}[method]
  max_length = d.max_decode_length or lengths["targets"]
  fn = decoding.generate_program(model_config, method, int(max_length),
                                 tuple(sorted(settings.items())))
  shards = math.prod(program.mesh.shape[a] for a in part.BATCH_AXES)
  tokens_sharding = program.batch_sharding if d.batch_size % shards == 0 else program.replicated
  tokens = jax.ShapeDtypeStruct((d.batch_size, lengths.get("inputs", lengths["targets"])),
                                np.int32, sharding=tokens_sharding)
  key = jax.eval_shape(jax.random.key, 0)
  key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=program.replicated)
  jitted = jax.jit(fn, in_shardings=(program.param_shardings, tokens_sharding,
                                     program.replicated))
  return jitted, (program.abstract_params, tokens, key), {
      "decode_method": method, "decode_batch_size": d.batch_size,
      "max_decode_length": int(max_length)}


def _mesh_over(config, devices, num_slices: int, where: str):
  try:
    return part.make_mesh(config.mesh, devices, num_slices=num_slices)
  except ConfigError as e:
    raise ConfigError(f"{where} has {len(devices)} devices; {e}") from e


# --- TPU: compile and analyse --------------------------------------------------------------

def compile_for_tpu(model_config: ModelConfig, config, topology: str, *, num_slices: int = 1,
                    program: str = "train", emit_hlo: str | None = None,
                    fit_only: bool = False) -> dict[str, Any]:
  """Compiles the run's train (or decode) program for `num_slices` x `topology`; the report.
  fit_only: no loop-free compiles to cost a looping train program (its estimated MFU is then
  none, as XLA's figures of the compiled program count each loop body once)."""
  chip = topologies.chip_of(topology)
  _check_supported(config)
  devices = topologies.topology_devices(topology, num_slices)
  where = f"topology {topology}" + (f" x {num_slices} slices" if num_slices > 1 else "")
  mesh = _mesh_over(config, devices, num_slices, where)
  built = _program(model_config, config, mesh)
  report: dict[str, Any] = {
      "program": program, "platform": "tpu", "topology": topology, "num_slices": num_slices,
      "chip": chip.name, "devices": len(devices), "mesh": dict(mesh.shape),
      "batch_size": config.batch_size, "task_feature_lengths": dict(config.task_feature_lengths),
      "hbm_bytes": chip.hbm_bytes, "peak_flops_per_chip": chip.peak_flops,
      **_state_bytes(built)}
  if config.compiler_options:
    report["compiler_options"] = dict(config.compiler_options)
  if program == "train":
    fn, args, extra = built.step_fn, built.abstract_args(), {}
  else:
    fn, args, extra = _decode_call(model_config, config, built)
  report.update(extra)
  start = time.perf_counter()
  with part.activate(mesh, built.rules), _no_persistent_cache():
    lowered = fn.lower(*args)
    try:
      compiled = step_program.compile_lowered(lowered, "tpu")
    except jax.errors.JaxRuntimeError as e:
      refused = _out_of_memory(str(e), report["state_bytes_per_device"], chip.hbm_bytes)
      if refused is None:
        raise
      report["compile_s"] = round(time.perf_counter() - start, 3)
      report.update(refused)
      if program == "train":
        report["analytic_flops_per_device"] = built.flops_per_step() / len(devices)
      return report
  report["compile_s"] = round(time.perf_counter() - start, 3)
  if emit_hlo:
    report["hlo_path"] = _write(emit_hlo, f"{program}_step.{topology.replace(':', '_')}.hlo.txt",
                                compiled.as_text())
  report.update(_memory(compiled, chip.hbm_bytes))
  report.update(_cost(compiled, built, chip, len(devices), program))
  loops = aot_cost.loops(model_config, config, program)
  if loops and program == "train" and not fit_only:
    report.update(_unrolled_cost(model_config, config, mesh, loops, report))
  elif loops:
    report["xla_cost_counts_loop_bodies_once"] = loops
    if program == "train":  # undercounts: not an estimate of the step
      report.update(estimated_mfu=None, xla_over_analytic_flops=None, cost_skipped="--fit_only")
  if program == "train":  # the costed program's loops: the loop-free ones' when extrapolated
    report.update(_windowed_einsums(report["windowed_einsum_loops"]))
  return report


def _unrolled_cost(model_config: ModelConfig, config, mesh, loops: str,
                   report: dict[str, Any]) -> dict[str, Any]:
  """The whole step's flops and optimal_seconds when the train program loops (XLA counts a
  loop body once): extrapolated from loop-free compiles (t5lite.train.aot.cost)."""
  windowed = []

  def compile_cost(model, train):
    built = _program(model, train, mesh)
    with part.activate(mesh, built.rules), _no_persistent_cache():
      cost = aot_cost.xla_cost(step_program.compile_lowered(
          built.step_fn.lower(*built.abstract_args()), "tpu"))
    windowed.append(cost["windowed_einsum_loops"])
    return cost["flops"], cost["optimal_seconds"]

  start = time.perf_counter()
  try:
    flops, seconds = aot_cost.whole_step_cost(model_config, config, compile_cost)
  except jax.errors.JaxRuntimeError as e:  # a loop-free program XLA refuses: say so, go on
    return {"xla_cost_counts_loop_bodies_once": loops,
            "unrolled_cost_failed": " ".join(str(e).split())[:300]}
  runs = len(aot_cost.unrolled_programs(model_config, config))
  analytic = report["analytic_flops_per_device"]
  out = {"xla_flops_compiled_program": report["flops_per_device"],
         "xla_optimal_seconds_compiled_program": report["optimal_seconds"],
         "flops_per_device": flops, "optimal_seconds": seconds,
         "xla_over_analytic_flops": flops / analytic if analytic else None,
         "estimated_mfu": (analytic / (seconds * report["peak_flops_per_chip"])
                           if seconds else None),
         "cost_from": f"{runs} loop-free compiles extrapolated over {loops}",
         "cost_compile_s": round(time.perf_counter() - start, 3)}
  return {**out, "windowed_einsum_loops": max(windowed)}


def _windowed_einsums(count: int) -> dict[str, Any]:
  """The report's estimate voided when the costed program has windowed einsum loops, whose
  bodies XLA counts once (t5lite.train.aot.cost)."""
  if not count:
    return {}
  return {"estimated_mfu": None,
          "cost_note": f"XLA split {count} matmuls into windowed einsum loops, whose bodies its "
                       "cost analysis counts once: no MFU estimate; TrainConfig."
                       f"compiler_options = {NO_WINDOWED_EINSUMS} compiles without them"}


# XLA:TPU options that keep it from writing windowed einsums (the TPU presets that give each
# chip many rows set them: docs/compile.md).
NO_WINDOWED_EINSUMS = {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
                       "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}


@contextlib.contextmanager
def _no_persistent_cache():
  """JAX's persistent compilation cache off: it would store the compile-only TPU executable
  (large: 0.5 GiB of code for T5 base) and cannot load it back without a TPU client."""
  from jax.experimental.compilation_cache import compilation_cache
  enabled = jax.config.jax_enable_compilation_cache
  # JAX decides once per process whether it uses the cache: reset_cache makes it look again.
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


def _state_bytes(program: step_program.StepProgram) -> dict[str, int]:
  """Bytes of one device's shards of the params and of the whole train state (logical: XLA's
  TPU layouts may pad small arrays to their tiles, which the argument bytes include)."""
  def per_device(tree) -> int:
    return int(sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))
  return {"params_bytes_per_device": per_device(program.abstract_params),
          "state_bytes_per_device": per_device(program.abstract_state)}


def _memory(compiled, hbm_bytes: int) -> dict[str, Any]:
  step = step_memory(compiled)
  code = int(getattr(compiled.memory_analysis(), "generated_code_size_in_bytes", 0) or 0)
  total = step["step_memory_bytes"] + code
  return {"argument_bytes": step["step_argument_bytes"],
          "output_bytes": step["step_output_bytes"], "temp_bytes": step["step_temp_bytes"],
          "alias_bytes": step["step_alias_bytes"], "code_bytes": code,
          "bytes_per_device": total, "fits": total <= hbm_bytes,
          "margin_bytes": hbm_bytes - total}


def _out_of_memory(message: str, state_bytes: int, hbm_bytes: int) -> dict[str, Any] | None:
  """XLA:TPU's refusal of a program larger than HBM, as a report. Its messages: 'Ran out of
  memory in memory space hbm. Used 40.21G of 15.75G hbm. ...' (the total), or '... the total
  memory required for HLO temporaries (54.44G) exceeds available HBM (15.75G)' (temporaries
  alone: the total is then at least the train state plus those, a lower bound)."""
  if "RESOURCE_EXHAUSTED" not in message and "out of memory" not in message.lower():
    return None
  import re
  units = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
  size = r"([\d.]+)([KMGT]?)"
  to_bytes = lambda m, i: int(float(m[i]) * units[m[i + 1]])  # noqa: E731
  out: dict[str, Any] = {"fits": False, "xla_refused": " ".join(message.split())[:400],
                         "bytes_per_device": None, "margin_bytes": None,
                         "flops_per_device": None, "analytic_flops_per_device": None,
                         "optimal_seconds": None, "estimated_mfu": None}
  used = re.search(rf"Used {size} of {size} hbm", message)
  temps = re.search(rf"HLO temporaries \({size}\) exceeds available HBM \({size}\)", message)
  if used:
    out["bytes_per_device"], out["xla_usable_hbm_bytes"] = to_bytes(used, 1), to_bytes(used, 3)
  elif temps:
    out["temp_bytes"], out["xla_usable_hbm_bytes"] = to_bytes(temps, 1), to_bytes(temps, 3)
    out["bytes_per_device"] = state_bytes + out["temp_bytes"]
    out["bytes_per_device_is_lower_bound"] = True
  if out["bytes_per_device"] is not None:
    out["margin_bytes"] = hbm_bytes - out["bytes_per_device"]
  return out


def _cost(compiled, program: step_program.StepProgram, chip, devices: int,
          which: str) -> dict[str, Any]:
  """XLA's flops and step-time estimate of the compiled program (aot_cost.xla_cost: ops it
  cannot time corrected), beside the analytic cost model for a train step."""
  cost = aot_cost.xla_cost(compiled)
  # The partitioned program is one device's: its flops and bytes are per device already.
  flops, seconds = cost["flops"], cost["optimal_seconds"]
  out: dict[str, Any] = {"flops_per_device": flops, "optimal_seconds": seconds,
                         "xla_optimal_seconds_raw": cost["optimal_seconds_raw"],
                         "bytes_accessed_per_device": cost["bytes_accessed"],
                         "cost_from": "the compiled program"}
  if which == "train":
    analytic = program.flops_per_step() / devices
    out["analytic_flops_per_device"] = analytic
    out["xla_over_analytic_flops"] = flops / analytic if analytic else None
    # The MFU XLA's step-time estimate implies, for t5lite's model FLOPs: not a measurement.
    out["estimated_mfu"] = analytic / (seconds * chip.peak_flops) if seconds else None
  else:
    out["analytic_flops_per_device"] = out["estimated_mfu"] = None
  out["windowed_einsum_loops"] = cost["windowed_einsum_loops"]
  return out


def _write(directory: str, name: str, text: str) -> str:
  """`directory`/`name` written whole; the directory a local folder or a bucket URL."""
  paths.makedirs(directory)
  path = paths.join(directory, name)
  atomic.write_file(path, text)
  return path


# --- CUDA: lower only ----------------------------------------------------------------------

def lower_for_cuda(model_config: ModelConfig, config, num_devices: int, *,
                   program: str = "train", emit_hlo: str | None = None) -> dict[str, Any]:
  """Traces and lowers the run's program for CUDA over an abstract mesh of num_devices GPUs
  (no GPU and no CUDA jaxlib needed): a check that it traces, no memory or cost figures."""
  if num_devices < 1:
    raise ConfigError(f"--devices must be positive, got {num_devices}")
  sizes = config.mesh.resolve(num_devices)
  mesh = AbstractMesh(sizes, part.MESH_AXES, axis_types=(AxisType.Auto,) * len(sizes))
  built = _program(model_config, config, mesh)
  if program == "train":
    fn, args, extra = built.step_fn, built.abstract_args(), {}
  else:
    fn, args, extra = _decode_call(model_config, config, built)
  start = time.perf_counter()
  with part.activate(mesh, built.rules):
    lowered = fn.trace(*args).lower(lowering_platforms=("cuda",))
  report = {"program": program, "platform": "cuda", "devices": num_devices,
            "mesh": dict(mesh.shape), "batch_size": config.batch_size, "lowered": True,
            "compiled": False, "lower_s": round(time.perf_counter() - start, 3),
            "note": "lowered for CUDA only (it traces); memory, flops and fit need a GPU compile",
            **extra, **_state_bytes(built)}
  if emit_hlo:
    report["hlo_path"] = _write(emit_hlo, f"{program}_step.cuda.stablehlo.txt",
                                lowered.as_text())
  return report


# --- the table -----------------------------------------------------------------------------

def _gib(n) -> str:
  return "-" if n is None else f"{n / 1024**3:,.3f} GiB ({n:,} B)"


def table(r: dict[str, Any]) -> str:
  """The human-readable report (the JSON line follows it)."""
  rows = [("program", f"{r['program']} on {r['platform']}"),
          ("devices / mesh", f"{r['devices']}  {r['mesh']}")]
  if r["platform"] == "cuda":
    rows += [("lowered", f"yes, in {r['lower_s']} s (not compiled: {r['note']})"),
             ("params per device", _gib(r["params_bytes_per_device"]))]
    return _format(rows)
  rows.insert(1, ("topology", f"{r['topology']} x {r['num_slices']} slice(s), TPU {r['chip']}"))
  rows += [("params per device", _gib(r["params_bytes_per_device"])),
           ("train state per device", _gib(r["state_bytes_per_device"]))]
  if "xla_refused" in r:
    at_least = "at least " if r.get("bytes_per_device_is_lower_bound") else ""
    rows += [("fits", f"NO: does not fit, XLA refused it: {at_least}"
                      f"{_gib(r.get('bytes_per_device'))} needed, HBM {_gib(r['hbm_bytes'])} "
                      f"({_gib(r.get('xla_usable_hbm_bytes'))} usable)"),
             ("XLA said", r["xla_refused"][:200]), ("compile", f"{r['compile_s']} s")]
    return _format(rows)
  hbm, total = r["hbm_bytes"], r["bytes_per_device"]
  verdict = (f"yes, {_gib(r['margin_bytes'])} to spare" if r["fits"]
             else f"NO: does not fit, {_gib(-r['margin_bytes'])} over")
  rows += [("arguments", _gib(r["argument_bytes"])), ("outputs", _gib(r["output_bytes"])),
           ("temporaries", _gib(r["temp_bytes"])),
           ("donated (alias, counted once)", _gib(r["alias_bytes"])),
           ("generated code", _gib(r["code_bytes"])),
           ("total per device", f"{_gib(total)}  = {100 * total / hbm:.1f}% of HBM"),
           ("HBM per chip", _gib(hbm)), ("fits", verdict),
           ("compile", f"{r['compile_s']} s" + (f" (compiler options {options})"
                                                  if (options := r.get("compiler_options")) else "")),
           ("XLA flops per device", f"{r['flops_per_device']:.4g}")]
  if r.get("analytic_flops_per_device"):
    ratio = r.get("xla_over_analytic_flops")
    rows += [("t5lite cost model flops/device", f"{r['analytic_flops_per_device']:.4g}"
              + (f"  (XLA / model = {ratio:.3f})" if ratio is not None else ""))]
  if "loop-free" in r.get("cost_from", ""):
    rows.append(("cost from", f"{r['cost_from']} ({r['cost_compile_s']} s; the compiled "
                 f"program, which XLA counts loop bodies of once: {r['xla_flops_compiled_program']:.4g} "
                 "flops)"))
  if r.get("xla_cost_counts_loop_bodies_once"):
    skipped = (" (--fit_only: no loop-free compiles, no MFU estimate)"
               if r.get("cost_skipped") else "")
    rows.append(("note", f"XLA counts a loop body once: with "
                 f"{r['xla_cost_counts_loop_bodies_once']}, its flops and time undercount"
                 + skipped))
  if r.get("cost_note"):
    rows.append(("note", r["cost_note"]))
  seconds = r.get("optimal_seconds")
  rows.append(("XLA optimal_seconds (estimate)", f"{seconds:.4g} s" if seconds else
               f"none (XLA gave {r.get('xla_optimal_seconds_raw')}: ops it could not time)"))
  if r.get("estimated_mfu") is not None:
    rows.append(("estimated MFU (XLA's estimate)", f"{100 * r['estimated_mfu']:.1f}% "
                 "(model FLOPs / (optimal_seconds x chips x peak); not a measurement)"))
  return _format(rows)


def _format(rows) -> str:
  width = max(len(k) for k, _ in rows)
  return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
