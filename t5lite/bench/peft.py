"""`t5lite bench peft`: full finetuning vs LoRA vs prompt tuning, side by side.

  t5lite bench peft [--model bench] [--methods full,lora,prompt_tuning] [--steps 5]
                    [--finetune_steps 200] [--base MODEL_DIR] [--out runs/bench_peft]

Every method trains through the real Trainer (t5lite.train.trainer): full finetuning with the
base's params as its start, LoRA and prompt tuning with TrainConfig.peft = PeftConfig(base=a
MODEL_DIR written first, adapter=...), so the base is the step's frozen fixed_params and the
train state holds the adapters only.

  full           every param trains (AdamW state for all of them)
  lora           AdapterConfig(method='lora', r=8, lora_alpha=16, target_modules=('query',
                 'value')): every query and value projection, encoder and decoder
  prompt_tuning  AdapterConfig(method='prompt_tuning', num_virtual_tokens=20)

Two parts:

speed    on `t5lite bench train`'s T5 config (--model bench: d_model 256, d_ff 1024, 4 heads
         of 64, 4+4 layers, vocab 32128; T5 v1.1 gated-GELU) and its pretrain batch (B x 512
         inputs, B x 114 targets of random ids), AdamW: the trainer's jitted step compiled
         ahead of time, --warmup untimed steps, then --steps steps timed one by one (each
         until its state is ready), in rounds of one step of each method, so that other
         processes' load falls on every method alike (their CPU share is measured over each
         timed step and reported); reported: the median step time, the trainable params
         (the train state's params), the optimizer-state bytes (the real optax state tree of
         the train state the Trainer built, summed over its arrays), the train state's param
         bytes, the frozen base's bytes, and XLA's memory estimate of the compiled step.
quality  on the embedded summarization task stdlib_docstring_summary (a docstring's body ->
         its first line), each method finetunes --finetune_steps steps from the same base
         (--base: a t5lite MODEL_DIR, e.g. the demo's pretrained runs/demo/pretrain; without
         it, a random init of --model with the task's vocabulary), then the trainer's own
         inference eval decodes --eval_examples validation examples greedily and scores them
         with the task's metrics (ROUGE-1/2/Lsum). AdamW, constant learning rate per method
         (--learning_rates: adapters usually take a larger one).

Prints a table and ends with one JSON line (ratio_vs_hf null: the methods compare with each
other; there is no HF peer run here). A method that fails (e.g. one the model does not support
yet) is reported with its error instead of its figures, and the bench exits 1.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

from t5lite.bench import fresh_out

METHODS = ("full", "lora", "prompt_tuning")
TASK = "stdlib_docstring_summary"
LEARNING_RATES = {"full": 1e-3, "lora": 5e-3, "prompt_tuning": 3e-2}


def adapter_of(method: str):
  """The AdapterConfig of a PEFT method; None for full finetuning."""
  from t5lite.models.adapters import AdapterConfig
  if method == "full":
    return None
  if method == "lora":
    return AdapterConfig(method="lora", r=8, lora_alpha=16, target_modules=("query", "value"))
  if method == "prompt_tuning":
    return AdapterConfig(method="prompt_tuning", num_virtual_tokens=20)
  raise ValueError(f"unknown method {method!r}; one of {METHODS}")


def tree_bytes(tree) -> int:
  import jax
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def tree_size(tree) -> int:
  import jax
  return int(sum(x.size for x in jax.tree.leaves(tree)))


def lora_params_expected(config, adapter) -> int:
  """LoRA's trainable params by the formula: r * (fan_in + fan_out) over the targeted kernels
  (a Dense kernel's first axis is its input, the rest its output; under scan_layers, a leading
  layer axis)."""
  from flax import traverse_util
  from t5lite.families import family_of
  flat = traverse_util.flatten_dict(family_of(config).abstract_params())
  total = 0
  for path, x in flat.items():
    if path[-1] != "kernel" or not adapter.targets(path[:-1]):
      continue
    stacked = config.scan_layers and "layers" in path
    layers = x.shape[0] if stacked else 1
    shape = x.shape[int(stacked):]
    total += layers * adapter.r * (shape[0] + math.prod(shape[1:]))
  return total


def _train_config(model_dir: str, *, steps: int, batch_size: int, lengths: dict, method: str,
                  base: str, learning_rate: float, **changes):
  from t5lite.families.peft import PeftConfig
  from t5lite.runtime.checkpoints import CheckpointConfig
  from t5lite.train.optimizers import OptimizerConfig
  from t5lite.train.schedules import ScheduleConfig
  from t5lite.train.trainer import TrainConfig
  adapter = adapter_of(method)
  optimizer = OptimizerConfig(name="adamw", schedule=ScheduleConfig(
      name="constant", value=learning_rate, warmup_steps=0))
  return TrainConfig(**{
      "model_dir": model_dir, "train_steps": steps, "batch_size": batch_size,
      "mixture_or_task_name": TASK, "task_feature_lengths": lengths, "eval_period": 0,
      "optimizer": optimizer,
      "checkpoint": CheckpointConfig(period=steps, keep=1, keep_period=None),
      "peft": None if adapter is None else PeftConfig(base=base, adapter=adapter),
      "initial_checkpoint_path": base if adapter is None else None, **changes})


def _write_base(path: str, config, params, vocabulary=None) -> str:
  from t5lite.interop import params_only
  params_only.write_model_dir(path, config, params, step=0, vocabulary=vocabulary)
  return path


# --- speed -----------------------------------------------------------------------------------

class SpeedSide:
  """One method's Trainer (its real train state and jitted step, compiled ahead of time) on
  `t5lite bench train`'s pretrain batch; `step()` runs and times one step."""

  def __init__(self, config, method: str, base: str, model_dir: str, *, batch_size: int,
               lengths: tuple[int, int], steps: int, warmup: int, seed: int):
    import jax
    from t5lite.bench.train_batches import pretrain_batches
    from t5lite.runtime import model_dir as model_dir_lib
    from t5lite.runtime import partitioning as part
    from t5lite.train.loop import step_memory
    from t5lite.train.step import new_window
    from t5lite.train.trainer import Trainer
    self.jax, self.method = jax, method
    train_config = _train_config(model_dir, steps=warmup + steps, batch_size=batch_size,
                                 lengths={"inputs": lengths[0], "targets": lengths[1]},
                                 method=method, base=base, learning_rate=1e-3)
    trainer = self.trainer = Trainer(config, train_config)
    if trainer.config.peft is None:  # full finetuning starts from the base's params
      _, params, _ = model_dir_lib.load_params(base, trainer.mesh, trainer.rules)
      self.state = trainer.state_from_params(jax.device_put(params, trainer.param_shardings), 0)
      del params
    else:
      self.state = trainer.fresh_state()  # the adapters' init; the base: trainer.fixed_params
    host_batch = pretrain_batches(config.vocab_size, batch_size, lengths, seed)[0][0]
    with part.activate(trainer.mesh, trainer.rules):
      self.batch = part.global_batch(host_batch, trainer.mesh)
      self.window = jax.device_put(new_window(), trainer.replicated)
      start = time.perf_counter()
      self.compiled = trainer.step_fn.lower(self.state, self.window, self.batch).compile()
      self.compile_s = time.perf_counter() - start
    self.memory = step_memory(self.compiled)
    self.times: list[float] = []
    self.losses: list[float] = []
    self.others: list[float] = []

  def step(self, timed: bool) -> None:
    from t5lite.bench import machine
    others = machine.OthersCpu().start()
    start = time.perf_counter()
    self.state, self.window, metrics = self.compiled(self.state, self.window, self.batch)
    self.jax.block_until_ready((self.state, metrics))
    if timed:
      self.times.append(time.perf_counter() - start)
      fraction = others.stop()
      if fraction is not None:
        self.others.append(fraction)
    self.losses.append(float(metrics["loss"]))

  def figures(self) -> dict:
    jax, trainer, state = self.jax, self.trainer, self.state
    mask = trainer.family.trainable_mask(state.params)
    trainable = int(sum(x.size for x, m in zip(jax.tree.leaves(state.params),
                                               jax.tree.leaves(mask)) if m))
    figures = {
        "step_s_median": round(statistics.median(self.times), 5),
        "step_s": [round(t, 5) for t in self.times],
        "trainable_params": trainable,
        "model_params": tree_size(trainer.model_params(state.params)),
        "optimizer_state_bytes": tree_bytes(state.opt_state),
        "train_state_param_bytes": tree_bytes(state.params),
        "frozen_base_bytes": tree_bytes(trainer.fixed_params) if trainer.config.peft else 0,
        "step_memory_bytes": self.memory.get("step_memory_bytes"),
        "compile_s": round(self.compile_s, 2),
        # Other processes' share of the CPUs during each timed step: median and worst
        # (0: the machine was ours).
        "others_cpu_fraction": ([round(statistics.median(self.others), 3),
                                 round(max(self.others), 3)] if self.others else None),
        "losses": [round(x, 5) for x in self.losses],
    }
    if self.method == "lora":
      figures["trainable_params_formula"] = lora_params_expected(trainer.model_config,
                                                                 trainer.model_config.adapter)
    return figures


