"""Finetuning heads beyond HF parity (tests/test_hf_heads.py): the head converter's rows and
refusals, the warm start from a pretrained checkpoint, SpanBERT's span boundary loss against
a direct computation, GPT-1's auxiliary LM loss, and weight decay that spares every bias."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import checkpoint_params, logged_losses, quiet, tiny_decoder_only, tiny_encoder_only
from helpers import train_config
from t5lite.data.converters.heads import HeadFeatureConverter
from t5lite.errors import ConfigError
from t5lite.families import family_of
from t5lite.models.span_boundary_config import SpanBoundaryConfig
from t5lite.train import warm_start
from t5lite.train.optimizers import weight_decay_mask

BERTISH = dict(pooler=True, type_vocab_size=2, use_bias=True, scale_logits=False)


def test_encoder_rows_pad_and_carry_labels():
  conv = HeadFeatureConverter("sequence_classification", 3, "single_label_classification")
  row = conv.row({"inputs": np.array([2, 7, 8, 3]), "token_type_ids": np.array([0, 0, 1, 1]),
                  "label": np.int32(2)}, 6)
  np.testing.assert_array_equal(row["encoder_input_tokens"], [2, 7, 8, 3, 0, 0])
  np.testing.assert_array_equal(row["encoder_segment_ids"], [1, 1, 1, 1, 0, 0])
  np.testing.assert_array_equal(row["encoder_positions"], [0, 1, 2, 3, 0, 0])
  np.testing.assert_array_equal(row["encoder_token_type_ids"], [0, 0, 1, 1, 0, 0])
  assert row["labels"] == 2 and row["labels"].dtype == np.int32
  assert set(row) == set(conv.model_feature_lengths({"inputs": 6})) | {"labels"}


def test_token_qa_choice_and_regression_rows():
  tags = HeadFeatureConverter("token_classification", 5, "").row(
      {"inputs": [2, 5, 3], "token_labels": [-100, 4, -100]}, 5)
  np.testing.assert_array_equal(tags["token_labels"], [-100, 4, -100, -100, -100])
  qa = HeadFeatureConverter("question_answering", 2, "").row(
      {"inputs": [2, 5, 6, 3], "start_position": 1, "end_position": 2}, 7)
  assert (qa["start_positions"], qa["end_positions"]) == (1, 2)
  choice = HeadFeatureConverter("multiple_choice", 2, "").row(
      {"inputs": np.array([[2, 5, 3], [2, 6, 3]]), "label": 1}, 5)
  assert choice["encoder_input_tokens"].shape == (2, 5)
  np.testing.assert_array_equal(choice["encoder_segment_ids"], [[1, 1, 1, 0, 0]] * 2)
  stsb = HeadFeatureConverter("sequence_classification", 1, "regression").row(
      {"inputs": [2, 3], "label": 3.8}, 4)
  assert stsb["labels"].dtype == np.float32 and abs(float(stsb["labels"]) - 3.8) < 1e-6


def test_decoder_rows_have_next_token_targets_for_the_lm_loss():
  row = HeadFeatureConverter("sequence_classification", 2, "", decoder=True, lm_loss=True).row(
      {"inputs": [10, 11, 12], "label": 0}, 5)
  np.testing.assert_array_equal(row["decoder_input_tokens"], [10, 11, 12, 0, 0])
  np.testing.assert_array_equal(row["decoder_target_tokens"], [11, 12, 0, 0, 0])
  np.testing.assert_array_equal(row["decoder_loss_weights"], [1, 1, 0, 0, 0])


@pytest.mark.parametrize("example, message", [
    ({"inputs": [2, 3], "label": 3, "idx": 17}, "example 17: label 3 is outside"),
    ({"inputs": [2, 3], "token_labels": [0, 9], "id": "s-4"}, "example 's-4': token label 9"),
    ({"inputs": [2, 3], "start_position": 0, "end_position": 9, "example_id": "q1"},
     "answer span (0, 9) is outside"),
])
def test_bad_labels_name_the_example(example, message):
  head = ("token_classification" if "token_labels" in example else
          "question_answering" if "start_position" in example else "sequence_classification")
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    HeadFeatureConverter(head, 3, "").row(example, 4)


def test_warm_start_plan_sorts_params_and_refuses_another_backbone():
  saved = {"['encoder']['w']": (4, 4), "['token_embedder']['embedding']": (10, 4),
           "['mlm_transform']['kernel']": (4, 4)}
  wanted = {"['encoder']['w']": (4, 4), "['token_embedder']['embedding']": (13, 4),
            "['head']['classifier']['kernel']": (4, 2)}
  plan = warm_start.plan_warm_start(wanted, saved, old_vocab=10, new_vocab=13, source="ckpt")
  assert plan.carried == ("['encoder']['w']",)
  assert plan.grown == ("['token_embedder']['embedding']",)
  assert plan.new == ("['head']['classifier']['kernel']",)
  assert plan.dropped == ("['mlm_transform']['kernel']",)
  with pytest.raises(ConfigError, match=r"\['encoder'\]\['w'\]: checkpoint \(4, 4\), model \(5, 4\)"):
    warm_start.plan_warm_start({**wanted, "['encoder']['w']": (5, 4)}, saved, old_vocab=10,
                               new_vocab=13, source="ckpt")


def test_weight_decay_spares_attention_biases_and_norm_scales():
  family = family_of(tiny_encoder_only(**BERTISH))
  params = family.abstract_params()
  mask = weight_decay_mask(family.param_logical_axes())(params)
  flat = {jax.tree_util.keystr(p): m for p, m in jax.tree_util.tree_leaves_with_path(mask)}
  query = "['encoder']['layers_0']['attention']['query']"
  assert flat[query + "['kernel']"] and not flat[query + "['bias']"]  # bias (heads, kv)
  assert not any(v for k, v in flat.items() if k.endswith(("['bias']", "['scale']")))
  assert flat["['token_embedder']['embedding']"]


def _span_batch(config, rng):
  """A batch with two masked spans per row and their boundary features."""
  b, length = 3, 16
  tokens = rng.integers(5, config.vocab_size, (b, length))
  weights = np.zeros((b, length), np.int32)
  left, right, offset = (np.zeros((b, length), np.int32) for _ in range(3))
  for row in range(b):
    for s, e in ((2, 4), (8 + row, 10 + row)):  # spans [s, e]
      weights[row, s:e + 1] = 1
      left[row, s:e + 1], right[row, s:e + 1] = s - 1, e + 1
      offset[row, s:e + 1] = np.arange(1, e - s + 2)
  masked = np.where(weights > 0, 4, tokens)
  ones = np.ones((b, length), np.int32)
  return {"encoder_input_tokens": masked, "encoder_segment_ids": ones,
          "encoder_positions": np.broadcast_to(np.arange(length), (b, length)),
          "mlm_target_tokens": tokens, "mlm_loss_weights": weights, "mlm_span_left": left,
          "mlm_span_right": right, "mlm_span_offset": offset}


def test_span_boundary_loss_is_mlm_mean_plus_sbo_mean():
  config = tiny_encoder_only(span_boundary=SpanBoundaryConfig(max_span_length=4))
  family = family_of(config)
  params = family.init_params(1)
  batch = {k: jnp.asarray(v) for k, v in _span_batch(config, np.random.default_rng(0)).items()}
  # Jitted, the loss and the direct computation each compile once rather than op by op.
  loss_sum, sums = jax.jit(lambda p, b: family.loss_fn(p, b, None))(params, batch)
  model = family.make_model()

  @jax.jit
  def direct(params, batch):
    """(the expected loss, the SBO mean) from the model's own methods."""
    apply = lambda method, *a: model.apply({"params": params}, *a, method=method)  # noqa: E731
    states = apply("hidden_states", batch["encoder_input_tokens"],
                   batch["encoder_segment_ids"], batch["encoder_positions"])
    targets, weights = batch["mlm_target_tokens"], batch["mlm_loss_weights"].astype(jnp.float32)
    mlm = optax.softmax_cross_entropy_with_integer_labels(apply("mlm_logits", states), targets)
    gather = lambda key: jnp.take_along_axis(states, batch[key][..., None], axis=1)  # noqa: E731
    sbo_logits = apply("span_boundary_logits", gather("mlm_span_left"),
                       gather("mlm_span_right"), batch["mlm_span_offset"])
    sbo = optax.softmax_cross_entropy_with_integer_labels(sbo_logits, targets)
    return ((jnp.sum(mlm * weights) + jnp.sum(sbo * weights)) / jnp.sum(weights),
            jnp.sum(sbo * weights) / jnp.sum(weights))
  expected, sbo_mean = direct(params, batch)
  np.testing.assert_allclose(loss_sum / sums["normalizer"], expected, rtol=1e-5)
  metrics = family.metrics(sums, sums["normalizer"])
  np.testing.assert_allclose(metrics["sbo_loss"], sbo_mean, rtol=1e-5)


