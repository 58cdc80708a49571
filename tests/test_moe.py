"""Mixture-of-Experts: routing against a numpy re-derivation, HF Switch Transformers parity
(logits, pooled router losses, the loss with them), the per-layer loss definition, export
round trips and bad settings."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import jax
import jax.numpy as jnp
import t5lite
from t5lite.errors import ConfigError
from t5lite.families import family_of
from t5lite.models.moe import losses as moe_losses
from t5lite.models.config import ModelConfig
from t5lite.models.electra_config import ElectraConfig
from t5lite.models.moe.layer import combine, dispatch, route
from t5lite.models.moe.config import MoeConfig

SWITCH_CONFIGS = {  # odd shapes; capacity 3 overflows at these lengths
    "steps_3_2": dict(vocab_size=97, d_model=20, d_kv=6, d_ff=36, num_layers=3,
                      num_decoder_layers=4, num_heads=3, num_experts=4, expert_capacity=3,
                      num_sparse_encoder_layers=1, num_sparse_decoder_layers=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=20),
    "every_layer_untied": dict(vocab_size=61, d_model=12, d_kv=5, d_ff=18, num_layers=2,
                               num_decoder_layers=3, num_heads=2, num_experts=3,
                               expert_capacity=4, num_sparse_encoder_layers=2,
                               num_sparse_decoder_layers=1, tie_word_embeddings=False,
                               dense_act_fn="gelu_new"),
}


def numpy_route(logits: np.ndarray, top_k: int, capacity: int):
  """The routing rule written as loops: first choices of every token, then second ones, each
  in sequence order; an expert takes a choice while it has fewer than `capacity`."""
  batch, length, experts = logits.shape
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  order = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]
  combine = np.zeros((batch, length, experts, capacity))
  for b in range(batch):
    used = [0] * experts
    for k in range(top_k):
      for t in range(length):
        e = order[b, t, k]
        if used[e] < capacity:
          combine[b, t, e, used[e]] = probs[b, t, e]
        used[e] += 1
  return combine


@pytest.mark.parametrize("top_k,capacity", [(1, 2), (1, 7), (2, 3), (3, 1)])
def test_routing_equals_the_loop_rule(top_k, capacity):
  logits = np.random.default_rng(top_k * 10 + capacity).standard_normal((3, 11, 5)) * 2
  routing = route(jnp.asarray(logits, jnp.float32), top_k, capacity)
  expected = numpy_route(logits, top_k, capacity)
  slots = 5 * capacity  # each choice's slot (e * C + c; 5 * C: dropped) as a dense weight
  held = np.eye(slots + 1)[np.asarray(routing.position)][..., :slots]  # (B, L, k, slots)
  dense = np.einsum("blks,blk->bls", held, np.asarray(routing.gates)).reshape(expected.shape)
  np.testing.assert_allclose(dense, expected, rtol=1e-6, atol=1e-7)
  assert float(routing.kept) == (expected > 0).sum()
  # Dispatch and combine move rows: a slot holds its token, a token sums its slots by gate.
  x = jnp.asarray(np.random.default_rng(top_k).standard_normal((3, 11, 4)), jnp.float32)
  slotted = dispatch(x, routing.position, slots)
  np.testing.assert_allclose(slotted, np.einsum("bls,bld->bsd", held.sum(2), x), atol=1e-6)
  np.testing.assert_allclose(combine(slotted, routing),
                             np.einsum("bls,bsd->bld", dense.reshape(3, 11, slots), slotted),
                             rtol=1e-6, atol=1e-6)
  assert float(routing.load.sum()) == 3 * 11 * top_k


def hf_switch(name, tmp_path_factory):
  torch.manual_seed(0)
  config = transformers.SwitchTransformersConfig(dropout_rate=0.0, router_jitter_noise=0.0,
                                                 **SWITCH_CONFIGS[name])
  model = transformers.SwitchTransformersForConditionalGeneration(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.5)  # sharp routers: capacity overflows for real
    # Untied (tie_word_embeddings=false), transformers 5 gives each stack its own input
    # embedding; a trained checkpoint of one table keeps them equal, as t5lite needs.
    model.encoder.embed_tokens.weight.copy_(model.shared.weight)
    model.decoder.embed_tokens.weight.copy_(model.shared.weight)
  path = tmp_path_factory.mktemp(name)
  model.save_pretrained(path)
  return model, path


@pytest.mark.parametrize("name", sorted(SWITCH_CONFIGS))
def test_switch_logits_router_losses_and_round_trip_equal_hf(name, tmp_path_factory, tmp_path):
  model, path = hf_switch(name, tmp_path_factory)
  config, params = t5lite.load_hf(path)
  hf = SWITCH_CONFIGS[name]
  assert config.moe.router_losses == "pooled"
  assert config.moe.expert_capacity == hf["expert_capacity"]
  rng = np.random.default_rng(1)
  inputs = rng.integers(2, hf["vocab_size"], (3, 13))
  labels = rng.integers(2, hf["vocab_size"], (3, 9))
  decoder_inputs = np.concatenate([np.zeros((3, 1), np.int64), labels[:, :-1]], axis=1)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(inputs), decoder_input_ids=torch.tensor(decoder_inputs),
                labels=torch.tensor(labels), output_router_logits=True)
  ours = t5lite.logits(config, params, inputs, decoder_inputs)
  np.testing.assert_allclose(ours, out.logits.numpy(), atol=1e-4)

  batch = {"encoder_input_tokens": inputs, "decoder_input_tokens": decoder_inputs,
           "decoder_target_tokens": labels, "decoder_loss_weights": np.ones((3, 9)),
           "encoder_segment_ids": np.ones((3, 13)), "decoder_segment_ids": np.ones((3, 9))}
  batch = {k: jnp.asarray(v, jnp.float32 if k.endswith("weights") else jnp.int32)
           for k, v in batch.items()}
  # Jitted, as training runs it: op by op, each of the loss's hundreds of ops compiles alone.
  loss_sum, sums = jax.jit(family_of(config).loss_fn)(params, batch, None)
  n = float(sums["normalizer"])
  z = float(out.encoder_z_loss + out.decoder_z_loss)
  aux = float(out.encoder_aux_loss + out.decoder_aux_loss)
  assert abs(float(sums["router_z_loss"]) / n - z) <= 1e-5 * max(1.0, z)
  assert abs(float(sums["router_aux_loss"]) / n - aux) <= 1e-5 * max(1.0, aux)
  assert abs(float(loss_sum) / n - float(out.loss)) <= 1e-5 * float(out.loss)
  if name == "every_layer_untied":  # encoder sparse step 1: HF's pooled losses are 0 there
    assert float(out.encoder_z_loss) == 0.0 and float(out.encoder_aux_loss) == 0.0

  t5lite.save_hf(config, params, tmp_path / "export")
  again = transformers.SwitchTransformersForConditionalGeneration.from_pretrained(
      tmp_path / "export").eval()
  for key, tensor in model.state_dict().items():  # every weight comes back bitwise
    np.testing.assert_array_equal(again.state_dict()[key].numpy(), tensor.numpy(), err_msg=key)
  with torch.no_grad():
    logits = again(input_ids=torch.tensor(inputs),
                   decoder_input_ids=torch.tensor(decoder_inputs)).logits.numpy()
  np.testing.assert_allclose(logits, out.logits.numpy(), atol=1e-6)


def tiny(**moe) -> ModelConfig:
  return ModelConfig(vocab_size=53, d_model=16, d_ff=24, num_heads=2, d_kv=8,
                     num_encoder_layers=3, num_decoder_layers=2, mlp_activation="gated-gelu",
                     moe=MoeConfig(**{"num_experts": 3, **moe}))


def test_per_layer_losses_sum_each_sparse_layer_alone():
  config = tiny(encoder_sparse_step=1, decoder_sparse_step=1, top_k=2)
  params = family_of(config).init_params(3)
  rng = np.random.default_rng(2)
  batch = {"encoder_input_tokens": rng.integers(2, 53, (2, 10)),
           "decoder_input_tokens": rng.integers(2, 53, (2, 6)),
           "decoder_target_tokens": rng.integers(2, 53, (2, 6))}
  batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
  family = family_of(config)
  _, routed = jax.jit(family.forward)(params, batch)
  layers = moe_losses._layers(routed)
  assert [(s, i) for _, s, i, _ in layers] == [("encoder", 0), ("encoder", 1), ("encoder", 2),
                                               ("decoder", 0), ("decoder", 1)]

  def numpy_losses(logits):
    logits = np.asarray(logits, np.float64)
    z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    top = np.argsort(-logits, axis=-1)[..., :2]
    routed = np.zeros_like(probs)
    np.put_along_axis(routed, top, 1.0, axis=-1)
    return z, np.mean(routed.mean(1) * probs.mean(1)) * 3 ** 2

  expected = np.sum([numpy_losses(v["logits"]) for _, _, _, v in layers], axis=0)
  sums_of = jax.jit(moe_losses.router_loss_sums, static_argnums=0)  # one compile, not per op
  _, sums = sums_of(config, routed, jnp.float32(1.0))
  np.testing.assert_allclose([sums["router_z_loss"], sums["router_aux_loss"]], expected,
                             rtol=1e-5)
  pooled = config.replace(moe=MoeConfig(**{**config.moe.to_dict(), "router_losses": "pooled"}))
  _, pooled_sums = sums_of(pooled, routed, jnp.float32(1.0))
  assert float(pooled_sums["router_z_loss"]) == 0.0  # sparse step 1: HF computes none


def test_a_training_step_reports_the_router_figures():
  config = tiny(capacity_factor=0.5, jitter_noise=0.01)
  family = family_of(config)
  params = family.init_params(0)
  rng = np.random.default_rng(3)
  batch = {"encoder_input_tokens": rng.integers(2, 53, (2, 12)),
           "decoder_input_tokens": rng.integers(2, 53, (2, 5)),
           "decoder_target_tokens": rng.integers(2, 53, (2, 5)),
           "decoder_loss_weights": np.ones((2, 5))}
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  # One program for the figures and the gradients.
  (loss, sums), grads = jax.jit(jax.value_and_grad(
      lambda p: family.loss_fn(p, batch, jax.random.key(0)), has_aux=True))(params)
  metrics = family.metrics(sums, sums["normalizer"])
  loads = [float(metrics[f"expert_load_{e}"]) for e in range(3)]
  assert abs(sum(loads) - 1.0) < 1e-6
  # capacity factor 0.5: ceil(0.5 * 12 / 3) = 2 slots of 3 experts for 12 encoder tokens.
  assert float(metrics["dropped_fraction"]) > 0.3
  assert float(metrics["router_z_loss"]) > 0 and float(metrics["router_aux_loss"]) >= 1.0 - 1e-6
  router_grad = grads["encoder"]["layers_1"]["mlp"]["router"]
  assert float(jnp.abs(router_grad).sum()) > 0  # the router learns from the losses


@pytest.mark.parametrize("settings,message", [
    (dict(capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
    (dict(eval_capacity_factor=-1.0), "eval_capacity_factor=-1.0 must be > 0"),
    (dict(top_k=4), "top_k=4 must be between 1 and num_experts=3"),
    (dict(router_losses="mean"), "router_losses='mean' is not one of"),
])
def test_bad_moe_settings_name_both_values(settings, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    MoeConfig(num_experts=3, **settings)


def test_moe_layers_are_not_scanned_and_switch_export_needs_a_fixed_capacity(tmp_path):
  with pytest.raises(ConfigError, match="cannot be scanned or shared"):
    tiny().replace(scan_layers=True)
  config = tiny().replace(mlp_activation="relu")
  with pytest.raises(ConfigError, match="set MoeConfig.top_k=1 and expert_capacity"):
    t5lite.save_hf(config, family_of(config).init_params(0), tmp_path)
  assert ModelConfig.from_json(config.to_json()) == config


def test_separate_stack_embeddings_are_refused_by_name(tmp_path_factory, tmp_path):
  model, _ = hf_switch("every_layer_untied", tmp_path_factory)
  with torch.no_grad():
    model.decoder.embed_tokens.weight.mul_(2.0)
  model.save_pretrained(tmp_path)
  with pytest.raises(ConfigError, match="decoder.embed_tokens.weight differs from shared"):
    t5lite.load_hf(tmp_path)


@pytest.mark.parametrize("experts", [8, 128])
def test_switch_base_files_are_the_published_models(experts):
  """gin/models/switch/base_<E>.gin: HF's parameter count (torch's meta device: nothing
  allocated) and exactly the config that importing google/switch-base-<E>'s config.json gives."""
  from t5lite import count_params
  from t5lite.cli import gin_config
  from t5lite.interop.hf import checkpoints as hf_export
  gin_config.parse([f"gin/models/switch/base_{experts}.gin"])
  ours = gin_config.model_config()
  published = transformers.SwitchTransformersConfig(
      d_ff=3072, num_experts=experts, expert_capacity=64, num_sparse_encoder_layers=6,
      num_sparse_decoder_layers=6)
  with torch.device("meta"):
    model = transformers.SwitchTransformersForConditionalGeneration(published)
  hf_count = sum(p.numel() for p in model.parameters())
  assert count_params(ours) == hf_count == {8: 619_339_008, 128: 7_415_217_408}[experts]
  assert hf_export.config_from_hf(published.to_dict(), tied=True) == ours
  assert hf_export.config_to_hf(ours)["encoder_sparse_step"] == 2


