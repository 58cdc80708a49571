"""Incremental decoding with a key/value cache (greedy, sampling, beam search) and scoring.

Design
  * The model runs in decode mode, `make_model(config, cache_length=T)`: every decoder
    self-attention keeps its keys and values in a 'cache' variable collection of T slots
    (slot = position, preallocated), and cross-attention projects the encoder output once, at
    the prefill call, and reuses it. The training path (cache_length 0) is untouched.
  * `start` runs the encoder once and the prompt through the decoder (the prefill): for an
    encoder-decoder the start token (ModelConfig.bos_id, T5's 0) at position 0; for a
    decoder-only model BOS followed by the prompt at positions 0..n, as
    DecoderOnlyFeatureConverter feeds training rows (the targets shifted right with BOS first;
    for a prefix LM the prompt is the bidirectional prefix). Decoding stops at
    ModelConfig.eos_id.
    It returns the first next-token logits, the cache, each row's next position and a `step`
    function that feeds one token per row.
  * One jitted program per (config, decoding settings, batch, input length, max length):
    encoder + prefill + a `lax.while_loop` over output positions that stops at
    max_decode_length or once every row has emitted EOS (beam search: see beam.py).
  * Decoder-only prompts are left-aligned and right-padded with 0. Each row continues from
    its own length: per-row positions (RoPE angles, relative-bias offsets) and per-row cache
    slots, so a row decodes exactly as it would alone; stale slots past a row's position are
    masked until overwritten.
  * Output: (B, max_decode_length) int32 generated tokens without the start token, the EOS
    included (HF `generate` output with the start token stripped), 0 after EOS.
  * Params go in as stored, scanned or not. Decoding runs unscanned layers (the cache is per
    layer): every program slices the scanned stacks itself (`layer_params`), next to each use,
    and on CPU compiles with XLA's memory-optimized scheduler, which makes each slice just
    before it is read and frees it after. Slicing outside jit would hold a second copy of
    every layer for the whole call (`t5lite bench decode --memory` measures both).

Everything is plain jnp under jax.jit without device assumptions: call it inside a mesh with
sharded params and it runs there.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from t5lite.errors import ConfigError
from t5lite.models import adapters
from t5lite.models.decoding.beam import beam_search
from t5lite.models.config import ModelConfig
from t5lite.models.decoding.types import EOS_ID, PAD_ID, Prefill
from t5lite.models.network import make_model
from t5lite.models.params import Params, unscan_params

METHODS = ("greedy", "sample", "beam")
# XLA:CPU's default scheduler starts every op as early as its inputs allow: all the layer
# slices of a program (or of a loop step) at its top, alive together, a full copy of the
# layers. This one orders them by their use.
CPU_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def decoding_config(config: ModelConfig) -> ModelConfig:
  """The config decoding runs: unscanned layers (the cache is per layer), no remat, no dropout.
  Its programs still take the params of `config` as stored (see `layer_params`)."""
  if config.has_encoder and not config.has_decoder:
    raise ConfigError("decoding needs a decoder: got an encoder_only config")
  return config.replace(scan_layers=False, remat_policy="none", dropout_rate=0.0)


def layer_params(params: Params) -> Params:
  """params with one entry per layer (layers_0, layers_1, ...), as the decoding config's
  modules read them; scanned stacks are sliced, unscanned params pass as they are.

  Call under jit, right where the params are applied (in each decoder step, not once before a
  loop): XLA then slices next to each read, while slices made outside jit (or carried into a
  loop) are a second copy of every layer for the whole call.
  """
  return unscan_params(params)


def _jit(fn: Callable) -> Callable:
  """jax.jit for a decoding program: on CPU with CPU_COMPILER_OPTIONS, so that its layer
  slices are made one by one where they are read (measured no slower than the default)."""
  cpu = jax.default_backend() == "cpu"
  return jax.jit(fn, compiler_options=CPU_COMPILER_OPTIONS if cpu else None)


def prompt_lengths(tokens: jax.Array) -> jax.Array:
  """Length of each left-aligned, 0-padded row: last non-zero index + 1. (B, L) -> (B,)."""
  index = jnp.arange(1, tokens.shape[1] + 1, dtype=jnp.int32)
  return jnp.max(jnp.where(tokens > 0, index, 0), axis=1)


def start(config: ModelConfig, params: Params, inputs: jax.Array, max_decode_length: int,
          copies: int = 1) -> Prefill:
  """Encoder (once) and prefill for inputs (B, L); every row repeated `copies` times
  (consecutively: rows b*copies .. b*copies + copies - 1, for beam search). config and params
  are the model's as stored (scanned or not): each apply slices the layers it reads, the
  returned `step` too, so that a loop over `step` slices in its body. Call under jit."""
  config = decoding_config(config)
  inputs = inputs.astype(jnp.int32)
  # Positions that get fed: the start token and all outputs but the last (never fed back),
  # after a decoder-only model's BOS + prompt: max_decode_length (+ L) of them. Past the
  # learned table, jnp.take would clamp silently, so it is an error.
  longest = max_decode_length + (0 if config.has_encoder else inputs.shape[1])
  if not config.has_encoder:  # a soft prompt or a prefix comes first (adapters)
    longest += adapters.position_shift(config)
  if (config.position_encoding == "learned"
      and longest + config.position_offset > config.max_position_embeddings):
    after = "" if config.has_encoder else f" after BOS and a prompt of {inputs.shape[1]}"
    raise ConfigError(f"decoding max_decode_length={max_decode_length} tokens{after} reaches "
                      f"position {longest - 1 + config.position_offset}, past the learned "
                      f"position table of max_position_embeddings="
                      f"{config.max_position_embeddings}: decode fewer tokens or shorten the "
                      "prompts")
  if config.architecture == "encoder_decoder":
    model = make_model(config, cache_length=max_decode_length)
    encoder_segment_ids = (inputs > 0).astype(jnp.int32)  # the encoder masks padding, as T5X
    encoded = model.apply({"params": layer_params(params)}, inputs, encoder_segment_ids,
                          method="encode")
    batch = encoded.shape[0] * copies
    # Encoded once per example: cross-attention keeps one K/V cache row per example and
    # folds the example's `copies` decoder rows into its query axis. The mask is per row.
    encoder_segment_ids = jnp.repeat(encoder_segment_ids, copies, axis=0)  # (B*copies, L)

    def step(cache, tokens, positions):
      variables = {"params": layer_params(params)}
      if cache is not None:
        variables["cache"] = cache
      logits, mutated = model.apply(variables, encoded, encoder_segment_ids, tokens[:, None],
                                    None, positions[:, None], method="decode", mutable=["cache"])
      return logits[:, 0].astype(jnp.float32), mutated["cache"]

    zeros = jnp.zeros((batch,), jnp.int32)
    logits, cache = step(None, zeros + config.bos_id, zeros)  # the start token at position 0
    return Prefill(logits, cache, zeros + 1, step)

  # (B, 1 + L): BOS, then the prompt
  tokens = jnp.pad(inputs, ((0, 0), (1, 0)), constant_values=config.bos_id)
  batch, length = tokens.shape
  lengths = prompt_lengths(inputs) + 1  # (B,) with the BOS
  # Prompt tuning's soft tokens take the cache's first slots.
  model = make_model(config, cache_length=(length + max_decode_length
                                           + adapters.prompt_tokens(config)))
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
  causal = (positions < lengths[:, None]).astype(jnp.int32) if config.prefix_lm else None
  # Logits only after each row's last prompt token (later positions saw padding).
  logits, mutated = model.apply({"params": layer_params(params)}, tokens, None, positions,
                                causal, logits_at=lengths - 1, prefill=True,
                                mutable=["cache"])  # (B, 1, V)
  logits, cache = logits[:, 0], mutated["cache"]
  if copies > 1:  # the prompt runs once per example; its copies start from the same cache
    logits, cache, lengths = jax.tree_util.tree_map(
        lambda x: jnp.repeat(x, copies, axis=0), (logits, cache, lengths))

  def step(cache, tokens, positions):
    logits, mutated = model.apply({"params": layer_params(params), "cache": cache},
                                  tokens[:, None], None, positions[:, None], mutable=["cache"])
    return logits[:, 0].astype(jnp.float32), mutated["cache"]

  return Prefill(logits.astype(jnp.float32), cache, lengths, step)


def greedy_tokens(logits: jax.Array) -> jax.Array:
  """argmax over the last axis (first index among ties), (B, V) -> (B,) int32.

  As a max and a min over the matching indices: XLA:CPU runs jnp.argmax's (value, index)
  reduction about 3x slower than two plain reductions (0.67 vs 0.21 ms for (8, 32128)),
  about as slow as the logits GEMM of a decoding step itself.
  """
  best = jnp.max(logits, axis=-1, keepdims=True)
  index = jnp.arange(logits.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(logits == best, index, logits.shape[-1]), axis=-1)


def choose_tokens(logits: jax.Array, rng: jax.Array, *, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """Next tokens (B,) from logits (B, V): argmax at temperature 0, else a sample from
  softmax(logits / temperature) restricted to the top_k tokens (0: all), then to the smallest
  set whose probability reaches top_p (the most likely token always stays)."""
  if temperature == 0.0:
    return greedy_tokens(logits)
  logits = logits.astype(jnp.float32) / temperature
  if 0 < top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # (B, 1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]  # (B, V) descending
    probs = jax.nn.softmax(ordered, axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < top_p  # mass before a token is below top_p
    threshold = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def sample_loop(prefill: Prefill, max_decode_length: int, rng: jax.Array, *,
                eos_id: int = EOS_ID, **choose: Any) -> jax.Array:
  """Greedy (temperature 0) or sampled decoding until max_decode_length or every row's EOS.
  Returns (B, max_decode_length) int32, 0 after each row's EOS. Step i draws with
  fold_in(rng, i), so a seed fixes the output."""
  batch = prefill.logits.shape[0]
  token = choose_tokens(prefill.logits, jax.random.fold_in(rng, 0), **choose)
  out = jnp.zeros((batch, max_decode_length), jnp.int32).at[:, 0].set(token)

  def cond(state):
    i, _, _, _, done = state
    return (i < max_decode_length) & ~jnp.all(done)

  def body(state):
    i, token, cache, out, done = state
    # Token i-1 sits at position positions + i - 1; finished rows keep feeding padding.
    logits, cache = prefill.step(cache, token, prefill.positions + i - 1)
    token = choose_tokens(logits, jax.random.fold_in(rng, i), **choose)
    token = jnp.where(done, PAD_ID, token)
    out = jax.lax.dynamic_update_slice(out, token[:, None], (0, i))
    return i + 1, token, cache, out, done | (token == eos_id)

  state = (jnp.int32(1), token, prefill.cache, out, token == eos_id)
  return jax.lax.while_loop(cond, body, state)[3]


def teacher_forced_logits(config: ModelConfig, params: Params, encoder_input_tokens,
                          target_tokens) -> np.ndarray:
  """Logits (B, T, V) for target_tokens (B, T) fed one position at a time through the cache:
  what decoding sees when it produces exactly these targets (a check of the cache against
  the full forward pass, and a cheap way to score candidates token by token)."""
  return to_host(_jitted_teacher_forced(config)(
      params, jnp.asarray(encoder_input_tokens, jnp.int32), jnp.asarray(target_tokens, jnp.int32)))


@functools.lru_cache(maxsize=16)
def _jitted_teacher_forced(config: ModelConfig):
  decoding_config(config)  # an encoder-only config fails here, before tracing

  @_jit
  def run(params, inputs, targets):
    prefill = start(config, params, inputs, targets.shape[1])

    def body(cache, t):
      logits, cache = prefill.step(cache, targets[:, t - 1], prefill.positions + t - 1)
      return cache, logits

    _, rest = jax.lax.scan(body, prefill.cache, jnp.arange(1, targets.shape[1]))
    return jnp.concatenate([prefill.logits[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
  return run


# --- the public entry points ----------------------------------------------------------------

def to_host(x) -> np.ndarray:
  """x as a NumPy array on this process. Under a mesh that spans several processes, outputs
  are sharded over all of their devices (e.g. batch rows over 'data'), which no process can
  read alone: those are all-gathered first, a collective that every process must call (each
  runs the same decode, so each does)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def _check_tokens(tokens, name: str) -> np.ndarray:
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"{name} must be a (batch, length) integer array, got {tokens.dtype} "
                     f"{tokens.shape}")
  return tokens.astype(np.int32)


