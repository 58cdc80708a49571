"""The pretraining loss equals HF's: BertForPreTraining (MLM + next-sentence) and
AlbertForPreTraining (MLM + sentence order, one group with E == H and two groups with E != H),
given the same batch: tokens, token types, MLM labels (-100 off the chosen positions) and
sentence labels. Random odd-shaped models with every parameter perturbed."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import t5lite  # noqa: E402
from t5lite.families import family_of  # noqa: E402
from helpers.hf_models import make_hf_model  # noqa: E402

pytestmark = pytest.mark.parity


@pytest.mark.parametrize("name", ["bert", "albert_one_group", "albert_two_groups"])
def test_pretraining_loss_equals_hf(name, tmp_path):
  model = make_hf_model(name, seed=3)
  model.save_pretrained(tmp_path)
  config, params = t5lite.load_hf(str(tmp_path))
  rng = np.random.default_rng(4)
  b, length = 3, 19
  ids = rng.integers(2, model.config.vocab_size, (b, length))
  types = rng.integers(0, model.config.type_vocab_size, (b, length))
  chosen = rng.random((b, length)) < 0.3
  chosen[:, 1] = True  # every row predicts something
  targets = rng.integers(2, model.config.vocab_size, (b, length))
  sentence = rng.integers(0, 2, b)
  label_key = "next_sentence_label" if name == "bert" else "sentence_order_label"
  with torch.no_grad():
    hf_loss = model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types),
                    labels=torch.tensor(np.where(chosen, targets, -100)),
                    **{label_key: torch.tensor(sentence)}).loss.item()
  batch = {"encoder_input_tokens": ids, "encoder_token_type_ids": types,
           "encoder_segment_ids": np.ones((b, length), np.int32),
           "encoder_positions": np.broadcast_to(np.arange(length), (b, length)),
           "mlm_target_tokens": targets, "mlm_loss_weights": chosen.astype(np.int32),
           "sentence_labels": sentence}
  loss_sum, sums = family_of(config).loss_fn(params, batch, None)
  ours = float(loss_sum / sums["normalizer"])
  assert abs(ours - hf_loss) < 1e-5, (ours, hf_loss)
