"""Knowledge distillation: a student trains against a frozen teacher beside it.

    TrainConfig.distillation = @DistillationConfig()
    DistillationConfig.teacher = '/runs/bert_base'      # a t5lite MODEL_DIR or an HF directory
    DistillationConfig.soft_weight = 5.0                  # DistilBERT's recipe (DISTILBERT)
    DistillationConfig.hard_weight = 2.0
    DistillationConfig.cosine_weight = 1.0
    DistillationConfig.temperature = 2.0

The student is the run's model (MODEL_CONFIG), of any family; the run's MODEL_DIR is a plain
student MODEL_DIR (eval, infer and export read it as any other). The teacher is loaded by the
distillation recipe (t5lite.train.recipes.teacher), sharded by the same rules as the student,
optionally cast to bfloat16, and passed to the step beside the train state (loss_fn's
fixed_params): no gradient, no optimizer state, never checkpointed or donated, so its params
are bitwise the same after training. MODEL_DIR/distillation.json records the teacher (path,
config, a fingerprint of its params); a resumed run with another teacher is refused.

The loss, each term a mean over its positions (distillation_losses), weighted:

    hard_weight      x the student family's own loss (MLM, LM, a head's)
  + soft_weight      x T^2 KL(softmax(teacher / T) || softmax(student / T)) over the output
                       classes (vocabulary or labels), at every real position (or only those
                       the hard loss scores: restrict_soft_to_targets)
  + cosine_weight    x (1 - cos) between the last layers' hidden states (DistilBERT; equal widths)
  + hidden_weight    x sum over student layers m of MSE(H_S^m W + b, H_T^g(m)) (TinyBERT)
  + attention_weight x sum over m of MSE of the pre-softmax attention scores (equal heads)
  + embedding_weight x MSE(E_S W + b, E_T) of the embedding layers' outputs

W (d_student x d_teacher, TinyBERT's fit_dense, one for every layer) is trained with the
student, in params['distillation'], only when a hidden or embedding term is on and the widths
differ; exports and `load_params` leave it out. g(m) = m N / M. The intermediate terms read
one stack: encoder-only or decoder-only models (unshared layers); an encoder-decoder distils
through its outputs (soft, hard) or sequence-level (t5lite.train.recipes.sequence_distillation).

The hard loss is computed from the same student pass: a head's loss or the token cross entropy
of its targets (a student's NSP / SOP or SpanBERT heads are not part of it).

Deviations: TinyBERT's attention MSE averages over the (query, key) pairs attention does not
mask (its code zeroes masked keys, keeps padded queries); its hidden and embedding MSEs over
real tokens (its code's mean takes padding too); the per-layer MSEs are summed, as TinyBERT's
code sums them. A term whose weight is 0 is not computed.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5lite.errors import ConfigError
from t5lite.families import distillation_losses as dl
from t5lite.families import heads
from t5lite.families.base import Family, token_loss_sums
from t5lite.families.registry import family_of
from t5lite.models.attention import INTERMEDIATES, MASK_VALUE
from t5lite.models.config import ModelConfig
from t5lite.models.moe.layer import ROUTER

Tree = Any
PROJECTION = "distillation"
"""The params key of the trained W (TinyBERT's fit_dense): not part of the student (and what
t5lite.runtime.model_dir.load_params leaves out: its DISTILLATION_PARAMS)."""

DISTILBERT = dict(temperature=2.0, soft_weight=5.0, hard_weight=2.0, cosine_weight=1.0)
"""DistilBERT's published recipe (HF's distillation example's command for it)."""
TINYBERT_GENERAL = dict(soft_weight=0.0, hidden_weight=1.0, attention_weight=1.0,
                        embedding_weight=1.0)
"""TinyBERT's first stage (general, and task-specific intermediate-layer distillation)."""
TINYBERT_PREDICTION = dict(soft_weight=1.0, temperature=1.0)
"""TinyBERT's prediction-layer stage (task-specific, after the intermediate one)."""
WEIGHTS = ("soft_weight", "hard_weight", "cosine_weight", "hidden_weight", "attention_weight",
           "embedding_weight")


