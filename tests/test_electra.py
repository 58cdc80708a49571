"""ELECTRA (t5lite.families.electra, t5lite.interop.hf.electra): HF parity of each network on
random odd-shaped models, the pair exported as two HF directories equal to the networks the
loss runs, the loss and its metrics against a numpy re-derivation from HF's own outputs, no
gradient through the generator's sample, one training step's loss and gradients against
PyTorch on HF's modules, sharded = one device, sizes and bad input.

Replaced tokens come from sampling; the loss test makes the sample certain (a generator
whose output bias puts all its mass on one token), so that the reference knows it."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import t5lite
from t5lite import cli
from t5lite.errors import ConfigError
from t5lite.interop.hf import checkpoints as hf
from t5lite.interop import params_only
from t5lite.families import family_of
from t5lite.families.electra import discriminator_config, generator_config, with_shared
from t5lite.families.encoder_only import mlm_slots
from t5lite.models import count_params
from t5lite.models.config import ModelConfig
from t5lite.models.electra_config import ElectraConfig
from t5lite.runtime.partitioning import (MeshConfig, activate, logical_axis_rules, make_mesh,
                                         param_shardings)

from helpers.hf_models import assert_gradients_match

T = transformers
# Odd widths: E != H (projected) and E == H (no projection); 3 token types.
HF_SIZES = dict(vocab_size=83, num_hidden_layers=2, intermediate_size=44,
                max_position_embeddings=40, type_vocab_size=3)
CASES = {
    "discriminator": (T.ElectraForPreTraining, dict(embedding_size=14, hidden_size=30,
                                                    num_attention_heads=5)),
    "generator": (T.ElectraForMaskedLM, dict(embedding_size=18, hidden_size=18,
                                             num_attention_heads=3)),
    "generator_projected": (T.ElectraForMaskedLM, dict(embedding_size=14, hidden_size=10,
                                                       num_attention_heads=2)),
    "sequence_classification": (T.ElectraForSequenceClassification,
                                dict(embedding_size=14, hidden_size=30, num_attention_heads=5,
                                     num_labels=3)),
    "token_classification": (T.ElectraForTokenClassification,
                             dict(embedding_size=14, hidden_size=30, num_attention_heads=5,
                                  num_labels=4)),
    "question_answering": (T.ElectraForQuestionAnswering,
                           dict(embedding_size=30, hidden_size=30, num_attention_heads=5)),
}


def perturbed(model):
  """Biases off 0 and norm scales off 1, so that a swapped one shows."""
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
  return model.eval()


def hf_logits(model, ids, types=None):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids),
                token_type_ids=None if types is None else torch.tensor(types))
  if hasattr(out, "start_logits"):
    return np.stack([out.start_logits.numpy(), out.end_logits.numpy()], -1)
  return out.logits.numpy()


def close(a, b, tolerance=1e-4):
  assert a.shape == b.shape
  assert np.abs(a - b).max() <= tolerance * max(np.abs(b).max(), 1.0)


def loads_cleanly(model_cls, path):
  model, info = model_cls.from_pretrained(path, output_loading_info=True)
  assert type(model) is model_cls
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_hf_network_loads_with_its_logits_and_saves_back(case, tmp_path):
  model_cls, sizes = CASES[case]
  torch.manual_seed(0)
  model = perturbed(model_cls(T.ElectraConfig(**HF_SIZES, **sizes)))
  model.save_pretrained(tmp_path / "hf")
  rng = np.random.RandomState(1)
  ids, types = rng.randint(0, 83, (2, 13)), rng.randint(0, 3, (2, 13))
  reference = hf_logits(model, ids, types)
  config, params = t5lite.load_hf(str(tmp_path / "hf"))
  assert config.family == "electra"
  assert config.electra == (ElectraConfig() if case == "discriminator" else None)
  assert config.embedding_size == (0 if sizes["embedding_size"] == sizes["hidden_size"]
                                   else sizes["embedding_size"])
  close(t5lite.logits(config, params, ids, token_type_ids=types), reference)
  t5lite.save_hf(config, params, str(tmp_path / "back"))
  close(hf_logits(loads_cleanly(model_cls, str(tmp_path / "back")), ids, types), reference)


# --- the pretraining pair -------------------------------------------------------------------

def pair_config(**changes):
  """A discriminator of width 48 (E 24, projected) with a generator of a quarter of it
  (12, one head, its own projection from the shared 24)."""
  return ModelConfig(**{**dict(
      architecture="encoder_only", family="electra", vocab_size=97, d_model=48, d_ff=96,
      num_heads=3, d_kv=16, num_encoder_layers=2, embedding_size=24, mlp_activation="gelu_exact",
      norm="layer", norm_position="post", use_bias=True, scale_attention=True,
      position_encoding="learned", max_position_embeddings=64, type_vocab_size=2,
      embedding_norm=True, tie_output_embedding=True, init_std=0.02, layer_norm_epsilon=1e-12,
      electra=ElectraConfig(generator_hidden_fraction=0.25)), **changes})


def test_the_pair_shares_its_embeddings_and_exports_as_two_hf_directories(tmp_path):
  config = pair_config()
  family = family_of(config)
  params = jax.device_get(family.init_params(3))
  assert "token_embedder" not in params["generator"]
  assert "position_embedder" not in params["generator"]["encoder"]
  assert params["generator"]["encoder"]["embedding_projection"]["kernel"].shape == (24, 12)
  networks = family.networks(params)
  assert [name for name, _, _ in networks] == ["discriminator", "generator"]
  ids = np.random.RandomState(2).randint(1, 97, (2, 11))
  for (name, net_config, net_params), model_cls in zip(
      networks, (T.ElectraForPreTraining, T.ElectraForMaskedLM)):
    t5lite.save_hf(net_config, net_params, str(tmp_path / name))
    saved = json.loads((tmp_path / name / "config.json").read_text())
    assert saved["architectures"] == [model_cls.__name__]
    model = loads_cleanly(model_cls, str(tmp_path / name))
    close(hf_logits(model, ids), t5lite.logits(net_config, net_params, ids))
  # The shared tables are one array, in both exports.
  disc = T.ElectraForPreTraining.from_pretrained(str(tmp_path / "discriminator"))
  gen = T.ElectraForMaskedLM.from_pretrained(str(tmp_path / "generator"))
  assert torch.equal(disc.electra.embeddings.word_embeddings.weight,
                     gen.electra.embeddings.word_embeddings.weight)
  assert gen.config.hidden_size == 12 and gen.config.embedding_size == 24
  with pytest.raises(ConfigError, match="DIR/discriminator and DIR/generator"):
    t5lite.save_hf(config, params, str(tmp_path / "both"))


def test_export_hf_of_a_pair_checkpoint_writes_both_directories(tmp_path):
  """`t5lite export hf` on a MODEL_DIR of the pair: DIR/discriminator and DIR/generator,
  each a directory transformers loads as its class, with the MODEL_DIR's weights."""
  config = pair_config()
  params = jax.device_get(family_of(config).init_params(4))
  params_only.write_model_dir(str(tmp_path / "run"), config, params, step=7, vocabulary=None)
  assert cli.main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out",
                   str(tmp_path / "hf")]) == 0
  ids = np.random.RandomState(3).randint(1, 97, (2, 9))
  for (name, net_config, net_params), model_cls in zip(
      family_of(config).networks(params), (T.ElectraForPreTraining, T.ElectraForMaskedLM)):
    model = loads_cleanly(model_cls, str(tmp_path / "hf" / name))
    close(hf_logits(model, ids), t5lite.logits(net_config, net_params, ids))
  with pytest.raises(ValueError, match="networks"):
    t5lite.logits(config, params, ids)