def generate(config: ModelConfig, params: Params, encoder_input_tokens, *,
             max_decode_length: int, method: str = "greedy", num_beams: int = 4,
             alpha: float = 0.6, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0) -> np.ndarray:
  """Decodes up to max_decode_length tokens per row; returns them as (B, max_decode_length)
  int32, without the start token, EOS (1) included, 0 after EOS.

  encoder_input_tokens (B, L), 0-padded: the encoder inputs (padding masked, as T5X), or for
  a decoder-only model left-aligned prompts of any lengths (the output is the continuation).
  method: 'greedy'; 'sample' (softmax(logits / temperature), top_k 0 = off, top_p 1 = off;
  temperature 0 is greedy; deterministic given seed); 'beam' (num_beams, T5X's length penalty
  ((5 + len) / 6) ** alpha; one beam is greedy search, as in HF).
  """
  if method not in METHODS:
    raise ConfigError(f"method={method!r} is not one of {METHODS}")
  if max_decode_length < 1:
    raise ConfigError(f"max_decode_length must be positive, got {max_decode_length}")
  if method == "beam" and num_beams < 1:
    raise ConfigError(f"num_beams must be positive, got {num_beams}")
  if method == "sample" and (temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0):
    raise ConfigError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got "
                      f"{temperature}, {top_k}, {top_p}")
  tokens = _check_tokens(encoder_input_tokens, "encoder_input_tokens")
  # Canonical settings: one compiled program per distinct behaviour.
  if (method == "sample" and temperature == 0.0) or (method == "beam" and num_beams == 1):
    method = "greedy"
  settings = {"greedy": dict(temperature=0.0),
              "sample": dict(temperature=float(temperature), top_k=int(top_k),
                             top_p=float(top_p)),
              "beam": dict(num_beams=int(num_beams), alpha=float(alpha))}[method]
  run = jitted_generate(config, method, int(max_decode_length), tuple(sorted(settings.items())))
  return to_host(run(params, tokens, jax.random.key(seed)))