@dataclasses.dataclass(frozen=True)
class DistillationConfig:
  """A distillation run's teacher and loss weights (module docstring); gin binds it as
  TrainConfig.distillation = @DistillationConfig()."""

  teacher: str = ""
  """The teacher: a t5lite MODEL_DIR (its newest checkpoint) or an HF model directory."""
  teacher_dtype: str = ""
  """'bfloat16' runs and stores the teacher in bf16 (half its memory); '' keeps its own."""
  temperature: float = 2.0
  soft_weight: float = 1.0
  hard_weight: float = 0.0
  cosine_weight: float = 0.0
  hidden_weight: float = 0.0
  attention_weight: float = 0.0
  embedding_weight: float = 0.0
  restrict_soft_to_targets: bool = False
  """The soft loss only where the hard loss scores (an MLM's masked tokens); else at every
  real position, as DistilBERT (restrict_ce_to_mask=False)."""

  def __post_init__(self):
    if not self.teacher:
      raise ConfigError("DistillationConfig.teacher is not set: name the teacher's MODEL_DIR "
                        "or HF directory (with gin/runs/distilbert.gin or tinybert.gin: "
                        "--gin.TEACHER=\"'DIR'\")")
    if self.teacher_dtype not in ("", "float32", "bfloat16"):
      raise ConfigError(f"DistillationConfig.teacher_dtype={self.teacher_dtype!r} is not one of "
                        "'', 'float32', 'bfloat16'")
    if not (math.isfinite(self.temperature) and self.temperature > 0):
      raise ConfigError(f"DistillationConfig.temperature must be > 0, got {self.temperature}")
    for name in WEIGHTS:
      value = getattr(self, name)
      if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"DistillationConfig.{name} must be >= 0, got {value}")
    if not any(getattr(self, name) for name in WEIGHTS):
      raise ConfigError(f"DistillationConfig: every weight is 0 ({', '.join(WEIGHTS)}); set one")

  @property
  def intermediate(self) -> bool:
    """Any term that reads hidden states or attention scores."""
    return bool(self.cosine_weight or self.hidden_weight or self.attention_weight
                or self.embedding_weight)


