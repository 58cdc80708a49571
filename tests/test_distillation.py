"""Distillation (t5lite.families.distillation): each loss term against a plain numpy
re-derivation, the whole loss of BERT-like teacher and student against one computed from
HF transformers' outputs (logits, hidden states, and attention scores rebuilt from HF's
weights), one DistilBERT step's loss and gradients against PyTorch on HF's modules, logit distillation of decoder-only and encoder-decoder models, a run through the
trainer that leaves the teacher bitwise unchanged and records it, the student made of
teacher layers (`t5lite export student`), and bad input."""
import hashlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import t5lite
import train_tasks  # noqa: F401 (registers train_test_mlm)
from helpers import quiet, tiny, tiny_decoder_only, tiny_encoder_only, train_config
from helpers.distill import log_softmax, wrap, write_teacher
from helpers.hf_models import assert_gradients_match
from t5lite import cli
from t5lite.errors import ConfigError
from t5lite.families import distillation_losses as dl
from t5lite.families import family_of
from t5lite.families.distillation import (DISTILBERT, PROJECTION, TINYBERT_GENERAL,
                                          Distillation, DistillationConfig)
from t5lite.train.recipes import teacher as teacher_lib
from t5lite.models.config import ModelConfig
from t5lite.runtime import model_dir as model_dir_lib
from t5lite.runtime.partitioning import MeshConfig, logical_axis_rules, make_mesh
from t5lite.train.optimizers import OptimizerConfig
from t5lite.train.schedules import ScheduleConfig
from t5lite.train.trainer import train

RNG = np.random.RandomState(0)


# --- the loss terms ----------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 2.0, 3.5])
def test_soft_cross_entropy_is_t2_times_kl(temperature):
  s, t = RNG.randn(3, 5, 7) * 3, RNG.randn(3, 5, 7) * 3
  mask = RNG.rand(3, 5) < 0.6
  total, count = dl.soft_cross_entropy(s, t, mask, temperature)
  p_t = np.exp(log_softmax(t / temperature))
  kl = (p_t * (log_softmax(t / temperature) - log_softmax(s / temperature))).sum(-1)
  assert float(count) == mask.sum()
  assert float(total) == pytest.approx(temperature ** 2 * kl[mask].sum(), rel=1e-5)


def test_cosine_distance_and_squared_error():
  s, t = RNG.randn(2, 6, 9), RNG.randn(2, 6, 9)
  mask = RNG.rand(2, 6) < 0.7
  total, count = dl.cosine_distance(s, t, mask)
  cos = (s * t).sum(-1) / np.linalg.norm(s, axis=-1) / np.linalg.norm(t, axis=-1)
  assert float(total) == pytest.approx((1 - cos)[mask].sum(), rel=1e-5)
  total, count = dl.squared_error(s, t, mask)
  assert float(total) == pytest.approx(((s - t) ** 2).sum(-1)[mask].sum(), rel=1e-5)
  assert float(count) == mask.sum()


def test_layer_map_is_tinyberts_uniform_one():
  assert dl.layer_map(4, 12) == [3, 6, 9, 12]
  assert dl.layer_map(3, 4) == [1, 2, 4]
  assert dl.layer_map(2, 2) == [1, 2]
  with pytest.raises(ValueError, match="1 to 2 layers"):
    dl.layer_map(3, 2)


# --- the whole loss against HF's outputs -------------------------------------------------------

def bert(layers, d, heads=4, **changes):
  """A tiny BERT (HF BertForMaskedLM's layout) over 61 ids."""
  return ModelConfig(**{**dict(
      architecture="encoder_only", family="bert", vocab_size=61, d_model=d, d_ff=2 * d,
      num_heads=heads, d_kv=d // heads, num_encoder_layers=layers, mlp_activation="gelu_exact",
      norm="layer", norm_position="post", layer_norm_epsilon=1e-12, use_bias=True,
      scale_attention=True, position_encoding="learned", max_position_embeddings=32,
      type_vocab_size=2, embedding_norm=True, tie_output_embedding=True, init_std=0.05),
      **changes})