@functools.lru_cache(maxsize=32)
def jitted_generate(config: ModelConfig, method: str, max_decode_length: int,
                     settings: tuple):
  """`generate_program` jitted (with CPU_COMPILER_OPTIONS on CPU): the fn(params, tokens, rng)
  -> ids behind `generate`, cached per argument set."""
  return _jit(generate_program(config, method, max_decode_length, settings))


def generate_program(config: ModelConfig, method: str, max_decode_length: int,
                     settings: tuple) -> Callable:
  """The traceable fn(params, tokens, rng) -> ids that `generate` runs (settings: sorted (name,
  value) pairs). config is the model's own (scan_layers as trained): fn takes the params as
  stored. The serving export traces this same function under its own jit, where JAX refuses
  a nested jit's compiler options."""
  decoding_config(config)  # an encoder-only config fails here, before tracing
  settings = dict(settings)

  def run(params, tokens, rng):
    if method == "beam":
      prefill = start(config, params, tokens, max_decode_length, copies=settings["num_beams"])
      seqs, _ = beam_search(prefill, max_decode_length=max_decode_length,
                            eos_id=config.eos_id, **settings)
      return seqs[:, 0]
    prefill = start(config, params, tokens, max_decode_length)
    return sample_loop(prefill, max_decode_length, rng, eos_id=config.eos_id, **settings)
  return run