# --- the recipe ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Distillation(Family):
  """The student's family with the teacher's loss terms; see the module docstring."""

  student: Family | None = None
  teacher: Family | None = None
  options: DistillationConfig | None = None
  name: ClassVar[str] = "distillation"

  @classmethod
  def wrap(cls, student: Family, options: DistillationConfig,
           teacher_config: ModelConfig) -> "Distillation":
    """The family around a student family and a teacher of that config (the distillation
    recipe reads it: t5lite.train.recipes.teacher); checks that the teacher fits the student."""
    teacher = family_of(teacher_config)
    s, t = student.config, teacher.config
    if s.vocab_size != t.vocab_size:
      raise ConfigError(f"the teacher's vocab_size={t.vocab_size} differs from the student's "
                        f"vocab_size={s.vocab_size}: distillation compares their outputs token "
                        "by token, so both need the task's vocabulary")
    if (s.architecture, s.head, s.num_labels) != (t.architecture, t.head, t.num_labels):
      raise ConfigError(f"the teacher ({t.architecture}, head={t.head!r}, num_labels="
                        f"{t.num_labels}) and the student ({s.architecture}, head={s.head!r}, "
                        f"num_labels={s.num_labels}) predict different things")
    for config, who in ((s, "student"), (t, "teacher")):
      if config.electra:
        raise ConfigError(f"the {who} is an ELECTRA discriminator (ModelConfig.electra): "
                          "distillation compares MLM, LM or classifier outputs; distil its "
                          "exported generator, or a finetuned discriminator with a head")
      if config.lm_loss_weight:
        raise ConfigError(f"the {who} has GPT-1's auxiliary LM loss (lm_loss_weight="
                          f"{config.lm_loss_weight}): set it to 0 to distil the classifier")
    if s.head and options.restrict_soft_to_targets:
      raise ConfigError("DistillationConfig.restrict_soft_to_targets picks token positions; a "
                        f"{s.head!r} head's soft loss is over its rows: set it to False")
    if s.head == "question_answering" or (s.head and s.loss_problem_type != (
        "single_label_classification")):
      raise ConfigError(f"distillation softens a softmax over classes; head={s.head!r} with "
                        f"problem_type={s.loss_problem_type!r} has none to soften")
    if options.intermediate:
      _check_intermediate(s, t, options)
    return cls(student.config, student.loss, student=student, teacher=teacher, options=options)

  # The student's: data, network, decoding, export.
  target_features = property(lambda self: self.student.target_features)
  token_features = property(lambda self: self.student.token_features)
  decodes = property(lambda self: self.student.decodes)
  continues_prompts = property(lambda self: self.student.continues_prompts)
  hf_model_type = property(lambda self: self.student.hf_model_type)

  def converter(self, pack=True):
    return self.student.converter(pack)

  def pretraining_preprocessors(self, vocabulary):
    return self.student.pretraining_preprocessors(vocabulary)

  def make_model(self, **kwargs):
    return self.student.make_model(**kwargs)

  def dummy_inputs(self):
    return self.student.dummy_inputs()

  def model_inputs(self, batch):
    return self.student.model_inputs(batch)

  @property
  def projects(self) -> bool:
    """Whether a trained W maps the student's width to the teacher's."""
    o = self.options
    return bool(o.hidden_weight or o.embedding_weight) and (
        self.config.d_model != self.teacher.config.d_model)

  def _boxed_params(self, rng):
    params = self.student._boxed_params(rng)
    if not self.projects:
      return params
    ds, dt = self.config.d_model, self.teacher.config.d_model
    fit = nn.Dense(dt, kernel_init=nn.with_logical_partitioning(
        nn.initializers.normal(0.02), (None, None)), bias_init=nn.with_logical_partitioning(
            nn.initializers.zeros, (None,)), param_dtype=self.config.storage_dtype)
    boxed = fit.init(jax.random.fold_in(rng, 1), jnp.zeros((1, ds)))["params"]
    return {**params, PROJECTION: {"fit_dense": boxed}}

  def trainable_mask(self, params):
    """The student's own mask; the trained projection always trains."""
    mask = self.student.trainable_mask(student_params(params))
    if PROJECTION in params:
      mask = {**mask, PROJECTION: jax.tree.map(lambda _: True, params[PROJECTION])}
    return mask

  def networks(self, params):
    return self.student.networks(student_params(params))

  def logits(self, params, batch, rng=None):
    return self.student.logits(student_params(params), batch, rng)

  def generate(self, params, inputs, **settings):
    return self.student.generate(student_params(params), inputs, **settings)

  def score(self, params, inputs, targets):
    return self.student.score(student_params(params), inputs, targets)

  def tokens_per_example(self, lengths):
    return self.student.tokens_per_example(lengths)

  def flops_per_example(self, lengths):
    """The student's training FLOPs plus the teacher's forward pass (a third of its own)."""
    return (self.student.flops_per_example(lengths)
            + self.teacher.flops_per_example(lengths) / 3)

  # --- the teacher and the loss --------------------------------------------------------------

  def loss_fn(self, params, batch, rng, fixed_params=None):
    """(weighted loss sum, sums): the hard loss's sums (its normalizer) plus each term's mean
    times that normalizer, so that the step's division leaves the weighted means."""
    if fixed_params is None:
      raise ValueError("a distillation loss needs the teacher's params (fixed_params): the "
                       "trainer passes them; so must a caller of loss_fn")
    o = self.options
    student = student_params(params)
    # One pass of each network: the student's logits give the hard and the soft loss.
    s_logits, s_states, s_routed = _run(self.student, student, batch, rng, o.intermediate)
    t_logits, t_states, _ = jax.lax.stop_gradient(
        _run(self.teacher, fixed_params, batch, None, o.intermediate))
    hard_sum, sums = self._hard_loss(s_logits, batch)
    terms = {}
    if o.soft_weight:
      terms["soft"] = dl.soft_cross_entropy(s_logits, t_logits, self._positions(batch, s_logits),
                                            o.temperature)
    if o.intermediate:
      terms.update(self._intermediate_terms(params, s_states, t_states, batch))
    loss_sum = o.hard_weight * hard_sum
    normalizer = sums["normalizer"]
    for name, (total, count) in terms.items():
      weight = getattr(o, f"{name}_weight")
      loss_sum = loss_sum + weight * normalizer * total / jnp.maximum(count, 1.0)
      sums = dict(sums, **{f"distill_{name}": total, f"distill_{name}_count": count})
    # A Mixture-of-Experts student trains its routers too (the teacher's are frozen).
    return self.student.with_router_losses(loss_sum, dict(sums, distill_hard=hard_sum),
                                           s_routed)

  def _hard_loss(self, logits, batch):
    """The student's own loss from its logits: a head's (t5lite.families.heads), else the
    token cross entropy on its targets (an MLM's masked tokens, an LM's, T5's targets). The
    hard loss leaves out a student's auxiliary pretraining heads (NSP / SOP, SpanBERT's)."""
    if self.config.head:
      return heads.loss_sums(self.config, logits, batch)
    target_key, weight_key, segment_key = self.student.target_features
    return token_loss_sums(logits, batch[target_key], batch.get(weight_key),
                           batch.get(segment_key), self.loss)

  def _positions(self, batch, logits):
    """Where the soft loss applies: (B, ...) like logits without their class axis."""
    _, weight_key, segment_key = self.student.target_features
    if logits.ndim == 2:  # a sequence classifier: its real rows
      prefix = "decoder" if self.config.architecture == "decoder_only" else "encoder"
      return heads.row_weights(batch, prefix) > 0
    if self.options.restrict_soft_to_targets:
      return batch[weight_key] > 0
    if segment_key in batch:
      return batch[segment_key] > 0
    stack = "encoder" if segment_key.startswith("encoder") else "decoder"
    return batch[f"{stack}_input_tokens"] > 0  # no segment ids: padding is token 0

  def _intermediate_terms(self, params, s_states, t_states, batch):
    o, s_config = self.options, self.config
    stack = "encoder" if s_config.architecture == "encoder_only" else "decoder"
    key = "encoder_segment_ids" if stack == "encoder" else "decoder_segment_ids"
    inputs = "encoder_input_tokens" if stack == "encoder" else "decoder_input_tokens"
    real = batch[key] > 0 if key in batch else batch[inputs] > 0  # (B, L)
    fit = (lambda x: x) if not self.projects else functools.partial(
        _fit, params[PROJECTION]["fit_dense"])
    student_layers = layers_of(s_states[stack], s_config, "hidden_states")
    teacher_layers = layers_of(t_states[stack], self.teacher.config, "hidden_states")
    mapping = dl.layer_map(len(student_layers), len(teacher_layers))
    terms = {}
    if o.cosine_weight:
      terms["cosine"] = dl.cosine_distance(student_layers[-1], teacher_layers[-1], real)
    if o.hidden_weight:
      total = count = 0.0
      for m, g in enumerate(mapping):
        t_total, t_count = dl.squared_error(fit(student_layers[m]), teacher_layers[g - 1], real)
        # Summed over layers: each layer's MSE has the same count.
        total, count = total + t_total, t_count * self.teacher.config.d_model
      terms["hidden"] = (total, count)
    if o.embedding_weight:
      e_total, e_count = dl.squared_error(
          fit(s_states[stack]["embedding_output"][0]),
          t_states[stack]["embedding_output"][0], real)
      terms["embedding"] = (e_total, e_count * self.teacher.config.d_model)
    if o.attention_weight:
      s_scores = layers_of(s_states[stack], s_config, "attention_scores")
      t_scores = layers_of(t_states[stack], self.teacher.config, "attention_scores")
      total = count = 0.0
      for m, g in enumerate(mapping):
        # The (query, key) pairs attention masks (padding, other packed segments, the
        # future in a decoder) hold the mask's large negative value in both networks:
        # compared and counted only where the scores are real.
        pairs = s_scores[m] > MASK_VALUE / 2  # (B, H, Q, K), the same in the teacher
        s, t = (jnp.where(pairs, x, 0.0)[..., None] for x in (s_scores[m], t_scores[g - 1]))
        a_total, a_count = dl.squared_error(s, t, pairs)
        total, count = total + a_total, a_count
      terms["attention"] = (total, count)
    return terms

  def metrics(self, sums, normalizer):
    out = self.student.metrics(sums, normalizer)
    out["distill_hard_loss"] = sums["distill_hard"] / normalizer
    for name in ("soft", "cosine", "hidden", "embedding", "attention"):
      if f"distill_{name}" in sums:
        out[f"distill_{name}_loss"] = (sums[f"distill_{name}"]
                                       / jnp.maximum(sums[f"distill_{name}_count"], 1.0))
    return out