def test_flops_count_top_k_experts_and_the_router():
  """A routed layer costs top_k experts' MLP plus the d x E router per token."""
  dense = tiny(top_k=1).replace(moe=None)
  lengths = {"encoder_input_tokens": 10, "decoder_target_tokens": 6}
  for top_k in (1, 2):
    config = tiny(top_k=top_k)  # step 2: encoder layer 1, decoder layer 1
    extra = family_of(config).flops_per_example(lengths) - family_of(dense).flops_per_example(
        lengths)
    mlp = 3 * 16 * 24  # gated: wi_0, wi_1, wo
    per_token = (top_k - 1) * mlp + 16 * 3
    assert extra == 6 * per_token * (10 + 6)


def test_expert_dropout_and_jitter_act_in_training_only():
  rng = np.random.default_rng(4)
  batch = {"encoder_input_tokens": rng.integers(2, 53, (2, 9)),
           "decoder_input_tokens": rng.integers(2, 53, (2, 4)),
           "decoder_target_tokens": rng.integers(2, 53, (2, 4))}
  batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
  losses = {}
  params = family_of(tiny()).init_params(5)
  for name, settings in (("plain", {}), ("expert_dropout", dict(expert_dropout=0.5)),
                         ("jitter", dict(jitter_noise=0.5))):
    # Training's capacity factor as evaluation's, so that only dropout and jitter differ.
    family = family_of(tiny(capacity_factor=2.0, **settings))
    loss = jax.jit(lambda p, r, f=family: f.loss_fn(p, batch, r)[0])
    losses[name] = (float(jax.jit(lambda p, f=family: f.loss_fn(p, batch, None)[0])(params)),
                    float(loss(params, jax.random.key(1))))
  assert losses["plain"][0] == losses["plain"][1]  # no dropout, no jitter: rng changes nothing
  for name in ("expert_dropout", "jitter"):
    assert losses[name][0] == losses["plain"][0]  # evaluation: neither applies
    assert losses[name][1] != losses[name][0]  # training: it does