def mlm_batch(rows=3, length=14, seed=1):
  rng = np.random.RandomState(seed)
  tokens = rng.randint(5, 61, (rows, length))
  segments = np.ones((rows, length), np.int32)
  segments[-1, length - 5:] = 0
  tokens = tokens * segments
  weights = (rng.rand(rows, length) < 0.3).astype(np.float32) * segments
  weights[0, 1] = 1
  return dict(encoder_input_tokens=np.where(weights > 0, 4, tokens).astype(np.int32),
              mlm_target_tokens=tokens.astype(np.int32), mlm_loss_weights=weights,
              encoder_segment_ids=segments)


def hf_view(config, params, tmp_path, name):
  """(logits, hidden states, attention scores per layer) of the HF export of a BERT: the
  scores rebuilt in numpy from HF's query/key weights and each layer's input."""
  t5lite.save_hf(config, params, str(tmp_path / name))
  model = transformers.BertForMaskedLM.from_pretrained(str(tmp_path / name)).eval()

  def run(tokens, segments):
    with torch.no_grad():
      out = model(torch.tensor(tokens), attention_mask=torch.tensor(segments),
                  output_hidden_states=True)
    hidden = [h.numpy().astype(np.float64) for h in out.hidden_states]
    scores = []
    for layer, x in zip(model.bert.encoder.layer, hidden[:-1]):
      attention = layer.attention.self
      q, k = (x @ m.weight.detach().numpy().T.astype(np.float64) + m.bias.detach().numpy()
              for m in (attention.query, attention.key))
      b, length, heads = x.shape[0], x.shape[1], config.num_heads
      q, k = (a.reshape(b, length, heads, config.d_kv) for a in (q, k))
      scores.append(np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(config.d_kv))
    return out.logits.numpy().astype(np.float64), hidden, scores
  return run