def student_params(params: Tree) -> Tree:
  """A distillation run's params without the trained projection: the student's own."""
  return {k: v for k, v in params.items() if k != PROJECTION}


def _fit(fit_params, x):
  return x @ fit_params["kernel"].astype(x.dtype) + fit_params["bias"].astype(x.dtype)


def _run(family: Family, params, batch, rng, intermediates: bool):
  """(outputs, sown intermediates or {}, router sows or None) of a family's network on a
  batch; rng None: no dropout. The hidden states and attention scores are kept only when
  asked for; a Mixture-of-Experts network's routing always (its router losses)."""
  config = family.config
  dropout = rng is not None and (config.uses_dropout or bool(config.moe))  # MoE: jitter
  model = family.make_model(enable_dropout=dropout)
  rngs = {"dropout": rng} if dropout else None
  inputs = family.model_inputs(batch)
  mutable = [INTERMEDIATES] * intermediates + [ROUTER] * bool(config.moe)
  if mutable:
    out, state = model.apply({"params": params}, **inputs, rngs=rngs, mutable=mutable)
  else:
    out, state = model.apply({"params": params}, **inputs, rngs=rngs), {}
  out = out[0] if isinstance(out, tuple) else out  # GPT-1's (classes, LM logits)
  return out, state.get(INTERMEDIATES, {}), (state.get(ROUTER, {}) if config.moe else None)


