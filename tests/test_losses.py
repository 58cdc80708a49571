"""Cross entropy, label smoothing, z-loss and loss normalization against numpy references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite.models import losses


def reference_token_loss(logits, targets, smoothing, z_loss):
  """T5X's formula with explicit soft targets, in float64."""
  logits = logits.astype(np.float64)
  vocab = logits.shape[-1]
  log_z = np.log(np.sum(np.exp(logits), axis=-1))
  log_q = logits - log_z[..., None]
  confidence, low = 1 - smoothing, smoothing / (vocab - 1)
  soft = np.full(logits.shape, low)
  np.put_along_axis(soft, targets[..., None], confidence, axis=-1)
  entropy = -(confidence * np.log(confidence) + (vocab - 1) * low * np.log(low + 1e-20))
  return -np.sum(soft * log_q, axis=-1) - entropy + z_loss * log_z ** 2


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
def test_token_loss_matches_reference(smoothing, z_loss):
  rng = np.random.RandomState(0)
  logits = rng.randn(3, 5, 11).astype(np.float32) * 3
  targets = rng.randint(0, 11, (3, 5))
  loss, z = losses.cross_entropy(jnp.asarray(logits), jnp.asarray(targets),
                                 label_smoothing=smoothing, z_loss=z_loss)
  np.testing.assert_allclose(loss, reference_token_loss(logits, targets, smoothing, z_loss),
                             rtol=1e-5, atol=1e-5)
  log_z = np.log(np.sum(np.exp(logits.astype(np.float64)), -1))
  np.testing.assert_allclose(z, z_loss * log_z ** 2, rtol=1e-5)


def test_docstring_example_and_perfect_smoothed_prediction():
  loss, _ = losses.cross_entropy(jnp.zeros((1, 2)), jnp.array([0]))
  np.testing.assert_allclose(loss, [np.log(2)], rtol=1e-6)
  # Logits equal to log of the smoothed target distribution score (about) zero.
  smoothing, vocab = 0.1, 4
  probs = np.full(vocab, smoothing / (vocab - 1))
  probs[2] = 1 - smoothing
  loss, _ = losses.cross_entropy(jnp.log(jnp.asarray(probs))[None], jnp.array([2]),
                                 label_smoothing=smoothing)
  np.testing.assert_allclose(loss, [0.0], atol=1e-5)


def test_gradient_is_softmax_minus_onehot():
  logits = jnp.asarray(np.random.RandomState(1).randn(4, 7).astype(np.float32))
  targets = jnp.array([0, 3, 6, 2])
  grad = jax.grad(lambda x: jnp.sum(losses.cross_entropy(x, targets)[0]))(logits)
  expected = jax.nn.softmax(logits) - jax.nn.one_hot(targets, 7)
  np.testing.assert_allclose(grad, expected, atol=1e-6)


def test_normalizers():
  rng = np.random.RandomState(2)
  logits = jnp.asarray(rng.randn(2, 4, 9).astype(np.float32))
  targets = jnp.asarray(rng.randint(0, 9, (2, 4)))
  weights = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]], jnp.float32)
  token = np.asarray(losses.cross_entropy(logits, targets)[0])
  total = float(np.sum(token * np.asarray(weights)))
  run = lambda f, **kw: float(losses.weighted_cross_entropy(
      logits, targets, weights, loss_normalizing_factor=f, **kw)["loss"])
  np.testing.assert_allclose(run(losses.NUM_REAL_TARGET_TOKENS), total / 4, rtol=1e-6)
  np.testing.assert_allclose(run(losses.NUM_TOTAL_TARGET_TOKENS), total / 8, rtol=1e-6)
  np.testing.assert_allclose(run(None), total, rtol=1e-6)
  np.testing.assert_allclose(run(100.0), total / 100, rtol=1e-6)
  per_sequence = (token[0, :3].mean() + token[1, 0]) / 2
  np.testing.assert_allclose(run(losses.AVERAGE_PER_SEQUENCE), per_sequence, rtol=1e-6)
  # Packed: row 0 holds two segments; each segment weighs 1.
  segments = jnp.array([[1, 1, 2, 0], [1, 0, 0, 0]])
  packed = (token[0, :2].mean() + token[0, 2] + token[1, 0]) / 3
  np.testing.assert_allclose(run(losses.AVERAGE_PER_SEQUENCE, segment_ids=segments), packed,
                             rtol=1e-6)
  out = losses.weighted_cross_entropy(logits, targets, jnp.zeros_like(weights))
  assert float(out["loss"]) == 0.0 and float(out["weight_sum"]) == 0.0
  with pytest.raises(ValueError, match="loss_normalizing_factor"):
    run("PER_TOKEN")


def test_token_accuracy():
  logits = jnp.array([[[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]])
  targets = jnp.array([[1, 1, 0]])
  np.testing.assert_allclose(losses.token_accuracy(logits, targets), 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(losses.token_accuracy(logits, targets, jnp.array([[1, 1, 0]])), 0.5)
