"""XLA's cost of one whole train step, as `t5lite compile` reports it: flops and the step time
XLA:TPU estimates (`optimal_seconds`), corrected for two ways the raw figures mislead.

    flops, seconds, how = whole_step_cost(model_config, config, compile_cost)

1. **Loops are counted once.** XLA's cost analysis counts a while loop's body once, not once
   per trip: a model with scanned layers (ModelConfig.scan_layers) reports one layer of each
   stack, a step with microbatches one microbatch (T5 1.1 base scanned: 0.12 x the cost model).
   Cost is affine in the number of layers of each stack and in the microbatches, so it is
   measured on small programs without loops and extrapolated: the same run with unscanned
   layers, one microbatch of BATCH_SIZE / microbatches rows, compiled with 1 layer per stack
   and with 2 layers in one stack at a time (the stacks of equal depth together), then
   cost(L) = cost(1) + sum over stacks of (L - 1) x (cost(2 in it) - cost(1)), x microbatches.
   What this leaves out is small and known: the optimizer update and gradient accumulation
   counted once per microbatch instead of once, and a scan's own bookkeeping.
   XLA:TPU may write loops of its own into a program without any: windowed einsums, a
   matmul whose operand is all-gathered (or whose result is reduce-scattered) split into
   steps that overlap the transfer, chosen when the operands are large (T5 1.1 xl at 64 rows
   a chip: 39 such loops in the one-layer program, XLA's flops 0.72 x the model's).
   windowed_einsum_loops counts them; a cost with any is no estimate of the step.
2. **Ops XLA cannot time count -1 s.** XLA:TPU's estimate comes out near minus an integer for
   programs with data-parallel inputs (-13.9993 for a tiny T5): each `ConcatBitcast` custom
   call (a concatenation of slices that is only a re-labelling of memory) adds -1 s to
   `optimal_seconds` (measured: the raw figure + their count = the same program's time
   without them). The ones XLA's cost analysis counts (untimed_ops) are added back; a figure
   still not positive is reported as none.

Both are XLA's estimates from its cost model, not measurements.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from t5lite.models.config import ModelConfig

# Custom calls XLA:TPU's cost analysis charges -1 s each (see the module docstring).
UNTIMED_CUSTOM_CALLS = ("ConcatBitcast",)
CompileCost = Callable[[ModelConfig, object], tuple[float, float | None]]
"""(model config, train config) -> (flops, optimal seconds or None) of that run's compiled step."""