def layers_of(stack: Tree, config: ModelConfig, name: str) -> list[jax.Array]:
  """A stack's sown per-layer values in layer order: 'hidden_states' (B, L, D) or
  'attention_scores' (B, H, Q, K), unscanned (layers_i) or scanned (stacked)."""
  def value(layer):
    return layer["attention"][name][0] if name == "attention_scores" else layer[name][0]
  if "layers" in stack:  # scanned: stacked on a leading axis
    stacked = value(stack["layers"])
    return [stacked[i] for i in range(stacked.shape[0])]
  count = sum(1 for key in stack if key.startswith("layers_"))
  return [value(stack[f"layers_{i}"]) for i in range(count)]


def _check_intermediate(s: ModelConfig, t: ModelConfig, options: DistillationConfig) -> None:
  if s.architecture == "encoder_decoder":
    raise ConfigError("the hidden-state, attention, embedding and cosine terms read one stack "
                      "(encoder-only or decoder-only models); distil an encoder-decoder through "
                      "its outputs (soft_weight, hard_weight) or sequence-level")
  for config, who in ((s, "student"), (t, "teacher")):
    if config.shared_layer_groups:
      raise ConfigError(f"the {who} shares its layers (shared_layer_groups): the layer-by-layer "
                        "terms need one set of params per layer")
  if options.cosine_weight and s.d_model != t.d_model:
    raise ConfigError(f"the cosine term compares hidden states of equal width: the student's "
                      f"d_model={s.d_model}, the teacher's {t.d_model} (DistilBERT keeps the "
                      "teacher's width); use hidden_weight, which projects, instead")
  if options.attention_weight and s.num_heads != t.num_heads:
    raise ConfigError(f"the attention term compares heads one to one: the student has "
                      f"num_heads={s.num_heads}, the teacher {t.num_heads} (TinyBERT keeps the "
                      "teacher's head count)")
  layers = s.num_encoder_layers if s.architecture == "encoder_only" else s.num_decoder_layers
  teacher_layers = t.num_encoder_layers if t.architecture == "encoder_only" else t.num_decoder_layers
  if layers > teacher_layers:
    raise ConfigError(f"the student has {layers} layers, the teacher {teacher_layers}: a "
                      "student learns layer by layer from a teacher at least as deep")