def certain_generator(params, token: int):
  """The pair's params with the generator's output bias so high at `token` that every sample
  is `token` (p(other) < 1e-20)."""
  gen = dict(params["generator"])
  bias = np.asarray(gen["logits_dense"]["bias"]).copy()
  bias[token] = 60.0
  gen["logits_dense"] = {**gen["logits_dense"], "bias": jnp.asarray(bias)}
  return {**params, "generator": gen}


def masked_batch(rows, length, chosen_per_row, token, seed=0):
  """An MLM batch: original tokens (never `token`, except at one chosen position of row 0,
  which the generator then 'replaces' by itself), [MASK] (id 4) at the chosen positions,
  the last row padded after 3/4 of its length."""
  rng = np.random.RandomState(seed)
  original = rng.randint(5, 97, (rows, length))
  original[original == token] = token + 1
  weights = np.zeros((rows, length), np.float32)
  for r in range(rows):
    weights[r, rng.choice(length - length // 4, chosen_per_row, replace=False)] = 1
  first = np.flatnonzero(weights[0])[0]
  original[0, first] = token
  segments = np.ones((rows, length), np.int32)
  segments[-1, length - length // 4:] = 0
  original = original * segments
  weights = weights * segments
  return dict(encoder_input_tokens=np.where(weights > 0, 4, original).astype(np.int32),
              mlm_target_tokens=original.astype(np.int32), mlm_loss_weights=weights,
              encoder_segment_ids=segments)


def softplus(x):
  return np.logaddexp(0.0, x)


@pytest.mark.parametrize("length, chosen", [(24, 3), (24, 9), (37, 5)])
def test_the_loss_and_metrics_equal_a_numpy_rederivation_from_hf_outputs(length, chosen,
                                                                         tmp_path):
  """loss = CE(generator) mean over the masked tokens + 50 x BCE(discriminator) mean over the
  real tokens, on HF's logits of the exported networks: the generator's on the masked input,
  the discriminator's on it with the generator's samples in place of [MASK] (9 of 24 chosen:
  more than the MLM slots, the head runs on every position)."""
  token = 7
  config = pair_config()
  family = family_of(config)
  params = certain_generator(jax.device_get(family.init_params(5)), token)
  batch = masked_batch(3, length, chosen, token)
  loss_sum, sums = jax.jit(family.loss_fn)(params, batch, None)
  metrics = {k: float(v) for k, v in family.metrics(sums, sums["normalizer"]).items()}

  for name, net_config, net_params in family.networks(params):
    t5lite.save_hf(net_config, net_params, str(tmp_path / name))
  gen = T.ElectraForMaskedLM.from_pretrained(str(tmp_path / "generator")).eval()
  disc = T.ElectraForPreTraining.from_pretrained(str(tmp_path / "discriminator")).eval()
  real = batch["encoder_segment_ids"] > 0
  mask = torch.tensor(real.astype(np.int64))
  with torch.no_grad():
    gen_logits = gen(torch.tensor(batch["encoder_input_tokens"]),
                     attention_mask=mask).logits.numpy().astype(np.float64)
  weights, original = batch["mlm_loss_weights"], batch["mlm_target_tokens"]
  log_probs = gen_logits - np.logaddexp.reduce(gen_logits, axis=-1, keepdims=True)
  nll = -np.take_along_axis(log_probs, original[..., None], -1)[..., 0]
  generator_mean = (nll * weights).sum() / weights.sum()
  corrupted = np.where(weights > 0, token, original)
  replaced = (corrupted != original) & real
  assert replaced.sum() == weights.sum() - 1  # the chosen `token` stays labelled original
  with torch.no_grad():
    disc_logits = disc(torch.tensor(corrupted), attention_mask=mask).logits.numpy()
  disc_logits = disc_logits.astype(np.float64)
  bce = softplus(disc_logits) - disc_logits * replaced
  discriminator_mean = bce[real].mean()

  expected = generator_mean + 50.0 * discriminator_mean
  assert float(loss_sum / sums["normalizer"]) == pytest.approx(expected, rel=1e-4)
  predicted = (disc_logits > 0) & real
  assert metrics["discriminator_loss"] == pytest.approx(discriminator_mean, rel=1e-4)
  assert metrics["generator_loss"] == pytest.approx(generator_mean, rel=1e-4)
  assert metrics["discriminator_accuracy"] == pytest.approx(
      (predicted == replaced)[real].mean(), abs=1e-6)
  assert metrics["replaced_recall"] == pytest.approx(
      (predicted & replaced).sum() / replaced.sum(), abs=1e-6)
  assert metrics["replaced_precision"] == pytest.approx(
      (predicted & replaced).sum() / max(predicted.sum(), 1), abs=1e-6)
  assert metrics["generator_accuracy"] == pytest.approx(
      ((gen_logits.argmax(-1) == original) * weights).sum() / weights.sum(), abs=1e-6)


def test_no_gradient_flows_through_the_sample_but_both_losses_train_the_shared_tables():
  """The generator's own params get the same gradient whatever the discriminator's weight
  (its sample is data); the shared word embeddings get the discriminator's too."""
  # One layer: the sample's stop-gradient and the shared tables are outside the layers.
  config = pair_config(dropout_rate=0.0, num_encoder_layers=1)
  params = family_of(config).init_params(1)
  batch = masked_batch(2, 16, 3, 7)

  def grads(weight):
    electra = ElectraConfig(generator_hidden_fraction=0.25, discriminator_loss_weight=weight)
    family = family_of(config.replace(electra=electra))
    return jax.jit(jax.grad(lambda p: family.loss_fn(p, batch, jax.random.key(4))[0]))(params)
  with_disc, without = grads(50.0), grads(0.0)
  for a, b in zip(jax.tree.leaves(with_disc["generator"]), jax.tree.leaves(without["generator"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  table = lambda g: np.asarray(g["discriminator"]["token_embedder"]["embedding"])  # noqa: E731
  assert np.abs(table(with_disc) - table(without)).max() > 0
  assert np.abs(table(without)).max() > 0  # the generator's MLM loss trains it too


@pytest.mark.parity
@pytest.mark.parametrize("length, chosen, temperature", [(37, 5, 1.0), (16, 2, 2.0)])
def test_one_training_step_equals_a_torch_rederivation_on_hf_modules(length, chosen, temperature,
                                                                       tmp_path):
  """One training step of the pair against PyTorch in float64 on HF's ElectraForMaskedLM and
  ElectraForPreTraining sharing one electra.embeddings (and the generator's tied output
  table): the same params and batch, the replacements re-derived from the step's key (the
  generator samples each row's first MLM slots as argmax(logits / temperature + Gumbel
  noise), as jax.random.categorical draws), labels, generator MLM mean + 50 x discriminator
  BCE mean.
  The loss and every gradient (the discriminator's, the generator's own, the shared tables'
  total of both losses) agree within 1e-5."""
  config = pair_config(dropout_rate=0.0, electra=ElectraConfig(
      generator_hidden_fraction=0.25, sampling_temperature=temperature))
  family = family_of(config)
  noise = np.random.RandomState(8)
  params = jax.tree.map(lambda p: p + 0.05 * noise.standard_normal(p.shape).astype(p.dtype),
                        jax.device_get(family.init_params(6)))
  batch = masked_batch(3, length, chosen, token=7)
  rng = jax.random.key(11)

  def mean_loss(p):
    loss_sum, sums = family.loss_fn(p, batch, rng)
    return loss_sum / sums["normalizer"], sums
  (loss, sums), grads = jax.jit(jax.value_and_grad(mean_loss, has_aux=True))(params)

  for name, net_config, net_params in family.networks(params):
    t5lite.save_hf(net_config, net_params, str(tmp_path / name))
  gen = T.ElectraForMaskedLM.from_pretrained(str(tmp_path / "generator")).double().eval()
  disc = T.ElectraForPreTraining.from_pretrained(str(tmp_path / "discriminator")).double().eval()
  gen.electra.embeddings = disc.electra.embeddings
  gen.generator_lm_head.weight = disc.electra.embeddings.word_embeddings.weight
  real = batch["encoder_segment_ids"] > 0
  mask = torch.tensor(real.astype(np.int64))
  weights, original = batch["mlm_loss_weights"], batch["mlm_target_tokens"]
  gen_logits = gen(torch.tensor(batch["encoder_input_tokens"]), attention_mask=mask).logits
  nll = torch.nn.functional.cross_entropy(gen_logits.transpose(1, 2),
                                          torch.tensor(original, dtype=torch.long),
                                          reduction="none")
  generator_mean = (nll * torch.tensor(weights)).sum() / weights.sum()

  rows = np.arange(len(original))[:, None]
  order = np.argsort(~(weights > 0), axis=1, kind="stable")[:, :mlm_slots(length)]
  gumbel = jax.random.gumbel(jax.random.split(rng, 3)[2], order.shape + (config.vocab_size,))
  picked = gen_logits.detach().numpy()[rows, order]
  corrupted = original.copy()
  corrupted[rows, order] = np.argmax(picked / temperature + np.asarray(gumbel, np.float64),
                                     axis=-1)
  corrupted = np.where(weights > 0, corrupted, original)
  replaced = (corrupted != original) & real
  assert 0 < replaced.sum() <= weights.sum()
  disc_logits = disc(torch.tensor(corrupted), attention_mask=mask).logits
  bce = torch.nn.functional.binary_cross_entropy_with_logits(
      disc_logits, torch.tensor(replaced, dtype=torch.float64), reduction="none")
  discriminator_mean = bce[torch.tensor(real)].mean()
  expected = generator_mean + 50.0 * discriminator_mean
  expected.backward()

  assert float(loss) == pytest.approx(expected.item(), rel=1e-5)
  assert float(sums["replaced_actual"]) == replaced.sum()  # the same samples
  assert float(sums["discriminator_loss"]) / real.sum() == pytest.approx(
      discriminator_mean.item(), rel=1e-5)
  compared = assert_gradients_match(
      discriminator_config(config), grads["discriminator"], disc)
  compared += assert_gradients_match(
      generator_config(config), with_shared(grads["generator"], grads["discriminator"]), gen,
      skip=("electra.embeddings.",))  # the shared tables: compared with the discriminator's
  assert compared == len(jax.tree.leaves(grads))


def test_a_sharded_pair_gives_the_one_device_loss():
  """Both networks sharded by the partitioning rules (data 4 x tensor 2; the generator's
  128 wide, 2 heads of 64): the same loss."""
  config = pair_config(vocab_size=128, d_model=256, num_heads=4, d_kv=64, d_ff=128,
                       embedding_size=32, electra=ElectraConfig(generator_hidden_fraction=0.5))
  family = family_of(config)
  mesh, rules = make_mesh(MeshConfig(4, 1, 2)), logical_axis_rules()
  shardings = param_shardings(config, mesh, rules)
  params = jax.jit(family.init_params, out_shardings=shardings)(jax.random.key(0))
  spec = params["generator"]["encoder"]["layers_0"]["mlp"]["wi"]["kernel"].sharding.spec
  assert "tensor" in tuple(spec)
  batch = masked_batch(4, 16, 3, 7)
  with activate(mesh, rules):
    sharded = jax.jit(family.loss_fn)(params, batch, jax.random.key(2))
  single = jax.jit(family.loss_fn)(jax.device_get(params), batch, jax.random.key(2))
  np.testing.assert_allclose(float(sharded[0]), float(single[0]), rtol=1e-5)


# --- sizes and bad input --------------------------------------------------------------------

def test_published_sizes_give_hf_parameter_counts():
  """ELECTRA-small's discriminator and ELECTRA-base's generator, as gin/models/electra/
  size them, have the parameters of HF's models of those sizes."""
  import t5lite.cli.gin_config as gin_config
  counts = {}
  for size, hf_config in (("small", T.ElectraConfig()),
                          ("base", T.ElectraConfig(embedding_size=768, hidden_size=256,
                                                   num_attention_heads=4,
                                                   intermediate_size=1024))):
    gin_config.parse([f"gin/models/electra/{size}.gin"])
    config = gin_config.model_config()
    with torch.device("meta"):
      model_cls = T.ElectraForPreTraining if size == "small" else T.ElectraForMaskedLM
      expected = sum(p.numel() for p in model_cls(hf_config).parameters())
    network = config.replace(electra=ElectraConfig()) if size == "small" else (
        generator_config(config))
    counts[size] = count_params(network)
    assert counts[size] == expected, (size, counts[size], expected)
  gen = generator_config(gin_config.model_config())
  assert (gen.d_model, gen.num_heads, gen.d_kv, gen.d_ff, gen.embedding_size) == (
      256, 4, 64, 1024, 768)


def test_a_generator_larger_than_the_discriminator_is_refused_with_both_sizes():
  with pytest.raises(ConfigError, match=r"hidden size 96 .*d_model=48.* hidden size 48"):
    pair_config(electra=ElectraConfig(generator_hidden_fraction=2.0))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf"), "2"])
def test_a_sampling_temperature_that_is_not_a_positive_number_is_refused(temperature):
  with pytest.raises(ConfigError, match="sampling_temperature must be a number > 0"):
    ElectraConfig(generator_hidden_fraction=0.25, sampling_temperature=temperature)


def test_a_lone_discriminator_cannot_pretrain_and_says_what_to_set():
  family = family_of(pair_config(electra=ElectraConfig()))
  params = family.init_params(0)
  with pytest.raises(ConfigError, match="generator_hidden_fraction"):
    family.loss_fn(params, masked_batch(2, 16, 3, 7), None)


def test_hf_export_refuses_what_electra_cannot_express():
  with pytest.raises(ConfigError, match="embedding_size=0"):
    hf.config_to_hf(pair_config(electra=ElectraConfig(), embedding_size=48))
  with pytest.raises(ConfigError, match="mlp_activation"):  # its MLM head is exact GELU
    hf.config_to_hf(pair_config(electra=None, mlp_activation="gelu"))
  with pytest.raises(ConfigError, match="multiple_choice"):
    hf.config_to_hf(pair_config(electra=None, head="multiple_choice", pooler=True))
  assert with_shared({}, {"token_embedder": 1}) == {"token_embedder": 1}
