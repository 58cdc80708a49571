"""Incremental decoding: the cache against full recomputation, HF generate parity, the
decoding methods' contracts, EOS handling and scoring."""
import functools

import jax
import numpy as np
import pytest
import torch

import t5lite
from t5lite.models import init_params, make_model
from t5lite.models.decoding import search as decoding
from t5lite.models.decoding.beam import beam_search, top_k_by_blocks
from t5lite.models.params import abstract_params, scan_params, unscan_params

from helpers import hf_generate, hf_t5, tiny

MAX = 7
CONFIGS = {
    "enc_dec_relative_bias": tiny(),
    "decoder_only_rope": tiny(architecture="decoder_only", position_encoding="rope"),
    "prefix_lm_relative_bias": tiny(architecture="decoder_only", prefix_lm=True),
}


def prompts(seed=0, batch=3, length=9, vocab=128):
  """Non-zero ids, rows right-padded to different lengths (one full, one of length 1)."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(2, vocab, (batch, length))
  tokens[1, 5:] = 0
  tokens[2, 1:] = 0
  return tokens


@functools.lru_cache(maxsize=None)
def forward(config):
  """The training-path model.apply (no cache) jitted, the params an argument: one compile per
  config and input shapes, shared by every test and reference here (eager, each of its
  hundreds of ops would compile apart, again for every new shape)."""
  model = make_model(config)
  return jax.jit(lambda params, *args, **kwargs: model.apply({"params": params}, *args,
                                                             **kwargs))


def full_forward_logits(config, params, inputs, targets):
  """Reference: next-token logits (B, T, V) at each target position, one whole-sequence
  forward pass per row, no cache."""
  apply = forward(config)
  if config.architecture == "encoder_decoder":
    decoder_inputs = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]
    return np.asarray(apply(params, inputs, decoder_inputs))
  rows = []
  for prompt, target in zip(inputs, targets):
    prompt = prompt[prompt > 0]
    seq = np.concatenate([[0], prompt, target[:-1]])  # BOS, prompt, shifted targets
    # Zeros after it, which no earlier position attends to (causal): every row has one shape,
    # one compiled program.
    seq = np.pad(seq, (0, inputs.shape[1] + targets.shape[1] - len(seq)))[None]
    extra = {}
    if config.prefix_lm:
      extra["decoder_causal_attention"] = (np.arange(seq.shape[1]) < len(prompt) + 1)[None]
    logits = np.asarray(apply(params, seq, **extra))[0]
    rows.append(logits[len(prompt):len(prompt) + targets.shape[1]])
  return np.stack(rows)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
  config = CONFIGS[request.param]
  return config, init_params(config, 1)


def test_cached_logits_equal_full_recomputation(model):
  config, params = model
  inputs = prompts()
  targets = np.random.RandomState(1).randint(2, 128, (3, MAX))
  cached = decoding.teacher_forced_logits(config, params, inputs, targets)
  reference = full_forward_logits(config, params, inputs, targets)
  np.testing.assert_allclose(cached, reference, rtol=1e-5, atol=1e-5)


def test_score_is_the_full_forward_log_likelihood(model):
  config, params = model
  inputs = prompts(2)
  # MAX long, as elsewhere here: the score and the reference reuse programs compiled for it.
  targets = np.random.RandomState(3).randint(2, 128, (3, MAX))
  targets[:, -1] = 1
  targets[0, 3:] = [1, 0, 0, 0]  # a shorter target: padding is not scored
  log_probs = jax.nn.log_softmax(full_forward_logits(config, params, inputs, targets), -1)
  picked = np.take_along_axis(np.asarray(log_probs), targets[:, :, None], -1)[:, :, 0]
  expected = np.sum(picked * (targets > 0), axis=1)
  np.testing.assert_allclose(decoding.score(config, params, inputs, targets), expected,
                             rtol=1e-5, atol=1e-4)


def test_decoding_methods_contracts():
  """Sampling and the method switch are architecture-independent: one config covers them."""
  config = CONFIGS["enc_dec_relative_bias"]
  params = init_params(config, 1)
  inputs = prompts(4)
  greedy = t5lite.generate(config, params, inputs, max_decode_length=MAX)
  assert greedy.shape == (3, MAX) and greedy.dtype == np.int32
  same = lambda **kw: t5lite.generate(config, params, inputs, max_decode_length=MAX, **kw)
  np.testing.assert_array_equal(same(method="beam", num_beams=1), greedy)
  np.testing.assert_array_equal(same(method="sample", temperature=0.0), greedy)
  np.testing.assert_array_equal(same(method="sample", top_k=1, seed=5), greedy)
  np.testing.assert_array_equal(same(method="sample", top_p=1e-6, seed=5), greedy)
  sample = same(method="sample", seed=3)
  np.testing.assert_array_equal(same(method="sample", seed=3), sample)
  assert not np.array_equal(same(method="sample", seed=4), sample)


def test_rows_decode_as_they_would_alone(model):
  """Rows of different prompt lengths in one batch give what each gives alone (in a batch of
  copies of itself: no other row there, and the batch's shape, so its compiled program);
  and each greedy token is the argmax of the cached logits that teacher forcing sees."""
  config, params = model
  inputs = prompts(5)
  for method in ("greedy", "beam"):
    batch = t5lite.generate(config, params, inputs, max_decode_length=MAX, method=method)
    for row in range(len(inputs)):
      alone = np.repeat(inputs[row:row + 1], len(inputs), 0)
      np.testing.assert_array_equal(t5lite.generate(
          config, params, alone, max_decode_length=MAX, method=method),
          np.repeat(batch[row:row + 1], len(inputs), 0))
    if method == "greedy":
      logits = decoding.teacher_forced_logits(config, params, inputs, batch)
      np.testing.assert_array_equal(np.argmax(logits, -1), batch)


def with_eos_for(config, params, token):
  """Params whose output projection swaps `token` and EOS: the model now says EOS (1) wherever
  it said `token`, with every other logit unchanged."""
  params = jax.tree_util.tree_map(np.array, params)
  kernel = params["decoder"]["logits_dense"]["kernel"]
  kernel[:, [1, token]] = kernel[:, [token, 1]]
  return params


def test_eos_stops_a_row_and_pads_it_with_zeros():
  config = CONFIGS["enc_dec_relative_bias"]
  params = init_params(config, 2)
  inputs = prompts(6)
  greedy = t5lite.generate(config, params, inputs, max_decode_length=MAX)
  assert not np.any(greedy == 1)
  # Row 0 ends at the first step whose token did not appear before in the batch's outputs.
  step = next(i for i in range(1, MAX) if greedy[0, i] not in greedy[:, :i])
  eos_params = with_eos_for(config, params, int(greedy[0, step]))
  for method in ("greedy", "beam"):
    out = t5lite.generate(config, eos_params, inputs, max_decode_length=MAX, method=method)
    for row in out:
      ends = np.flatnonzero(row == 1)
      if len(ends):
        assert not np.any(row[ends[0] + 1:])
    if method == "greedy":
      np.testing.assert_array_equal(out[0, :step + 1], np.append(greedy[0, :step], 1))
      assert not np.any(out[0, step + 1:])


def test_beam_search_keeps_finished_hypotheses_and_scores_them():
  config = CONFIGS["enc_dec_relative_bias"]
  params = init_params(config, 3)
  inputs = prompts(7)
  greedy = t5lite.generate(config, params, inputs, max_decode_length=MAX)
  eos_params = with_eos_for(config, params, int(greedy[0, 2]))

  @jax.jit
  def run(params, tokens):
    prefill = decoding.start(config, params, tokens, MAX, copies=3)
    return beam_search(prefill, num_beams=3, max_decode_length=MAX, alpha=0.6)

  seqs, scores = run(eos_params, inputs)
  seqs, scores = np.asarray(seqs), np.asarray(scores)
  assert np.all(np.diff(scores, axis=1) <= 0)  # best first
  # Finished hypotheses' scores are their log-likelihoods over T5X's length penalty.
  # Scored a whole batch at a time: the (3, MAX) score program other tests compile too.
  finished = 0
  for k in range(3):
    lls = decoding.score(config, eos_params, inputs, seqs[:, k])
    for b in range(len(inputs)):
      if 1 in seqs[b, k]:
        length = int(np.flatnonzero(seqs[b, k] == 1)[0]) + 1
        np.testing.assert_allclose(scores[b, k], lls[b] / ((5 + length) / 6) ** 0.6, rtol=1e-4)
        finished += 1
  assert finished  # the swapped-in EOS ended some hypotheses: their scores were checked
  assert np.array_equal(seqs[:, 0], t5lite.generate(config, eos_params, inputs,
                                                    max_decode_length=MAX, method="beam",
                                                    num_beams=3))


@pytest.fixture
def unscan_only_under_jit(monkeypatch):
  """decoding's unscan_params, failing when it gets concrete arrays (a second copy of every
  layer, made outside jit); yields its calls. The test that uses it is the first here to
  decode a scanned config: its programs are traced with the stand-in in place."""
  calls = []

  def traced_only(params):
    leaves = jax.tree_util.tree_leaves(params)
    assert all(isinstance(leaf, jax.core.Tracer) for leaf in leaves), "sliced outside jit"
    calls.append(len(leaves))
    return unscan_params(params)

  monkeypatch.setattr(decoding, "unscan_params", traced_only)
  yield calls


def scanned(config, params):
  """The same model with scan_layers=True: (config, params stacked per layer stack)."""
  config = config.replace(scan_layers=True)
  return config, scan_params(params, config)


def test_scanned_params_decode_and_score_exactly_the_same(model, unscan_only_under_jit):
  """Decoding, scoring and teacher forcing of stacked layers; and the stacks are sliced only
  inside jit."""
  config, params = model
  scanned_model = scanned(config, params)
  inputs = prompts(8)
  for method in ("greedy", "beam"):
    out = t5lite.generate(config, params, inputs, max_decode_length=MAX, method=method)
    np.testing.assert_array_equal(
        t5lite.generate(*scanned_model, inputs, max_decode_length=MAX, method=method), out)
  np.testing.assert_array_equal(decoding.score(*scanned_model, inputs, out),
                                decoding.score(config, params, inputs, out))
  np.testing.assert_array_equal(decoding.teacher_forced_logits(*scanned_model, inputs, out),
                                decoding.teacher_forced_logits(config, params, inputs, out))
  assert unscan_only_under_jit  # the stand-in was used: it saw the stacks, as tracers


def test_decoding_holds_no_copy_of_the_scanned_layers():
  """Compiled for stacks of 19 MB of layers, greedy decoding's temporaries stay far below
  one copy of them (2 MB): XLA slices each layer where it is read. XLA:CPU's default
  scheduler would make all the slices up front (19 MB of temporaries); `t5lite bench decode
  --memory` measures the RSS."""
  config = tiny(d_model=256, d_ff=1024, num_heads=4, d_kv=64, scan_layers=True)
  params = abstract_params(config)
  layers = sum(x.size * x.dtype.itemsize for stack in ("encoder", "decoder")
               for x in jax.tree_util.tree_leaves(params[stack]["layers"]))
  run = decoding.jitted_generate(config, "greedy", MAX, (("temperature", 0.0),))
  tokens = jax.ShapeDtypeStruct((4, 16), np.int32)
  stats = run.lower(params, tokens, jax.random.key(0)).compile().memory_analysis()
  assert layers > 15e6 and stats.temp_size_in_bytes < layers / 4, (stats, layers)


def make_hf_model(seed=0, vocab=101):
  """A random T5 v1.1-style model (gated-GELU, untied lm_head), as in test_hf.py. Equal
  depths: transformers 5.x generate sizes its cache by the encoder depth."""
  return hf_t5(seed, vocab, d_model=32, d_kv=8, d_ff=48, num_heads=4, num_layers=2,
               num_decoder_layers=2, relative_attention_num_buckets=8,
               relative_attention_max_distance=20, feed_forward_proj="gated-gelu",
               tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
               eos_token_id=1)


@pytest.mark.parity
def test_greedy_matches_hf_generate(tmp_path):
  model = make_hf_model()
  # Make EOS the greedy choice somewhere, so stopping and padding are compared too.
  model.save_pretrained(tmp_path)
  config, params = t5lite.load_hf(str(tmp_path))
  inputs = prompts(9, batch=4, length=12, vocab=101)
  ours = t5lite.generate(config, params, inputs, max_decode_length=10)
  np.testing.assert_array_equal(
      ours, hf_generate(model, inputs, 10, do_sample=False, num_beams=1))
  token = int(ours[1, 3])
  with torch.no_grad():  # swap lm_head rows: EOS wherever the model said `token`
    model.lm_head.weight[[1, token]] = model.lm_head.weight[[token, 1]].clone()
  model.save_pretrained(tmp_path / "eos")
  config, params = t5lite.load_hf(str(tmp_path / "eos"))
  ours = t5lite.generate(config, params, inputs, max_decode_length=10)
  assert np.any(ours == 1)
  np.testing.assert_array_equal(
      ours, hf_generate(model, inputs, 10, do_sample=False, num_beams=1))


def reference_beam_search(config, params, inputs, beams, max_len, alpha):
  """T5X's beam search written plainly, per example, with no cache: every step recomputes
  the whole decoder for each live beam. Returns the best hypothesis per example."""
  apply = functools.partial(forward(config), params)
  penalty = lambda length: ((5.0 + length) / 6.0) ** alpha
  out = np.zeros((len(inputs), max_len), np.int32)
  for b, x in enumerate(inputs):
    live, finished = [(0.0, ())], []  # (log-probability, tokens), (score, tokens)
    for i in range(max_len):
      # Always `beams` rows (unused ones all start tokens): one shape, one compiled forward.
      dec = np.zeros((beams, max_len), np.int32)  # start token 0, then the beam's tokens
      for k, (_, tokens) in enumerate(live):
        dec[k, 1:i + 1] = tokens
      logits = np.asarray(apply(np.repeat(x[None], beams, 0), dec))[:len(live), i]
      log_probs = np.asarray(jax.nn.log_softmax(logits, -1))
      candidates = sorted(((lp + log_probs[k, v], tokens + (v,))
                           for k, (lp, tokens) in enumerate(live)
                           for v in range(log_probs.shape[1])), key=lambda c: -c[0])[:2 * beams]
      finished = sorted(finished + [(lp / penalty(i + 1), t) for lp, t in candidates
                                    if t[-1] == 1], key=lambda c: -c[0])[:beams]
      live = [(lp, t) for lp, t in candidates if t[-1] != 1][:beams]
    best = finished[0][1] if finished else live[0][1]
    out[b, :len(best)] = best
  return out


# No length penalty and a strong one run in `make test`; T5X's usual 0.6 in both.
@pytest.mark.parametrize("alpha", [pytest.param(0.0, marks=pytest.mark.slow), 0.6,
                                   pytest.param(3.0, marks=pytest.mark.slow)])
def test_beam_search_equals_a_cache_free_reference(alpha):
  config = CONFIGS["enc_dec_relative_bias"]
  params = init_params(config, 5)
  inputs = prompts(10)
  greedy = t5lite.generate(config, params, inputs, max_decode_length=MAX)
  # EOS in place of the most frequent greedy token: hypotheses finish at many lengths.
  counts = np.bincount(greedy.ravel(), minlength=config.vocab_size)
  counts[:2] = 0  # not pad (a random model may say 0) nor EOS
  eos_params = with_eos_for(config, params, int(counts.argmax()))
  ours = t5lite.generate(config, eos_params, inputs, max_decode_length=MAX, method="beam",
                         num_beams=3, alpha=alpha)
  np.testing.assert_array_equal(
      ours, reference_beam_search(config, eos_params, inputs, 3, MAX, alpha))


@pytest.mark.e2e
@pytest.mark.slow
def test_generate_and_score_inside_a_mesh():
  """Sharded params (logical axis rules over a data x tensor mesh of fake CPU devices)."""
  import flax.linen as nn
  from jax.sharding import AxisType
  from t5lite.models import param_logical_axes
  config = CONFIGS["enc_dec_relative_bias"]
  params = init_params(config, 6)
  inputs = prompts(11, batch=4)
  expected = t5lite.generate(config, params, inputs, max_decode_length=MAX, method="beam")
  mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
  rules = (("batch", "data"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"))
  sharded = jax.device_put(params, nn.logical_to_mesh_sharding(param_logical_axes(config),
                                                               mesh, rules))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    out = t5lite.generate(config, sharded, inputs, max_decode_length=MAX, method="beam")
    scores = decoding.score(config, sharded, inputs, out)
  np.testing.assert_array_equal(out, expected)
  np.testing.assert_allclose(scores, decoding.score(config, params, inputs, out), rtol=1e-5)


@pytest.mark.parametrize("shape,k", [((32, 32128), 8), ((5, 1000), 8), ((3, 130), 2),
                                     ((2, 64), 8)])
def test_top_k_by_blocks_equals_lax_top_k_with_ties(shape, k):
  rng = np.random.default_rng(sum(shape))
  for x in (rng.standard_normal(shape), np.round(rng.standard_normal(shape) * 2)):  # ties
    x = x.astype(np.float32)
    values, index = jax.jit(top_k_by_blocks, static_argnums=1)(x, k)
    expected_values, expected_index = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(values, expected_values)
    np.testing.assert_array_equal(index, expected_index)