def xla_cost(compiled) -> dict[str, float | None]:
  """flops, optimal_seconds (corrected, None when not positive), the raw figure, and the
  windowed einsum loops XLA wrote (see the module docstring)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  cost = cost or {}
  text = compiled.as_text()
  raw = cost.get("optimal_seconds")
  seconds = None
  if raw is not None:
    seconds = float(raw) + untimed_ops(text)
    seconds = seconds if seconds > 0 else None
  return {"flops": float(cost.get("flops", 0.0)), "optimal_seconds": seconds,
          "optimal_seconds_raw": None if raw is None else float(raw),
          "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
          "windowed_einsum_loops": windowed_einsum_loops(text)}


# XLA's SPMD partitioner names a windowed einsum's loop body windowed_dot_general_body_ag
# (all-gather) or _rs (reduce-scatter); later passes add suffixes (.clone, .sunk).
_WINDOWED_EINSUM = re.compile(r"\bbody=%?[\w.\-]*windowed_dot_general_body")


def windowed_einsum_loops(hlo_text: str) -> int:
  """How many windowed einsum loops an optimized HLO module has (see the module docstring)."""
  return len(_WINDOWED_EINSUM.findall(hlo_text))


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_CALLED = re.compile(r"\b(?:calls|body|condition|to_apply|true_computation|false_computation)="
                     r"%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")


def untimed_ops(hlo_text: str) -> int:
  """How many UNTIMED_CUSTOM_CALLS XLA's cost analysis of this optimized HLO module counts:
  those of the entry computation and of everything it calls (a loop body once, as XLA
  counts it), and of one branch per conditional: the branch with the fewest, since XLA
  costs a conditional as its costliest branch and each untimed call makes a branch -1 s
  cheaper (measured: a BERT step whose MLM loss has a conditional with 4 and 10 of them in
  its branches counted 4)."""
  computations: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      match = _COMPUTATION.match(line)
      if match:
        current = match.group(1)
        computations[current] = []
        if line.startswith("ENTRY"):
          entry = current
        continue
    if current is not None and line.startswith(" "):
      computations[current].append(line)
  memo: dict[str, int] = {}

  def count(name: str) -> int:
    if name not in memo:
      memo[name] = 0  # a guard against cycles, which HLO does not have
      total = 0
      for line in computations.get(name, ()):
        total += sum(line.count(f'custom_call_target="{c}"') for c in UNTIMED_CUSTOM_CALLS)
        total += sum(count(callee) for callee in _CALLED.findall(line))
        for branches in _BRANCHES.findall(line):
          total += min(count(b.strip().lstrip("%")) for b in branches.split(","))
      memo[name] = total
    return memo[name]
  return count(entry) if entry else 0


def loops(model_config: ModelConfig, config, program: str = "train") -> str | None:
  """The loops of a run's compiled program whose bodies XLA counts once, in words; None if
  it has none."""
  why = []
  if program == "decode":
    why.append("the decode loop over output positions")
  elif model_config.scan_layers:
    why.append("scanned layers (ModelConfig.scan_layers)")
  if program == "train" and config.step.microbatches > 1:
    why.append(f"{config.step.microbatches} microbatches (a scan)")
  return " and ".join(why) or None


def _stacks(model_config: ModelConfig) -> dict[str, int]:
  """Depth of each stack the model has: {'num_encoder_layers': 24, 'num_decoder_layers': 24}."""
  fields = (("num_encoder_layers", model_config.has_encoder),
            ("num_decoder_layers", model_config.has_decoder))
  return {name: getattr(model_config, name) for name, present in fields if present}


def unrolled_programs(model_config: ModelConfig, config) -> list[tuple[ModelConfig, object, dict]]:
  """The loop-free runs whose costs extrapolate to the whole step: (model, train config,
  {stack: layers}) with every stack at 1 layer first, then each group of equally deep stacks
  at 2."""
  m = config.step.microbatches
  one_micro = dataclasses.replace(config, batch_size=config.batch_size // m,
                                  step=dataclasses.replace(config.step, microbatches=1))
  depth = _stacks(model_config)
  groups: dict[int, list[str]] = {}
  for name, layers in depth.items():
    groups.setdefault(layers, []).append(name)
  points = [{name: 1 for name in depth}]
  points += [{name: 2 if name in names else 1 for name in depth}
             for layers, names in groups.items() if layers > 1]
  return [(model_config.replace(scan_layers=False, **point), one_micro, point)
          for point in points]


def whole_step_cost(model_config: ModelConfig, config,
                    compile_cost: CompileCost) -> tuple[float, float | None]:
  """(flops, optimal seconds or None) of one whole step of a run whose program loops, from
  compile_cost of the loop-free programs of unrolled_programs (see the module docstring)."""
  runs = unrolled_programs(model_config, config)
  costs = [compile_cost(model, train) for model, train, _ in runs]
  depth = _stacks(model_config)
  flops, seconds = costs[0]
  base_point = runs[0][2]
  for (_, _, point), (f, s) in zip(runs[1:], costs[1:]):
    grown = [name for name in point if point[name] != base_point[name]]
    extra = depth[grown[0]] - 1  # the stacks of a group are equally deep
    flops += extra * (f - costs[0][0])
    seconds = None if seconds is None or s is None else seconds + extra * (s - costs[0][1])
  m = config.step.microbatches
  return flops * m, (None if seconds is None else seconds * m)