@pytest.mark.parity
@pytest.mark.parametrize("student_width", [24, 32])
def test_the_whole_loss_equals_one_rederived_from_hf_outputs(student_width, tmp_path):
  """Hard MLM loss, soft loss at T=2 over every real token, hidden / embedding MSE through the
  trained projection (width 24 -> 32) or none (32), attention-score MSE over real (query,
  key) pairs with layers mapped 4 -> 2 (g = 2, 4), and cosine (equal widths only)."""
  teacher_config = bert(4, 32)
  teacher_params = write_teacher(tmp_path / "teacher", teacher_config)
  student_config = bert(2, student_width, d_kv=student_width // 4)
  weights = dict(temperature=2.0, soft_weight=5.0, hard_weight=2.0, hidden_weight=1.5,
                 embedding_weight=0.5, attention_weight=0.25,
                 cosine_weight=1.0 if student_width == 32 else 0.0)
  family = wrap(student_config, DistillationConfig(teacher=str(tmp_path / "teacher"), **weights))
  params = jax.device_get(family.init_params(3))
  assert (PROJECTION in params) == (student_width != 32)
  batch = mlm_batch()
  loss_sum, sums = jax.jit(lambda p, b, t: family.loss_fn(p, b, None, fixed_params=t))(
      params, batch, teacher_params)
  metrics = {k: float(v) for k, v in family.metrics(sums, sums["normalizer"]).items()}

  tokens, segments = batch["encoder_input_tokens"], batch["encoder_segment_ids"]
  s_logits, s_hidden, s_scores = hf_view(student_config, params if PROJECTION not in params
                                         else {k: v for k, v in params.items()
                                               if k != PROJECTION}, tmp_path, "s")(tokens, segments)
  t_logits, t_hidden, t_scores = hf_view(teacher_config, teacher_params, tmp_path, "t")(
      tokens, segments)
  real = segments > 0
  w, targets = batch["mlm_loss_weights"], batch["mlm_target_tokens"]
  hard = -(np.take_along_axis(log_softmax(s_logits), targets[..., None], -1)[..., 0] * w
           ).sum() / w.sum()
  p_t = np.exp(log_softmax(t_logits / 2))
  soft = 4 * (p_t * (log_softmax(t_logits / 2) - log_softmax(s_logits / 2))).sum(-1)[real].mean()
  if PROJECTION in params:
    fit = params[PROJECTION]["fit_dense"]
    project = lambda x: x @ np.asarray(fit["kernel"], np.float64) + np.asarray(fit["bias"])  # noqa
  else:
    project = lambda x: x  # noqa: E731
  mse = lambda a, b: ((a - b) ** 2)[real].mean()  # noqa: E731  (over real tokens and width)
  hidden = mse(project(s_hidden[1]), t_hidden[2]) + mse(project(s_hidden[2]), t_hidden[4])
  embedding = mse(project(s_hidden[0]), t_hidden[0])
  pairs = np.broadcast_to(real[:, None, :, None] & real[:, None, None, :], s_scores[0].shape)
  attention = sum(((s_scores[m] - t_scores[g - 1]) ** 2)[pairs].mean()
                  for m, g in enumerate((2, 4)))
  expected = (2 * hard + 5 * soft + 1.5 * hidden + 0.5 * embedding + 0.25 * attention)
  if student_width == 32:
    s, t = s_hidden[-1], t_hidden[-1]
    cos = (s * t).sum(-1) / np.linalg.norm(s, axis=-1) / np.linalg.norm(t, axis=-1)
    expected += (1 - cos)[real].mean()
    assert metrics["distill_cosine_loss"] == pytest.approx((1 - cos)[real].mean(), rel=1e-4)
  assert float(loss_sum / sums["normalizer"]) == pytest.approx(expected, rel=1e-4)
  for name, value in (("hard", hard), ("soft", soft), ("hidden", hidden),
                      ("embedding", embedding), ("attention", attention)):
    assert metrics[f"distill_{name}_loss"] == pytest.approx(value, rel=1e-4), name


@pytest.mark.parity
@pytest.mark.parametrize("length", [14, 23])
def test_one_distilbert_step_equals_a_torch_rederivation_on_hf_modules(length, tmp_path):
  """DistilBERT's triple loss (5 x soft at T=2, 2 x MLM, 1 x cosine of the last hidden
  states), one training step of a 2-layer student under a 4-layer teacher, against PyTorch
  in float64 on HF's BertForMaskedLM: the loss and every student gradient within 1e-5."""
  teacher_config = bert(4, 32, dropout_rate=0.0)
  teacher_params = write_teacher(tmp_path / "teacher", teacher_config, seed=2)
  student_config = bert(2, 32, dropout_rate=0.0)
  family = wrap(student_config, DistillationConfig(teacher=str(tmp_path / "teacher"),
                                                   **DISTILBERT))
  noise = np.random.RandomState(4)
  params = jax.tree.map(lambda p: p + 0.05 * noise.standard_normal(p.shape).astype(p.dtype),
                        jax.device_get(family.init_params(5)))
  batch = mlm_batch(length=length, seed=6)

  def mean_loss(p):
    loss_sum, sums = family.loss_fn(p, batch, jax.random.key(0), fixed_params=teacher_params)
    return loss_sum / sums["normalizer"]
  loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params)

  t5lite.save_hf(student_config, params, str(tmp_path / "student"))
  t5lite.save_hf(teacher_config, teacher_params, str(tmp_path / "teacher_hf"))
  load = transformers.BertForMaskedLM.from_pretrained
  student = load(str(tmp_path / "student")).double().eval()
  teacher = load(str(tmp_path / "teacher_hf")).double().eval().requires_grad_(False)
  tokens = torch.tensor(batch["encoder_input_tokens"])
  real = torch.tensor(batch["encoder_segment_ids"] > 0)
  s_out, t_out = (m(tokens, attention_mask=real.long(), output_hidden_states=True)
                  for m in (student, teacher))
  log_p_s, log_p_t = (torch.log_softmax(o.logits / 2.0, -1) for o in (s_out, t_out))
  soft = 4.0 * (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1)[real].mean()
  weights = torch.tensor(batch["mlm_loss_weights"], dtype=torch.float64)
  nll = torch.nn.functional.cross_entropy(
      s_out.logits.transpose(1, 2), torch.tensor(batch["mlm_target_tokens"], dtype=torch.long),
      reduction="none")
  hard = (nll * weights).sum() / weights.sum()
  cosine = 1.0 - torch.nn.functional.cosine_similarity(
      s_out.hidden_states[-1], t_out.hidden_states[-1], dim=-1)
  expected = 5.0 * soft + 2.0 * hard + 1.0 * cosine[real].mean()
  expected.backward()

  assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
  assert assert_gradients_match(student_config, grads, student) == len(jax.tree.leaves(grads))


