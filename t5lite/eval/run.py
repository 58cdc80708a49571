"""`t5lite eval` and `t5lite infer`: a checkpoint on tasks, or on raw text.

    t5lite eval --gin_file=gin/runs/eval.gin --gin.CHECKPOINT_PATH=/tmp/run \\
      --gin.MIXTURE_OR_TASK_NAME=stdlib_docstring_summary
    t5lite infer --gin_file=gin/runs/infer.gin --gin.CHECKPOINT_PATH=/tmp/run \\
      --gin.INFER_INPUT=inputs.txt --gin.INFER_OUTPUT=outputs.jsonl

Both read the model config and vocabulary from the checkpoint's MODEL_DIR, so no model gin
file is needed. A PEFT run's RUN_DIR as CHECKPOINT_PATH is joined with the base its peft.json
names; or CHECKPOINT_PATH is the base and `--adapter RUN_DIR` its adapters (eval and infer),
or `--adapters a=RUN_DIR,b=RUN_DIR` several, which infer's JSONL lines pick by name
({"inputs": "...", "adapter": "a"}), rows of different adapters decoded in one program.
With several processes (a pod), every process decodes (the model is laid out over all
devices) and only process 0 writes files and prints. eval writes, under
EVAL_OUTPUT_DIR (default MODEL_DIR/eval):
  metrics-<step>.json          every task's metrics, keyed eval/<task>/<metric>
  <task>-<step>.jsonl          per example: inputs, target, prediction (and score)
  metrics.jsonl, tensorboard/  the same metrics as a series over checkpoint steps
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from typing import Iterator, Mapping, Sequence

import numpy as np

from t5lite.util.checks import check_feature_lengths, require_int
from t5lite.data.registry import tasks_of
from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.eval.evaluator import DecodeConfig, TaskEvaluator, pad_rows
from t5lite.families import family_of
from t5lite.runtime.metrics_writer import MetricsWriter
from t5lite.runtime.model_dir import check_location, load_task_record, model_dir_of
from t5lite.util import atomic, paths, progress


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """`t5lite eval`: one checkpoint on one or more tasks or mixtures."""

  checkpoint_path: str
  """A MODEL_DIR (its newest checkpoint) or one step folder (CHECKPOINT_PATH)."""
  mixture_or_task_name: str | Sequence[str]
  """A task or mixture name, or several (mixtures are evaluated task by task)."""
  task_feature_lengths: Mapping[str, int]
  """Inputs are cut to inputs' length; targets' length bounds decoding."""
  output_dir: str | None = None
  """Where results go (EVAL_OUTPUT_DIR); None: MODEL_DIR/eval."""
  split: str = "validation"
  max_examples: int | None = None
  """Evaluate on the first this many examples of each task (None: all)."""
  decode: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)
  adapter: str | None = None
  """A PEFT run's RUN_DIR (`--adapter`) whose adapters are evaluated on the base
  checkpoint_path (checked by fingerprint); its results go to RUN_DIR/eval by default. None:
  checkpoint_path alone (a PEFT RUN_DIR there is joined with the base its peft.json names)."""

  def __post_init__(self):
    check_location(self.checkpoint_path, "CHECKPOINT_PATH")
    check_location(self.output_dir, "EVAL_OUTPUT_DIR")
    check_location(self.adapter, "--adapter")
    check_feature_lengths(self.task_feature_lengths, "TASK_FEATURE_LENGTHS",
                          self.decode.batch_size)
    require_int(self.max_examples, "EvalConfig.max_examples", minimum=1, optional=True)
    _check_max_decode_length(self.decode)


@dataclasses.dataclass(frozen=True)
class InferConfig:
  """`t5lite infer`: decode raw inputs with a checkpoint."""

  checkpoint_path: str
  """A MODEL_DIR (its newest checkpoint) or one step folder (CHECKPOINT_PATH)."""
  input_path: str = "-"
  """One input per line, or JSONL objects with an 'inputs' field; '-' reads stdin."""
  output_path: str = "-"
  """JSONL, one {"inputs", "prediction"} object per input; '-' writes stdout."""
  inputs_length: int = 512
  """Inputs are tokenized and cut to this length (less one for an EOS: see prompt_eos)."""
  decode: DecodeConfig = dataclasses.field(
      default_factory=lambda: DecodeConfig(max_decode_length=128))
  adapter: str | None = None
  """`--adapter`: a PEFT run's RUN_DIR (or a name from `adapters`) whose adapters decode every
  input that names none, on the base checkpoint_path (checked by fingerprint). None: such
  inputs use checkpoint_path alone (a PEFT RUN_DIR there is joined with its own base)."""
  adapters: Mapping[str, str] | str | None = None
  """`--adapters a=RUN_DIR,b=RUN_DIR` (or a gin dict): adapters of the base checkpoint_path
  (LoRA, or soft prompts, or prefixes: one kind) that JSONL inputs pick by name ({"inputs":
  ..., "adapter": "a"}; "base": the base alone, LoRA only); one batch mixes them in one
  program (t5lite.interop.peft.adapter_batch)."""
  prompt_eos: bool | None = None
  """Whether each input ends with EOS before decoding. None: as the model was trained. An
  encoder-decoder's or prefix LM's inputs always did; a causal LM continues the text where it
  ends (an EOS would end the document), unless it was finetuned on a text-to-text task (its
  run's task.json has 'inputs' lengths), whose examples were inputs + EOS + targets."""

  def __post_init__(self):
    check_location(self.checkpoint_path, "CHECKPOINT_PATH")
    check_location(self.input_path, "INFER_INPUT")
    check_location(self.output_path, "INFER_OUTPUT")
    check_location(self.adapter, "--adapter")
    # inputs_length - 1 tokens and an EOS: 1 would leave no room for any text.
    require_int(self.inputs_length, "INPUTS_LENGTH (InferConfig.inputs_length)", minimum=2)
    check_feature_lengths({"inputs": self.inputs_length}, "INPUTS_LENGTH",
                          self.decode.batch_size)
    _check_max_decode_length(self.decode)


def _check_max_decode_length(decode: DecodeConfig) -> None:
  """None means the default (the targets length; 128 for infer); 0 used to mean it too, as
  `or` read it, so MAX_DECODE_LENGTH=0 silently decoded 128 tokens."""
  require_int(decode.max_decode_length, "MAX_DECODE_LENGTH (DecodeConfig.max_decode_length)",
              minimum=1, optional=True)
  check_feature_lengths({"max_decode_length": decode.max_decode_length}, "MAX_DECODE_LENGTH",
                        decode.batch_size)


def _write_jsonl(path: str, records) -> None:
  atomic.write_file(path, "".join(json.dumps(record, ensure_ascii=False) + "\n"
                                  for record in records))


def evaluate_checkpoint(config: EvalConfig, log=print) -> dict[str, float]:
  """Evaluates; returns the metrics ({eval/<task>/<metric>: value}) it also wrote."""
  import jax

  from t5lite.interop.peft import adapter_batch
  from t5lite.runtime import partitioning as part
  tasks = tasks_of(config.mixture_or_task_name)
  no_metrics = [t.name for t in tasks if not t.metric_fns]
  if no_metrics:
    raise ConfigError(f"tasks {no_metrics} have no metric_fns to evaluate")
  output_dir = config.output_dir or paths.join(
      model_dir_of(config.adapter or config.checkpoint_path), "eval")
  primary = jax.process_index() == 0  # the one process that writes and prints
  log = log if primary else _silent
  if primary:
    paths.makedirs(output_dir)
  mesh = part.make_mesh(part.MeshConfig())
  rules = part.logical_axis_rules()
  model_config, params, step, _, _ = adapter_batch.load_model(
      config.checkpoint_path, config.adapter, None, mesh, rules)
  if config.adapter:
    log(f"t5lite eval: adapter {model_dir_of(config.adapter)} at step {step} on the base "
        f"{config.checkpoint_path}")
  else:
    log(f"t5lite eval: checkpoint step {step} of {model_dir_of(config.checkpoint_path)}")
  metrics: dict[str, float] = {}
  with part.activate(mesh, rules):
    for task in tasks:
      evaluator = TaskEvaluator(task, split=config.split,
                                feature_lengths=config.task_feature_lengths,
                                max_examples=config.max_examples)
      with progress.Progress(f"eval {task.name}", evaluator.work(), "example",
                             enabled=primary) as bar:
        result = evaluator.evaluate(model_config, params, config.decode, progress=bar.update)
      if primary:
        _write_jsonl(paths.join(output_dir, f"{task.name}-{step}.jsonl"), result.predictions)
      task_metrics = {f"eval/{task.name}/{k}": v for k, v in result.metrics.items()}
      log(f"  {task.name} ({len(evaluator.examples)} examples): "
          + "  ".join(f"{k} {v:.3f}" for k, v in result.metrics.items()))
      metrics.update(task_metrics)
  if primary:
    atomic.write_file(paths.join(output_dir, f"metrics-{step}.json"),
                      json.dumps({"step": step, **metrics}, indent=2))
  with MetricsWriter(output_dir, is_primary=primary) as writer:
    writer.write(step, metrics)
  log(f"t5lite eval: wrote {output_dir}")
  return metrics


def _check_adapter_names(records, named, given: bool, path: str) -> None:
  """Refuses an input naming an adapter that was not given (`given`: --adapter or --adapters
  were), before anything is loaded."""
  from t5lite.interop.peft import adapter_batch
  names = adapter_batch.parse_adapters(named)
  for _, adapter, number in records:
    if adapter is None or adapter in names or (adapter == adapter_batch.BASE and given):
      continue
    if not given:
      raise ConfigError(f"{path} line {number} names the adapter {adapter!r}, but no adapters "
                        f"were given: add --adapters {adapter}=RUN_DIR (with the base as "
                        "CHECKPOINT_PATH)")
    raise ConfigError(f"{path} line {number}: adapter {adapter!r} is not one of --adapters "
                      f"{', '.join(names)} ({adapter_batch.BASE!r}: the base alone): add "
                      f"{adapter}=RUN_DIR to --adapters, or fix the line")


def _vocabulary(config: InferConfig):
  """The checkpoint's vocabulary; with adapters, a base without one (an HF directory, a bare
  MODEL_DIR) lends the first adapter RUN_DIR's (a PEFT run saves its task's)."""
  from t5lite.data.vocab.vocabularies import load_vocabulary
  from t5lite.interop.peft import adapter_batch
  named = adapter_batch.parse_adapters(config.adapters)
  runs = ([config.adapter] if config.adapter and config.adapter not in named else []) + list(
      named.values())
  try:
    return load_vocabulary(model_dir_of(config.checkpoint_path))
  except FileNotFoundError:
    if not runs:
      raise
    return load_vocabulary(model_dir_of(runs[0]))


def _silent(*_) -> None:
  pass


def _read_inputs(path: str) -> Iterator[str]:
  """The texts of INFER_INPUT's inputs (see _read_records)."""
  for text, _, _ in _read_records(path):
    yield text


def _read_records(path: str) -> Iterator[tuple[str, str | None, int]]:
  """(text, adapter name or None, line number) of each input: a line of text, or a JSON
  object with an 'inputs' field and optionally an 'adapter' field (a name from
  InferConfig.adapters, or 'base' for the base alone)."""
  stream = sys.stdin if path == "-" else paths.open_text(path)
  try:
    for number, line in enumerate(stream, 1):
      line = line.rstrip("\n")
      if not line.strip():
        continue
      if line.lstrip().startswith("{"):
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ConfigError(f"{path} line {number}: not valid JSON ({e})") from e
        if "inputs" not in record:
          raise ConfigError(f"{path} line {number}: a JSON object needs an 'inputs' field")
        if not isinstance(record["inputs"], str):  # str() made null the text "None"
          kind = "null" if record["inputs"] is None else type(record["inputs"]).__name__
          raise ConfigError(f"{path} line {number}: 'inputs' is {kind}, expected text")
        adapter = record.get("adapter")
        if adapter is not None and not isinstance(adapter, str):
          raise ConfigError(f"{path} line {number}: 'adapter' is "
                            f"{type(adapter).__name__}, expected an adapter's name")
        yield record["inputs"], adapter, number
      else:
        yield line, None, number
  finally:
    if stream is not sys.stdin:
      stream.close()


def infer(config: InferConfig) -> int:
  """Decodes every input; returns how many. Progress goes to stderr. Every process decodes;
  process 0 writes the output."""
  import jax

  from t5lite.models.decoding.search import generate
  from t5lite.interop.peft import adapter_batch
  from t5lite.runtime import partitioning as part
  if config.input_path == "-" and jax.process_count() > 1:
    # Each process would read its own stdin: different inputs, mismatched collectives.
    raise ConfigError("with several processes INFER_INPUT must be a file that every host sees, "
                      "not stdin")
  decode = config.decode
  primary = jax.process_index() == 0
  to_file = primary and config.output_path != "-"
  # The output is opened first: a bad INFER_OUTPUT used to fail after decoding everything.
  out = _open_output(config.output_path) if to_file else sys.stdout if primary else None
  try:
    records = list(_read_records(config.input_path))
    given = bool(config.adapter or config.adapters)
    _check_adapter_names(records, config.adapters, given, config.input_path)
    texts = [text for text, _, _ in records]
    vocab = _vocabulary(config)
    mesh, rules = part.make_mesh(part.MeshConfig()), part.logical_axis_rules()
    model_config, params, _, bank, default = adapter_batch.load_model(
        config.checkpoint_path, config.adapter, config.adapters, mesh, rules,
        per_row=any(a is not None for _, a, _ in records))
    run_dirs = bank.paths if bank is not None else {}  # a row's adapter: its RUN_DIR
    ends_with_eos = functools.cache(lambda run_dir: prompt_ends_with_eos(
        config, model_config, run_dir or config.checkpoint_path))
    with part.activate(mesh, rules), progress.Progress("infer", len(texts), "input",
                                                       enabled=primary) as bar:
      for start in range(0, len(texts), decode.batch_size):
        chunk = texts[start:start + decode.batch_size]
        names = [default if a is None else a
                 for _, a, _ in records[start:start + decode.batch_size]]
        if bank is not None:  # one adapter per row (padding rows: the base alone)
          ids = np.zeros(decode.batch_size, np.int32)
          ids[:len(names)] = bank.row_ids(names)
          params = bank.params_for(ids)
        rows = [prompt_row(vocab.encode(text), config.inputs_length,
                           vocab.eos_id if ends_with_eos(run_dirs.get(name)) else None)
                for text, name in zip(chunk, names)]
        inputs = pad_rows(rows, config.inputs_length, decode.batch_size)
        # Every process decodes (a collective over the mesh); generate returns host arrays.
        tokens = generate(model_config, params, inputs,
                          max_decode_length=(128 if decode.max_decode_length is None
                                             else decode.max_decode_length),
                          **decode.generate_kwargs())
        if out is not None:
          for text, name, row in zip(chunk, names, tokens):
            record = {"inputs": text, "prediction": vocab.decode(row.tolist())}
            if bank is not None:
              record["adapter"] = name
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
          out.flush()
        bar.update(len(chunk))
  except BaseException:
    if to_file:
      out.close()
      os.remove(out.name)  # nothing half written is left beside INFER_OUTPUT
    raise
  if to_file:
    out.close()
    if paths.is_url(config.output_path):  # one upload of the whole file: atomic on a bucket
      with open(out.name, "rb") as f:
        atomic.write_file(config.output_path, f.read())
      os.remove(out.name)
    else:
      os.replace(out.name, config.output_path)
  return len(texts)


def prompt_ends_with_eos(config: InferConfig, model_config, run_dir: str) -> bool:
  """InferConfig.prompt_eos, or (None) whether the model in run_dir was trained on inputs
  that end with EOS (see there)."""
  if config.prompt_eos is not None:
    return config.prompt_eos
  if not family_of(model_config).continues_prompts or model_config.prefix_lm:
    return True
  try:
    record = load_task_record(model_dir_of(run_dir))
  except ConfigFileNotFoundError:  # an HF directory: a causal LM as HF trains one
    return False
  return record is not None and "inputs" in record["task_feature_lengths"]


def prompt_row(ids: Sequence[int], length: int, eos_id: int | None) -> np.ndarray:
  """A prompt's ids cut to `length`, the last position kept for eos_id unless it is None."""
  ends = () if eos_id is None else (eos_id,)
  return np.append(np.asarray(ids[:length - len(ends)], np.int32), ends).astype(np.int32)


def _open_output(path: str):
  """The temporary file beside INFER_OUTPUT, opened for writing, or a ConfigError saying why
  it cannot be: a folder, a folder that does not exist, no permission, a read-only disk. For a
  bucket URL, a local temporary file (uploaded whole at the end)."""
  if paths.is_url(path):
    import tempfile
    return tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".jsonl", delete=False)
  if os.path.isdir(path):
    raise ConfigError(f"INFER_OUTPUT={path} is a folder: name a file, e.g. "
                      f"{os.path.join(path, 'predictions.jsonl')}")
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    raise ConfigError(f"INFER_OUTPUT={path}: its folder {folder} does not exist (or is not a "
                      "folder)")
  try:
    return open(path + ".tmp", "w", encoding="utf-8")
  except OSError as e:
    raise ConfigError(f"INFER_OUTPUT={path} cannot be written: {e.strerror or e} "
                      f"({e.filename or path + '.tmp'})") from None