def test_gpt1_loss_is_task_mean_plus_half_the_lm_mean():
  config = tiny_decoder_only(head="sequence_classification", num_labels=3, lm_loss_weight=0.5)
  family = family_of(config)
  params = family.init_params(2)
  conv = family.converter()
  rng = np.random.default_rng(3)
  rows = [conv.row({"inputs": rng.integers(5, 300, n), "label": n % 3}, 9) for n in (9, 5, 7)]
  batch = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
  # Jitted: op by op, each of the loss's hundreds of ops would compile alone.
  loss_sum, sums = jax.jit(lambda p, b: family.loss_fn(p, b, None))(params, batch)
  logits = jax.jit(family.logits)
  classes, lm_logits = logits(params, batch)
  task = optax.softmax_cross_entropy_with_integer_labels(classes, batch["labels"]).mean()
  lm_w = batch["decoder_loss_weights"].astype(jnp.float32)
  lm = optax.softmax_cross_entropy_with_integer_labels(lm_logits, batch["decoder_target_tokens"])
  expected = task + 0.5 * jnp.sum(lm * lm_w) / jnp.sum(lm_w)
  np.testing.assert_allclose(loss_sum / sums["normalizer"], expected, rtol=1e-5)
  # The classifier reads each row's last real token: changing a later pad changes nothing.
  padded = dict(batch, decoder_input_tokens=batch["decoder_input_tokens"].at[1, 6].set(77))
  np.testing.assert_array_equal(logits(params, padded)[0][1], classes[1])


