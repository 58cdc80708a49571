"""What a study is: arms, each pretrained (or not) and finetuned on the same downstream tasks,
at a scale, compared with the published figures of their paper; and the registry of presets.

A preset is one module in t5lite/study/presets/ that builds a `Study` and `register`s it
(importing t5lite.study registers them all).
Arms differ only in what their paper varies (objective, architecture, initialization); the
data, batch, schedule shape, downstream tasks and finetuning recipe are the study's, the same
for every arm: no arm is tuned alone.
"""
from __future__ import annotations

import dataclasses

from t5lite.errors import ConfigError
from t5lite.models import adapters

FINETUNE_RUN = "gin/runs/bert_finetune.gin"
SMOKE = "smoke"


@dataclasses.dataclass(frozen=True)
class Downstream:
  """A finetuning task and its figure (eval/TASK/METRIC): with num_labels, a
  sequence-classification head's; 0, a text-to-text task's, scored on decoded predictions."""
  task: str
  num_labels: int = 0
  metric: str = "accuracy"


BERT_SMALL = ("ModelConfig.num_encoder_layers=12", "ModelConfig.num_decoder_layers=12",
              "ModelConfig.d_model=256", "ModelConfig.num_heads=4", "ModelConfig.d_ff=1024")
"""BERT-Small as ELECTRA's paper sizes it (12 layers of 256, 4 heads, FF 1024): the `small`
scale of the presets on gin/models/bert/tiny.gin (num_decoder_layers: an arm that makes it a
causal decoder, bert_ablations' left-to-right LM)."""
DOWNSTREAM = (Downstream("stdlib_docstring_module_head", 8),  # 8-way classification
              Downstream("stdlib_sentence_pair_head", 2))     # does B follow A?
"""The embedded head tasks (tasks/embedded_heads.py): one sentence, and a sentence pair."""


@dataclasses.dataclass(frozen=True)
class Pretraining:
  """How an arm pretrains: its run file and bindings on the study's model file."""
  run_file: str
  bindings: tuple[str, ...] = ()
  finetune_from: str = ""
  """'' finetunes from the pretraining MODEL_DIR; 'hf:SUBDIR' from SUBDIR of its `t5lite
  export hf` (ELECTRA's pair: 'hf:discriminator')."""
  teacher: str = ""
  """An earlier arm whose pretrained MODEL_DIR (same seed) is this run's TEACHER macro (a
  distillation run file such as gin/runs/distilbert.gin)."""
  teacher_layers: str = ""
  """With a teacher: start from its layers (`t5lite export student --layers`, e.g. '0,2'),
  not from a random init."""


@dataclasses.dataclass(frozen=True)
class Finetuning:
  """How an arm finetunes when the method is what its study varies: 'full' (every param,
  the study's recipe) or a PEFT method of t5lite.models.adapters, whose adapter (and the new
  head, whole) trains on the frozen pretrained model, its step counter from 0."""
  method: str = "full"
  bindings: tuple[str, ...] = ()
  """The method's own settings from its paper (rank, soft tokens, its optimizer)."""

  def __post_init__(self):
    assert self.method == "full" or self.method in adapters.METHODS, self.method


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  label: str
  pretraining: Pretraining | None
  """None: finetuned from a random init, or from `pretrained_by`'s pretraining."""
  model_bindings: tuple[str, ...] = ()
  """Model changes the arm keeps through pretraining and finetuning (an activation, a norm)."""
  published: float | None = None
  """The paper's figure for this arm (Study.published_metric), None where it gives none."""
  pretrained_by: str = ""
  """An earlier arm whose pretrained model (same seed) this arm finetunes instead of
  pretraining its own: arms that differ only in how they finetune share one pretraining."""
  finetuning: Finetuning = Finetuning()


@dataclasses.dataclass(frozen=True)
class Scale:
  """A size of the whole study: the model file every arm starts from and the step counts."""
  model_file: str
  pretrain_steps: int
  """The reference arm's; the others get as many FLOPs (Study.equal_flops) or steps."""
  finetune_steps: int
  downstream: tuple[Downstream, ...] = DOWNSTREAM
  model_bindings: tuple[str, ...] = ()
  """The model's size at this scale (pretraining and finetuning)."""
  pretrain_bindings: tuple[str, ...] = ()
  """Pretraining only (its batch size, say)."""
  finetune_bindings: tuple[str, ...] = ()
  arm_bindings: tuple[tuple[str, tuple[str, ...]], ...] = ()
  """(arm name, bindings) for arms whose model depends on the scale (an arm of half the
  layers), after the arm's own model_bindings, in pretraining and finetuning."""

  def bindings_of(self, arm_name: str) -> tuple[str, ...]:
    return dict(self.arm_bindings).get(arm_name, ())


BERT_SMALL_SCALE = Scale("gin/models/bert/tiny.gin", pretrain_steps=20_000, finetune_steps=1_000,
                         model_bindings=BERT_SMALL, pretrain_bindings=("BATCH_SIZE=128",))