def measure_speed(config, methods, base: str, out: str, *, batch_size: int,
                  lengths: tuple[int, int], steps: int, warmup: int, seed: int,
                  log: Callable[[str], Any]) -> tuple[dict, dict]:
  """({method: figures}, {method: error}): every method's Trainer is built and its step
  compiled first; then the steps run in rounds, one step of each method a round, so that
  other processes' load falls on all of them alike."""
  sides, errors = {}, {}
  for method in methods:
    try:
      sides[method] = SpeedSide(config, method, base, os.path.join(out, f"speed_{method}"),
                                batch_size=batch_size, lengths=lengths, steps=steps,
                                warmup=warmup, seed=seed)
    except Exception as e:  # noqa: BLE001 (reported, the other methods still run)
      errors[method] = f"{type(e).__name__}: {e}"
      log(f"  {method}: FAILED: {errors[method]}")
  for i in range(warmup + steps):
    for side in sides.values():
      side.step(timed=i >= warmup)
  figures = {}
  for method, side in sides.items():
    figures[method] = side.figures()
    log(f"  {method}: step {figures[method]['step_s_median'] * 1e3:.1f} ms (median of "
        f"{steps}), {figures[method]['trainable_params']:,} trainable params, optimizer "
        f"state {figures[method]['optimizer_state_bytes']:,} B")
  return figures, errors