def score(config: ModelConfig, params: Params, encoder_input_tokens, target_tokens
          ) -> np.ndarray:
  """Per-example sum of target log-likelihoods (B,) float32, from one full forward pass.

  target_tokens (B, T): each row ends with EOS and is 0-padded (padding is not scored). For
  an encoder-decoder the decoder reads the targets shifted right; for a decoder-only model
  the targets follow each row's prompt (left-aligned, 0-padded), as in `generate`.
  """
  inputs = _check_tokens(encoder_input_tokens, "encoder_input_tokens")
  targets = _check_tokens(target_tokens, "target_tokens")
  if inputs.shape[0] != targets.shape[0]:
    raise ValueError(f"batch sizes differ: {inputs.shape} vs {targets.shape}")
  return to_host(_jitted_score(config)(params, inputs, targets))


@functools.lru_cache(maxsize=16)
def _jitted_score(config: ModelConfig):
  config = decoding_config(config)
  model = make_model(config)

  @_jit
  def run(params, inputs, targets):
    params = layer_params(params)  # one pass, no loop: each slice is made next to its read
    if config.architecture == "encoder_decoder":
      decoder_inputs = jnp.pad(targets, ((0, 0), (1, 0)),  # shifted right, BOS first
                               constant_values=config.bos_id)[:, :-1]
      logits = model.apply({"params": params}, inputs, decoder_inputs)  # (B, T, V)
      labels, weights = targets, targets > 0
    else:
      logits, labels, weights = _decoder_only_logits(model, config, params, inputs, targets)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, labels[:, :, None], axis=-1)[:, :, 0]
    return jnp.sum(jnp.where(weights, picked, 0.0), axis=1)
  return run


def _decoder_only_logits(model, config, params, prompts, targets):
  """Row b reads [BOS, prompt_b, targets_b] (each row packed to its own lengths) and is scored
  on targets_b. Returns logits (B, L + T, V), labels and weights (B, L + T)."""
  batch, length = prompts.shape
  total = length + targets.shape[1]
  n = prompt_lengths(prompts)[:, None]  # (B, 1)
  pos = jnp.arange(total, dtype=jnp.int32)[None, :]  # (1, L + T)
  # Scatter-free packing: position p holds prompt[p] before n, then targets[p - n].
  from_prompt = jnp.pad(prompts, ((0, 0), (0, total - length)))  # (B, L + T)
  from_targets = jnp.take_along_axis(jnp.pad(targets, ((0, 0), (0, total))),
                                     jnp.maximum(pos - n, 0), axis=1)
  labels = jnp.where(pos < n, from_prompt, from_targets)  # (B, L + T)
  weights = (pos >= n) & (labels > 0)
  decoder_inputs = jnp.pad(labels, ((0, 0), (1, 0)), constant_values=config.bos_id)[:, :-1]
  extra = {}
  if config.prefix_lm:
    extra["decoder_causal_attention"] = (pos < n + 1).astype(jnp.int32)
  logits = model.apply({"params": params}, decoder_inputs, **extra)
  return logits, labels, weights