def test_a_head_task_needs_a_model_with_that_head(tmp_path):
  from t5lite.train.trainer import train
  import train_tasks  # noqa: F401 (registers train_test_classify)
  run = train_config(tmp_path, mixture_or_task_name="train_test_classify",
                     task_feature_lengths={"inputs": 32})
  with pytest.raises(ConfigError, match="set ModelConfig.head = 'sequence_classification'"):
    train(tiny_encoder_only(), run, log=quiet)
  with pytest.raises(ConfigError, match="set ModelConfig.num_labels = 2"):
    train(tiny_encoder_only(head="sequence_classification", num_labels=3, pooler=True), run,
          log=quiet)
  assert not (tmp_path / "model_config.json").exists()  # refused before writing anything


@pytest.mark.e2e
@pytest.mark.slow
def test_finetuning_a_pretrained_encoder_keeps_its_backbone_and_learns(tmp_path):
  """Pretrain MLM + NSP-headed model 3 steps, then finetune a classifier from it: at the
  finetuning's start the encoder equals the pretrained one bit for bit, the head is new, the
  eval accuracy is computed from the head and the loss falls."""
  import train_tasks  # noqa: F401
  from t5lite.train.trainer import train
  pretrained = tiny_encoder_only(**BERTISH, sentence_classes=2)
  train(pretrained, train_config(tmp_path / "pre", mixture_or_task_name="train_test_mlm",
                                 task_feature_lengths={"inputs": 64}), log=quiet)
  finetune = pretrained.replace(head="sequence_classification", num_labels=2,
                                sentence_classes=0)
  lines = []
  train(finetune, train_config(
      tmp_path / "ft", mixture_or_task_name="train_test_classify", train_steps=24,
      task_feature_lengths={"inputs": 64}, initial_checkpoint_path=str(tmp_path / "pre"),
      eval_period=24, infer_eval_period=24, log_period=1), log=lines.append)
  assert any("newly initialized: ['head']['classifier']['bias']" in line for line in lines)
  assert any("not used: ['logits_dense']['bias']" in line for line in lines)
  _, before, _ = checkpoint_params(tmp_path / "pre")
  losses = logged_losses(tmp_path / "ft")
  first, last = (np.mean([losses[s] for s in steps]) for steps in (range(4, 9), range(20, 25)))
  assert last < first, losses
  from helpers import metrics_records
  final = metrics_records(tmp_path / "ft")[-1]
  assert 0 <= final["eval/train_test_classify/accuracy"] <= 100
  # Warm start itself: the carried params are the pretrained ones exactly.
  from t5lite.train.trainer import Trainer
  trainer = Trainer(finetune, train_config(
      tmp_path / "ft2", mixture_or_task_name="train_test_classify",
      task_feature_lengths={"inputs": 64}, initial_checkpoint_path=str(tmp_path / "pre")))
  params, step = trainer.initial_params(str(tmp_path / "pre"), log=quiet)
  assert step == 3
  np.testing.assert_array_equal(np.asarray(params["encoder"]["layers_1"]["mlp"]["wi"]["kernel"]),
                                before["encoder"]["layers_1"]["mlp"]["wi"]["kernel"])
  np.testing.assert_array_equal(np.asarray(params["pooler"]["kernel"]), before["pooler"]["kernel"])


def test_merge_grows_the_embedding_and_keeps_fresh_rows():
  fresh = {"token_embedder": {"embedding": jnp.full((5, 2), 7.0)}, "w": jnp.zeros(3)}
  old = np.arange(6, dtype=np.float32).reshape(3, 2)
  plan = warm_start.WarmStartPlan(carried=("['w']",), grown=("['token_embedder']['embedding']",),
                                  new=(), dropped=())
  merged = warm_start.merge(fresh, {"['w']": np.ones(3, np.float32),
                                    "['token_embedder']['embedding']": old}, plan)
  np.testing.assert_array_equal(merged["token_embedder"]["embedding"][:3], old)
  np.testing.assert_array_equal(merged["token_embedder"]["embedding"][3:], 7.0)
  np.testing.assert_array_equal(merged["w"], 1.0)