"""The `small` scale of the presets on gin/models/bert/tiny.gin: BERT-Small, batch 128."""


@dataclasses.dataclass(frozen=True)
class Study:
  name: str
  title: str
  paper: str
  """The source of the published figures, e.g. 'Clark et al. 2020, Table 1 (GLUE dev)'."""
  published_metric: str
  arms: tuple[Arm, ...]
  orderings: tuple[tuple[str, str], ...]
  """(better, worse) arm names: the paper's orderings, each checked on the mean score."""
  scales: dict[str, Scale]
  equal_flops: bool = True
  """Pretrain every arm for the reference arm's FLOPs (Family.flops_per_example, both
  networks of a pair); else for the same steps."""
  finetune_bindings: tuple[str, ...] = ()
  """Bindings of every finetuning run (e.g. a pair's model file read as one encoder)."""
  finetune_run: str = FINETUNE_RUN
  """The finetuning recipe of every arm (a head's; gin/runs/demo_finetune.gin for
  text-to-text downstream tasks)."""
  scored_by_pretraining: bool = False
  """Score each arm by its pretraining quality, minus its eval loss (the negative log
  perplexity of the targets, higher is better; Switch's Table 1), with no finetuning: for arms
  that share one pretraining objective and task."""
  note: str = ""
  """What to know when reading the table (written under it)."""

  def __post_init__(self):
    names = [arm.name for arm in self.arms]
    assert len(set(names)) == len(names), names
    for i, arm in enumerate(self.arms):  # a teacher runs first, in the same seed
      assert not arm.pretraining or not arm.pretraining.teacher or (
          arm.pretraining.teacher in names[:i]), arm.name
      assert not arm.pretrained_by or (  # and so does the arm whose pretraining is shared
          not arm.pretraining and arm.pretrained_by in names[:i]
          and self.arm(arm.pretrained_by).pretraining), arm.name
      assert arm.finetuning.method == "full" or arm.pretraining or arm.pretrained_by, (
          f"{arm.name}: a PEFT arm needs a pretrained model to adapt")
    for pair in self.orderings:
      assert set(pair) <= set(names), pair
    for scale in self.scales.values():
      assert {name for name, _ in scale.arm_bindings} <= set(names), scale.arm_bindings
    assert not self.scored_by_pretraining or all(arm.pretraining for arm in self.arms), (
        "every arm of a study scored by pretraining pretrains its own model")

  def arm(self, name: str) -> Arm:
    return next(arm for arm in self.arms if arm.name == name)

  def only(self, names: tuple[str, ...]) -> "Study":
    """This study with the named arms and those they need (a teacher, the arm whose
    pretraining they share), in the study's order; its orderings those between them. Plan
    its pretraining on the whole study (the budget is the reference arm's, chosen or not)."""
    known = [arm.name for arm in self.arms]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
      raise ConfigError(f"study {self.name!r} has no arm {', '.join(unknown) or '(none named)'}"
                        f": choose among {', '.join(known)}")
    chosen = set(names)
    for arm in reversed(self.arms):  # a needed arm comes earlier than the arm needing it
      if arm.name in chosen:
        chosen.update(a for a in (arm.pretrained_by,
                                  arm.pretraining.teacher if arm.pretraining else "") if a)
    return dataclasses.replace(
        self, arms=tuple(arm for arm in self.arms if arm.name in chosen),
        orderings=tuple(pair for pair in self.orderings if set(pair) <= chosen),
        scales={name: dataclasses.replace(scale, arm_bindings=tuple(
            (arm, bindings) for arm, bindings in scale.arm_bindings if arm in chosen))
                for name, scale in self.scales.items()})

  @property
  def reference(self) -> Arm:
    """The arm whose pretraining sets the budget: the first that pretrains."""
    return next(arm for arm in self.arms if arm.pretraining)

  def scale(self, name: str) -> Scale:
    """One of self.scales, or 'smoke': tiny's models for a few steps, one downstream task,
    16 examples decoded for its metric (seconds a run: a check of the plumbing, not a
    result)."""
    if name == SMOKE and SMOKE not in self.scales:
      tiny = self.scales["tiny"]
      return dataclasses.replace(
          tiny, pretrain_steps=6, finetune_steps=4,
          downstream=() if self.scored_by_pretraining else tiny.downstream[:1],
          finetune_bindings=(*tiny.finetune_bindings, "TrainConfig.infer_eval_examples=16"))
    if name not in self.scales:
      raise ConfigError(f"study {self.name!r} has no scale {name!r}: choose one of "
                        f"{', '.join([*self.scales, SMOKE])}")
    return self.scales[name]


_STUDIES: dict[str, Study] = {}


def register(study: Study) -> Study:
  assert study.name not in _STUDIES, study.name
  _STUDIES[study.name] = study
  return study


def names() -> list[str]:
  return sorted(_STUDIES)


def get(name: str) -> Study:
  if name not in _STUDIES:
    raise ConfigError(f"no study {name!r}: choose one of {', '.join(sorted(_STUDIES))} "
                      "(`t5lite study list`)")
  return _STUDIES[name]
