"""A distillation student made from its teacher's layers (DistilBERT's initialization).

    t5lite export student --checkpoint TEACHER --out STUDENT_DIR --layers 0,2,4,7,9,11

TEACHER is a t5lite MODEL_DIR (its newest step) or an HF model directory; STUDENT_DIR is a
params-only MODEL_DIR (step 0) with the teacher's vocabulary, ready to train as the model of a
distillation run (INITIAL_CHECKPOINT_PATH = STUDENT_DIR, TrainConfig.distillation's teacher =
TEACHER). The student keeps the teacher's width, embeddings and output head; its layer i is
the teacher's layer layers[i] (DistilBERT keeps 0, 2, 4, 7, 9, 11 of BERT-base's 12). As
DistilBERT, it drops the token-type embeddings and the pooler (and the next-sentence head on
it) unless asked to keep them: keep the token types to export the student as HF 'bert'.

Encoder-only and decoder-only models (DistilGPT-2 was made alike); unshared layers.
"""
from __future__ import annotations

from typing import Sequence

from t5lite.errors import ConfigError
from t5lite.models.config import ModelConfig
from t5lite.models.params import Params, abstract_params, scan_params, unscan_params

DISTILBERT_LAYERS = (0, 2, 4, 7, 9, 11)


def student_from_teacher(config: ModelConfig, params: Params, layers: Sequence[int], *,
                         keep_token_types: bool = False, keep_pooler: bool = False
                         ) -> tuple[ModelConfig, Params]:
  """(student config, student params): the teacher's `layers` (increasing indices), its
  embeddings and head; copies of the teacher's arrays, nothing re-initialized."""
  if config.architecture == "encoder_decoder":
    raise ConfigError("a student from teacher layers is made of one stack (encoder-only or "
                      "decoder-only models); this teacher is an encoder-decoder")
  if config.shared_layer_groups:
    raise ConfigError("this teacher shares its layers (shared_layer_groups): there are no "
                      "separate layers to pick")
  if config.electra and config.electra.pretrains_pair:
    raise ConfigError("this teacher is an ELECTRA pair (generator and discriminator): export "
                      "it to HF (`t5lite export hf`) and make the student from one network")
  if config.head in ("sequence_classification", "multiple_choice") and config.pooler and (
      not keep_pooler):
    raise ConfigError(f"the teacher's {config.head!r} head reads its pooler: pass "
                      "--keep_pooler (keep_pooler=True) so that the student keeps it too")
  stack = "encoder" if config.architecture == "encoder_only" else "decoder"
  field = "num_encoder_layers" if stack == "encoder" else "num_decoder_layers"
  count = getattr(config, field)
  layers = [int(i) for i in layers]
  if not layers or sorted(set(layers)) != layers or not 0 <= layers[0] <= layers[-1] < count:
    raise ConfigError(f"--layers {','.join(map(str, layers))}: give increasing teacher layer "
                      f"indices from 0 to {count - 1} (DistilBERT: 0,2,4,7,9,11 of 12)")
  changes = {field: len(layers), "scan_layers": False}
  if stack == "encoder" and not keep_token_types:
    changes["type_vocab_size"] = 0
  if stack == "encoder" and not keep_pooler:
    changes.update(pooler=False, sentence_classes=0)
  student = config.replace(**changes)
  teacher = unscan_params(params)
  new_stack = {k: v for k, v in teacher[stack].items() if not k.startswith("layers_")}
  if "token_type_embedder" in new_stack and not student.type_vocab_size:
    del new_stack["token_type_embedder"]
  new_stack.update({f"layers_{i}": teacher[stack][f"layers_{j}"] for i, j in enumerate(layers)})
  out = {k: v for k, v in teacher.items()
         if k != stack and (student.pooler or k not in ("pooler", "sentence_classifier"))}
  out[stack] = new_stack
  _check_shapes(student, out)
  if config.scan_layers:
    student = student.replace(scan_layers=True)
    out = scan_params(out, student)
  return student, out


def _check_shapes(config: ModelConfig, params: Params) -> None:
  """The student tree is exactly what its config builds (a bug otherwise: keep the trace)."""
  from flax import traverse_util
  want = {k: v.shape for k, v in traverse_util.flatten_dict(abstract_params(config)).items()}
  got = {k: tuple(v.shape) for k, v in traverse_util.flatten_dict(params).items()}
  assert want == got, sorted(set(want.items()) ^ set(got.items()))


def parse_layers(text: str) -> list[int]:
  try:
    return [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ConfigError(f"--layers {text!r}: a comma-separated list of layer indices, e.g. "
                      "0,2,4,7,9,11") from None