# --- quality ---------------------------------------------------------------------------------

def finetune_quality(config, method: str, base: str, model_dir: str, *, steps: int,
                     batch_size: int, lengths: dict, learning_rate: float, eval_examples: int,
                     seed: int) -> dict:
  """One method's ROUGE on the summarization task after `steps` steps from `base`."""
  from t5lite.train.trainer import train
  train_config = _train_config(model_dir, steps=steps, batch_size=batch_size, lengths=lengths,
                               method=method, base=base, learning_rate=learning_rate,
                               infer_eval_period=steps, infer_eval_examples=eval_examples,
                               eval_period=steps, eval_steps=8, log_period=max(1, steps // 4),
                               seed=seed)
  start = time.time()
  result = train(config, train_config, log=lambda _: None)
  prefix = f"eval/{TASK}/"
  metrics = {k[len(prefix):]: round(float(v), 4) for k, v in result.eval_metrics.items()
             if k.startswith(prefix)}
  return {"steps": steps, "learning_rate": learning_rate,
          "rouge": {k: v for k, v in metrics.items() if k.startswith("rouge")},
          "eval_loss": metrics.get("loss"),
          "train_loss_logged": {str(k): round(v, 4) for k, v in sorted(result.losses.items())},
          "seconds": round(time.time() - start, 1)}


def task_model_config(config, vocab_size: int):
  return config.replace(vocab_size=-(-vocab_size // 128) * 128)


# --- the run ---------------------------------------------------------------------------------

def run(*, model: str = "bench", methods: tuple[str, ...] = METHODS, batch_size: int = 8,
        inputs_length: int = 512, targets_length: int = 114, steps: int = 5, warmup: int = 2,
        finetune_steps: int = 200, finetune_batch_size: int = 16,
        finetune_lengths: tuple[int, int] = (256, 32), eval_examples: int = 64,
        learning_rates: dict | None = None, base: str | None = None,
        out: str = "runs/bench_peft", overwrite: bool = False, seed: int = 0,
        log: Callable[[str], Any] | None = print) -> dict:
  """Runs both parts (quality only when finetune_steps > 0); returns the JSON line's dict."""
  import jax
  from t5lite.bench import machine
  from t5lite.bench.train import model_config
  from t5lite.families import family_of
  import t5lite_tasks  # noqa: F401 (registers the embedded tasks: the runs' TrainConfig names one)
  log = log or (lambda _: None)
  learning_rates = {**LEARNING_RATES, **(learning_rates or {})}
  fresh_out(out, overwrite)
  started = time.time()

  config = model_config(model)
  speed_base = _write_base(os.path.join(out, "speed_base"), config,
                           family_of(config).init_params(seed))
  n_params = tree_size(family_of(config).abstract_params())
  log(f"bench peft: speed on model {model} ({n_params / 1e6:.2f}M params, vocab "
      f"{config.vocab_size}), batch {batch_size} x ({inputs_length}, {targets_length}), "
      f"median of {steps} steps after {warmup}, backend {jax.default_backend()}")
  speed, errors = measure_speed(config, methods, speed_base, out, batch_size=batch_size,
                                lengths=(inputs_length, targets_length), steps=steps,
                                warmup=warmup, seed=seed, log=log)

  quality: dict[str, dict] = {}
  finetune = None
  if finetune_steps > 0:
    from t5lite.train.trainer import task_vocabulary
    vocabulary = task_vocabulary(TASK)
    if base:
      from t5lite.runtime import model_dir as model_dir_lib
      base_config, params, base_step = model_dir_lib.load_params(base)
      source = f"{base} (step {base_step})"
    else:
      base_config = task_model_config(config, vocabulary.vocab_size)
      params = family_of(base_config).init_params(seed)
      source = f"random init of {model}"
    # The base every method starts from, as a step-0 MODEL_DIR with the task's vocabulary.
    ft_base = _write_base(os.path.join(out, "finetune_base"), base_config, params, vocabulary)
    del params
    lengths = {"inputs": finetune_lengths[0], "targets": finetune_lengths[1]}
    finetune = {"task": TASK, "base": source, "steps": finetune_steps,
                "batch_size": finetune_batch_size, "lengths": lengths,
                "eval_examples": eval_examples, "decode": "greedy", "optimizer": "adamw",
                "params": tree_size(family_of(base_config).abstract_params())}
    log(f"bench peft: {finetune_steps} finetuning steps of {TASK} from {source}, batch "
        f"{finetune_batch_size} x {finetune_lengths}, ROUGE on {eval_examples} validation "
        "examples")
    for method in methods:
      if method in errors:
        continue
      try:
        quality[method] = finetune_quality(
            base_config, method, ft_base, os.path.join(out, f"finetune_{method}"),
            steps=finetune_steps, batch_size=finetune_batch_size, lengths=lengths,
            learning_rate=learning_rates[method], eval_examples=eval_examples, seed=seed)
        log(f"  {method}: {quality[method]['rouge']} ({quality[method]['seconds']} s)")
      except Exception as e:  # noqa: BLE001
        errors[method] = f"{type(e).__name__}: {e}"
        log(f"  {method}: FAILED: {errors[method]}")

  results = {}
  for method in methods:
    entry = dict(speed.get(method, {}))
    if method in quality:
      entry["finetune"] = quality[method]
    if method in errors:
      entry["error"] = errors[method]
    adapter = adapter_of(method)
    entry["adapter"] = None if adapter is None else adapter.to_dict()
    results[method] = entry
  full = speed.get("full")
  for method, entry in results.items():
    if full and "trainable_params" in entry and method != "full":
      entry["trainable_fraction"] = round(entry["trainable_params"] / full["trainable_params"], 6)
      entry["optimizer_state_vs_full"] = round(
          entry["optimizer_state_bytes"] / full["optimizer_state_bytes"], 6)
      entry["step_time_vs_full"] = round(entry["step_s_median"] / full["step_s_median"], 4)
  return {
      "bench": "peft",
      "machine": machine.describe(),
      "model": model,
      "config": {k: getattr(config, k) for k in (
          "vocab_size", "d_model", "d_ff", "num_heads", "d_kv", "num_encoder_layers",
          "num_decoder_layers", "mlp_activation", "dtype")},
      "batch_size": batch_size, "inputs_length": inputs_length,
      "targets_length": targets_length, "steps_timed": steps, "warmup_steps": warmup,
      "step_time": "median over steps_timed steps, each timed until its state is ready; the "
                   "methods' steps interleaved (one of each a round)",
      "optimizer": "adamw",
      "methods": results,
      "finetune": finetune,
      "seconds": round(time.time() - started, 1),
      "ratio_vs_hf": None,
  }


def table(report: dict) -> str:
  rows = [f"{'method':14s} {'step ms':>9s} {'vs full':>8s} {'trainable':>12s} "
          f"{'opt state MiB':>14s} {'ROUGE-1':>8s} {'ROUGE-2':>8s} {'ROUGE-Lsum':>10s}"]
  for method, e in report["methods"].items():
    if "error" in e and "step_s_median" not in e:
      rows.append(f"{method:14s} failed: {e['error'][:100]}")
      continue
    rouge = e.get("finetune", {}).get("rouge", {})
    cell = lambda k: f"{rouge[k]:.2f}" if k in rouge else "-"  # noqa: E731
    rows.append(f"{method:14s} {e['step_s_median'] * 1e3:9.1f} "
                f"{e.get('step_time_vs_full', 1.0):8.2f} {e['trainable_params']:12,d} "
                f"{e['optimizer_state_bytes'] / 2**20:14.3f} {cell('rouge1'):>8s} "
                f"{cell('rouge2'):>8s} {cell('rougeLsum'):>10s}"
                + (f"  ({e['error'][:80]})" if "error" in e else ""))
  return "\n".join(rows)


def _rates(text: str) -> dict:
  try:
    rates = {k.strip(): float(v) for k, v in (p.split("=") for p in text.split(",") if p)}
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"expected METHOD=RATE,..., got {text!r}") from e
  unknown = set(rates) - set(METHODS)
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown methods {sorted(unknown)}; one of {METHODS}")
  return rates


def main(argv: list[str] | None = None) -> int:
  from t5lite.bench.train import MODELS
  parser = argparse.ArgumentParser(prog="t5lite bench peft", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", choices=sorted(MODELS), default="bench",
                      help="`t5lite bench train`'s T5 presets; 'bench' is its reference")
  parser.add_argument("--methods", default=",".join(METHODS),
                      help=f"comma-separated, of {', '.join(METHODS)}")
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--inputs_length", type=int, default=512)
  parser.add_argument("--targets_length", type=int, default=114)
  parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is kept)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
  parser.add_argument("--finetune_steps", type=int, default=200,
                      help="steps of each method on the summarization task (0: skip it)")
  parser.add_argument("--finetune_batch_size", type=int, default=16)
  parser.add_argument("--finetune_inputs_length", type=int, default=256)
  parser.add_argument("--finetune_targets_length", type=int, default=32)
  parser.add_argument("--eval_examples", type=int, default=64,
                      help="validation examples decoded for ROUGE")
  parser.add_argument("--learning_rates", type=_rates, default={},
                      help="e.g. full=1e-3,lora=5e-3,prompt_tuning=3e-2 (the defaults)")
  parser.add_argument("--base", default=None,
                      help="the finetuning base: a t5lite MODEL_DIR over the embedded "
                      "vocabulary (e.g. runs/demo/pretrain); default: a random init of --model")
  parser.add_argument("--out", default="runs/bench_peft")
  parser.add_argument("--overwrite", action="store_true",
                      help="empty a non-empty --out first (its runs are deleted)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  methods = tuple(m for m in args.methods.split(",") if m)
  if not methods or set(methods) - set(METHODS):
    parser.error(f"--methods {args.methods!r}: a comma-separated choice of {', '.join(METHODS)}")
  if min(args.batch_size, args.inputs_length, args.targets_length, args.steps,
         args.finetune_batch_size, args.eval_examples) < 1 or min(args.warmup,
                                                                  args.finetune_steps) < 0:
    parser.error("sizes and --steps must be positive, --warmup and --finetune_steps >= 0")
  report = run(model=args.model, methods=methods, batch_size=args.batch_size,
               inputs_length=args.inputs_length, targets_length=args.targets_length,
               steps=args.steps, warmup=args.warmup, finetune_steps=args.finetune_steps,
               finetune_batch_size=args.finetune_batch_size,
               finetune_lengths=(args.finetune_inputs_length, args.finetune_targets_length),
               eval_examples=args.eval_examples, learning_rates=args.learning_rates,
               base=args.base, out=args.out, overwrite=args.overwrite, seed=args.seed)
  print(table(report), flush=True)
  print(json.dumps(report), flush=True)
  return 1 if any("error" in e for e in report["methods"].values()) else 0


if __name__ == "__main__":
  sys.exit(main())