@pytest.mark.parametrize("make", [tiny_decoder_only, tiny], ids=["decoder_only", "encoder_decoder"])
def test_logit_distillation_of_lm_and_text_to_text_models(make, tmp_path):
  """Soft loss over the target positions of a causal LM and of an encoder-decoder's decoder,
  against numpy on t5lite.logits (the HF-parity API)."""
  teacher_config = make(num_decoder_layers=3)
  teacher = write_teacher(tmp_path / "teacher", teacher_config)
  student_config = make(num_decoder_layers=1)
  family = wrap(student_config, DistillationConfig(
      teacher=str(tmp_path / "teacher"), temperature=3.0, soft_weight=1.0))
  params = family.init_params(1)
  rng = np.random.RandomState(2)
  targets = rng.randint(3, 60, (2, 9)).astype(np.int32)
  weights = np.ones((2, 9), np.float32)
  weights[1, 6:] = 0
  targets = targets * weights.astype(np.int32)
  decoder_inputs = np.concatenate([np.zeros((2, 1), np.int32), targets[:, :-1]], 1)
  batch = dict(decoder_input_tokens=decoder_inputs, decoder_target_tokens=targets,
               decoder_loss_weights=weights, decoder_segment_ids=weights.astype(np.int32))
  args = (decoder_inputs,)
  if teacher_config.architecture == "encoder_decoder":
    encoder_inputs = rng.randint(3, 60, (2, 7)).astype(np.int32)
    batch.update(encoder_input_tokens=encoder_inputs,
                 encoder_segment_ids=np.ones((2, 7), np.int32))
    args = (encoder_inputs, decoder_inputs)
  # Jitted: one compiled program, where eagerly each of its ops would compile apart.
  loss_sum, sums = jax.jit(lambda p, b, t: family.loss_fn(p, b, None, fixed_params=t))(
      params, batch, teacher)
  logits = lambda c, p: t5lite.logits(c, p, *args)  # noqa: E731
  s, t = logits(student_config, params), logits(teacher_config, teacher)
  p_t = np.exp(log_softmax(t / 3))
  kl = 9 * (p_t * (log_softmax(t / 3) - log_softmax(s / 3))).sum(-1)
  real = weights > 0
  assert float(loss_sum / sums["normalizer"]) == pytest.approx(kl[real].mean(), rel=1e-4)


def test_an_hf_teacher_is_read_with_its_weights_config(tmp_path):
  """An HF directory's config depends on its weights (T5 v1.1's untied output layer): the
  teacher read from it is the model its weights make, and distils as a MODEL_DIR would."""
  config = tiny(tie_output_embedding=False, num_decoder_layers=2)
  params = jax.device_get(family_of(config).init_params(0))
  t5lite.save_hf(config, params, str(tmp_path / "hf"))
  options = DistillationConfig(teacher=str(tmp_path / "hf"), soft_weight=1.0)
  where, read_config, read_params = teacher_lib.read(options)
  assert where.hf and read_config.tie_output_embedding is False
  loaded = jax.device_get(load_teacher(options))
  np.testing.assert_array_equal(loaded["decoder"]["logits_dense"]["kernel"],
                                params["decoder"]["logits_dense"]["kernel"])
  family = wrap(tiny(num_decoder_layers=1), options)
  assert family.teacher.config == read_config