def test_electra_pairs_and_distilled_students_train_their_routers(tmp_path):
  """MoE is an option of every family: ELECTRA's generator and discriminator both route (the
  router sums count both networks' choices), and a distilled MoE student adds its router
  losses to the distillation loss (the frozen MoE teacher's routing adds nothing)."""
  from helpers import tiny_decoder_only, tiny_encoder_only
  from helpers.distill import log_softmax, wrap, write_teacher
  from t5lite.families.distillation import DistillationConfig
  rng = np.random.default_rng(6)
  moe = MoeConfig(num_experts=2, top_k=2, encoder_sparse_step=1)
  electra = tiny_encoder_only(family="electra", moe=moe,
                              electra=ElectraConfig(generator_hidden_fraction=0.5))
  tokens = rng.integers(3, 60, (2, 10)).astype(np.int32)
  weights = (rng.random((2, 10)) < 0.3).astype(np.float32)
  batch = {"encoder_input_tokens": tokens, "encoder_segment_ids": np.ones_like(tokens),
           "mlm_target_tokens": tokens, "mlm_loss_weights": weights}
  family = family_of(electra)
  _, sums = jax.jit(family.loss_fn)(family.init_params(0), batch, jax.random.key(0))
  layers = electra.num_encoder_layers
  assert float(sums["router_choices"]) == 2 * 10 * 2 * (layers + layers)  # B x L x k x both

  student_config = tiny_decoder_only(num_decoder_layers=1, moe=moe)
  teacher_config = tiny_decoder_only(num_decoder_layers=2, moe=moe)
  teacher = write_teacher(tmp_path / "teacher", teacher_config)
  student = wrap(student_config, DistillationConfig(teacher=str(tmp_path / "teacher"),
                                                    temperature=3.0, soft_weight=1.0))
  params = student.init_params(1)
  targets = rng.integers(3, 60, (2, 9)).astype(np.int32)
  decoder_inputs = np.concatenate([np.zeros((2, 1), np.int32), targets[:, :-1]], 1)
  batch = dict(decoder_input_tokens=decoder_inputs, decoder_target_tokens=targets,
               decoder_loss_weights=np.ones((2, 9), np.float32),
               decoder_segment_ids=np.ones((2, 9), np.int32))
  loss_sum, sums = jax.jit(lambda p, t: student.loss_fn(p, batch, None, fixed_params=t))(
      params, teacher)
  s = t5lite.logits(student_config, params, decoder_inputs)
  t = t5lite.logits(teacher_config, teacher, decoder_inputs)
  kl = 9 * (np.exp(log_softmax(t / 3)) * (log_softmax(t / 3) - log_softmax(s / 3))).sum(-1).mean()
  n = float(sums["normalizer"])
  router = (moe.aux_loss_coef * float(sums["router_aux_loss"])
            + moe.z_loss_coef * float(sums["router_z_loss"])) / n
  assert float(sums["router_choices"]) == 2 * 9 * 2 * 1  # the student's one sparse layer
  assert float(loss_sum) / n == pytest.approx(kl + router, rel=1e-4)


def test_greedy_decoding_of_an_imported_switch_model_equals_hf_generate(tmp_path_factory):
  """Incremental decoding routes one token at a time (its own capacity): HF does the same.
  (Equal stack depths: transformers 5.24's Switch generate fails with more decoder layers.)"""
  torch.manual_seed(0)
  config = transformers.SwitchTransformersConfig(
      dropout_rate=0.0, router_jitter_noise=0.0, decoder_start_token_id=0,
      **{**SWITCH_CONFIGS["steps_3_2"], "num_decoder_layers": 3})
  model = transformers.SwitchTransformersForConditionalGeneration(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.5)
  path = tmp_path_factory.mktemp("generate")
  model.save_pretrained(path)
  ours_config, params = t5lite.load_hf(path)
  inputs = np.random.default_rng(0).integers(2, 97, (3, 13))
  ours = t5lite.generate(ours_config, params, inputs, max_decode_length=8)
  with torch.no_grad():
    hf = model.generate(torch.tensor(inputs), max_new_tokens=8, min_new_tokens=8,
                        do_sample=False, num_beams=1, eos_token_id=None).numpy()[:, 1:]
  for row, expected in zip(ours, hf):
    end = list(expected).index(1) + 1 if 1 in expected else len(expected)  # through EOS
    np.testing.assert_array_equal(row[:end], expected[:end])