# --- through the trainer ----------------------------------------------------------------------

def files_digest(path):
  digest = hashlib.sha256()
  for root, _, files in sorted(os.walk(path)):
    for name in sorted(files):
      with open(os.path.join(root, name), "rb") as f:
        digest.update(name.encode() + f.read())
  return digest.hexdigest()


def run(model_dir, model, teacher, steps=6, **weights):
  optimizer = OptimizerConfig(name="adamw", schedule=ScheduleConfig("constant", 1e-2,
                                                                    warmup_steps=0))
  distill = DistillationConfig(teacher=str(teacher), **weights) if teacher else None
  return train(model, train_config(str(model_dir), train_steps=steps,
                                   mixture_or_task_name="train_test_mlm",
                                   task_feature_lengths={"inputs": 32}, log_period=3,
                                   eval_period=steps, eval_steps=1, optimizer=optimizer,
                                   distillation=distill), log=quiet)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_distillation_run_trains_the_student_and_leaves_the_teacher_unchanged(tmp_path):
  teacher_config = tiny_encoder_only(num_encoder_layers=4, type_vocab_size=2)
  write_teacher(tmp_path / "teacher", teacher_config, seed=4)
  before = files_digest(tmp_path / "teacher")
  options = DistillationConfig(teacher=str(tmp_path / "teacher"), **TINYBERT_GENERAL)
  teacher_params = jax.device_get(load_teacher(options))
  # TinyBERT's intermediate stage into a narrower student: the projection trains beside it.
  student = teacher_config.replace(d_model=32, num_encoder_layers=2)
  result = run(tmp_path / "student", student, tmp_path / "teacher", **TINYBERT_GENERAL)
  assert files_digest(tmp_path / "teacher") == before
  after = jax.device_get(load_teacher(options))
  for a, b in zip(jax.tree.leaves(teacher_params), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  assert result.step == 6
  rows = [r for r in t5lite_metrics(tmp_path / "student") if "loss" in r]
  assert {"distill_hidden_loss", "distill_attention_loss", "distill_embedding_loss"} <= set(
      rows[-1])
  assert rows[-1]["distill_hidden_loss"] < rows[0]["distill_hidden_loss"]
  # The MODEL_DIR is a plain student: load_params leaves the projection out.
  config, params, _ = model_dir_lib.load_params(str(tmp_path / "student"))
  assert config == student and PROJECTION not in params
  assert os.path.isfile(tmp_path / "student" / "distillation.json")
  # Resuming it with another teacher is refused.
  other = tmp_path / "other"
  write_teacher(other, teacher_config, seed=9)
  with pytest.raises(ConfigError, match="distilled from another teacher"):
    run(tmp_path / "student", student, other, steps=9, **TINYBERT_GENERAL)


def test_a_damaged_teacher_step_is_named_by_the_teachers_folder(tmp_path):
  """The student has a step 0 of its own: "checkpoint step 0" alone would not say whose."""
  from t5lite.runtime.integrity import CorruptCheckpointError
  write_teacher(tmp_path / "teacher", tiny_encoder_only())
  step_dir = tmp_path / "teacher" / "checkpoints" / "0"
  arrays = [os.path.join(root, name) for root, _, names in os.walk(step_dir) for name in names
            if "/d/" in os.path.join(root, name)]
  with open(max(arrays, key=os.path.getsize), "r+b") as f:
    f.seek(100)
    byte = f.read(1)
    f.seek(100)
    f.write(bytes([byte[0] ^ 0x10]))
  with pytest.raises(CorruptCheckpointError,
                     match=f"checkpoint step 0 in {step_dir}: state/.* fails its CRC32C check"):
    load_teacher(DistillationConfig(teacher=str(tmp_path / "teacher")))


def t5lite_metrics(model_dir):
  from helpers import metrics_records
  return metrics_records(model_dir)


def test_export_student_keeps_the_chosen_teacher_layers(tmp_path, capsys):
  teacher_config = bert(5, 16, type_vocab_size=2, pooler=True, sentence_classes=2)
  teacher = jax.device_get(write_teacher(tmp_path / "teacher", teacher_config))
  argv = ["export", "student", "--checkpoint", str(tmp_path / "teacher"), "--out",
          str(tmp_path / "student"), "--layers", "0,2,4"]
  assert cli.main(argv) == 0
  config, params, step = model_dir_lib.load_params(str(tmp_path / "student"))
  params = jax.device_get(params)
  assert step == 0 and config.num_encoder_layers == 3
  assert (config.type_vocab_size, config.pooler, config.sentence_classes) == (0, False, 0)
  assert "pooler" not in params and "token_type_embedder" not in params["encoder"]
  for i, j in enumerate((0, 2, 4)):
    for a, b in zip(jax.tree.leaves(params["encoder"][f"layers_{i}"]),
                    jax.tree.leaves(teacher["encoder"][f"layers_{j}"])):
      np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(params["token_embedder"]["embedding"],
                                teacher["token_embedder"]["embedding"])
  np.testing.assert_array_equal(params["mlm_transform"]["kernel"],
                                teacher["mlm_transform"]["kernel"])
  assert cli.main(argv[:5] + [str(tmp_path / "bad"), "--layers", "2,1"]) == 2
  assert "increasing teacher layer" in capsys.readouterr().err


# --- bad input --------------------------------------------------------------------------------

def test_a_teacher_of_another_vocabulary_is_refused_with_both_sizes(tmp_path):
  write_teacher(tmp_path / "teacher", bert(2, 16).replace(vocab_size=67))
  options = DistillationConfig(teacher=str(tmp_path / "teacher"), **DISTILBERT)
  with pytest.raises(ConfigError, match="vocab_size=67 .* vocab_size=61"):
    wrap(bert(1, 16), options)


@pytest.mark.parametrize("student, weights, message", [
    (bert(1, 8, heads=2), dict(cosine_weight=1.0), "d_model=8, the teacher's 16"),
    (bert(1, 16, heads=2), dict(attention_weight=1.0), "num_heads=2, the teacher 4"),
    (bert(3, 16), dict(hidden_weight=1.0), "3 layers, the teacher 2"),
])
def test_layer_terms_that_cannot_compare_are_refused(student, weights, message, tmp_path):
  write_teacher(tmp_path / "teacher", bert(2, 16))
  with pytest.raises(ConfigError, match=message):
    wrap(student, DistillationConfig(teacher=str(tmp_path / "teacher"), **weights))


def test_a_bfloat16_teacher_is_loaded_in_bfloat16_with_its_values(tmp_path):
  params = write_teacher(tmp_path / "teacher", bert(2, 16))
  options = DistillationConfig(teacher=str(tmp_path / "teacher"), teacher_dtype="bfloat16")
  family = wrap(bert(1, 16), options)
  assert family.teacher.config.param_dtype == "bfloat16"
  loaded = load_teacher(options)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))


def load_teacher(options):
  """The teacher as the trainer places it (one device)."""
  where, config, params = teacher_lib.read(options)
  return teacher_lib.load(where, config, params, make_mesh(MeshConfig()), logical_axis_rules())


def test_bad_options_are_refused():
  with pytest.raises(ConfigError, match="teacher is not set"):
    DistillationConfig()
  with pytest.raises(ConfigError, match="every weight is 0"):
    DistillationConfig(teacher="x", soft_weight=0.0)
  with pytest.raises(ConfigError, match="temperature"):
    DistillationConfig(teacher="x", temperature=0.0)
  with pytest.raises(ConfigError, match="neither a t5lite MODEL_DIR .* nor an HF model"):
    wrap(bert(1, 16), DistillationConfig(teacher=sys.prefix))