def test_rematerialized_sparse_layers_give_the_same_loss_and_router_sums():
  rng = np.random.default_rng(7)
  batch = {"encoder_input_tokens": rng.integers(2, 53, (2, 9)),
           "decoder_input_tokens": rng.integers(2, 53, (2, 4)),
           "decoder_target_tokens": rng.integers(2, 53, (2, 4))}
  batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
  params = family_of(tiny()).init_params(2)
  plain = jax.jit(lambda p: family_of(tiny()).loss_fn(p, batch, None))(params)
  remat = jax.jit(lambda p: family_of(tiny().replace(remat_policy="full")).loss_fn(
      p, batch, None))(params)
  assert float(remat[0]) == pytest.approx(float(plain[0]), rel=1e-6)
  assert float(remat[1]["router_choices"]) == float(plain[1]["router_choices"]) > 0


def test_the_router_runs_in_float32_in_a_bfloat16_model():
  config = tiny().replace(dtype="bfloat16")
  family = family_of(config)
  batch = {"encoder_input_tokens": jnp.ones((2, 6), jnp.int32),
           "decoder_input_tokens": jnp.ones((2, 3), jnp.int32)}
  out, routed = jax.jit(family.forward)(family.init_params(0), batch)
  assert out.dtype == jnp.float32  # logits
  for _, _, _, values in moe_losses._layers(routed):
    assert values["logits"].dtype == jnp.float32
