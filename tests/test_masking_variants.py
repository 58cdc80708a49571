"""Masking variants (t5lite.data.objectives.masking): statistics over many draws, word boundaries,
80/10/10 per token or per span, the span boundary features. Numpy only: fast."""
import numpy as np
import pytest

from t5lite.data.objectives import masking
from t5lite.data.vocab.hf_vocabularies import WordPieceVocabulary
from t5lite.errors import ConfigError

PAD, UNK, CLS, SEP, MASK = range(5)
WORDS, PIECES = 500, 500  # ids 5..504 begin words, 505..1004 are `##` continuations
PIECE_LIST = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(WORDS)]
              + [f"##c{i}" for i in range(PIECES)])
TABLE = masking.TokenTable.from_pieces(PIECE_LIST, "wordpiece", range(5), MASK)


def sentence(rng, words, max_pieces=3):
  """[CLS] words of 1..max_pieces pieces [SEP], and each token's word number (-1: special)."""
  tokens, word_of = [CLS], [-1]
  for w in range(words):
    n = int(rng.integers(1, max_pieces + 1))
    tokens += [5 + int(rng.integers(WORDS))] + [5 + WORDS + int(rng.integers(PIECES))
                                                 for _ in range(n - 1)]
    word_of += [w] * n
  return np.array(tokens + [SEP], np.int32), np.array(word_of + [-1])


def test_word_boundaries_of_each_piece_scheme():
  wp = masking.TokenTable.from_pieces(["[CLS]", "cat", "##s", "sat"], "wordpiece", [0], 0)
  sp = masking.TokenTable.from_pieces(["<pad>", "\u2581the", "re", ",", "\u2581cat"],
                                      "sentencepiece", [0], 0, vocab_size=7)
  bpe = masking.TokenTable.from_pieces(["<s>", "\u0120the", "re", "\u0120cat"],
                                       "byte_level_bpe", [0], 0)
  assert wp.word_start.tolist() == [True, True, False, True]
  assert sp.word_start.tolist() == [True, True, False, False, True, True, True]  # extra ids
  assert sp.special.tolist() == [True, False, False, False, False, True, True]
  assert bpe.word_start.tolist() == [True, True, False, True]
  # A continuation piece after a special token starts a word; the first token always does.
  assert masking.word_starts(np.array([2, 0, 2, 1, 3]), wp).tolist() == [True] * 2 + [
      True, True, True]
  assert 0 not in wp.replacements
  with pytest.raises(ConfigError, match="unknown word scheme"):
    masking.TokenTable.from_pieces(["a"], "bytes", [], 0)


def test_table_from_a_wordpiece_vocabulary():
  vocab = WordPieceVocabulary(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "cat", "##s"])
  table = masking.TokenTable.from_vocabulary(vocab)
  assert table.word_start.tolist() == [True] * 6 + [False] and table.mask_id == 4
  assert table.replacements.tolist() == [5, 6]


def check_common(out, tokens, word_of):
  """Specials never chosen; replacements never special; whole words only."""
  chosen = out["weights"] > 0
  assert (out["targets"] == tokens).all() and not chosen[word_of < 0].any()
  replaced = chosen & (out["inputs"] != MASK)
  assert not TABLE.special[out["inputs"][replaced]].any()
  for w in np.unique(word_of[chosen]):
    assert chosen[word_of == w].all()  # every piece of a chosen word
  return chosen


@pytest.mark.parametrize("kind", ["whole_word", "ngram", "span"])
def test_budget_whole_words_and_80_10_10(kind):
  rng = np.random.default_rng(0)
  fn = masking.MASKINGS[kind]
  chosen_total = eligible_total = 0
  actions = {"mask": 0, "random": 0, "keep": 0}
  spans_mixed = 0
  for _ in range(300):
    tokens, word_of = sentence(rng, 60)
    out = fn(tokens, rng, TABLE)
    chosen = check_common(out, tokens, word_of)
    eligible = int((word_of >= 0).sum())
    assert chosen.sum() <= masking.budget(eligible, 0.15)
    chosen_total += chosen.sum()
    eligible_total += eligible
    masked = out["inputs"] == MASK
    actions["mask"] += int((chosen & masked).sum())
    actions["random"] += int((chosen & ~masked & (out["inputs"] != tokens)).sum())
    actions["keep"] += int((chosen & (out["inputs"] == tokens)).sum())
    if kind == "span":  # one draw per span: a span is all [MASK] or none of it
      for o in np.flatnonzero(out["span_offset"] == 1):
        end = o + 1
        while end < len(tokens) and out["span_offset"][end] > 1:
          end += 1
        spans_mixed += len(set(masked[o:end].tolist())) > 1
  assert 0.145 < chosen_total / eligible_total < 0.152  # round(0.15 n) per sequence
  total = sum(actions.values())
  # Random tokens equal to the original (1 in 1000) count as kept: within tolerance.
  assert abs(actions["mask"] / total - 0.8) < 0.03
  assert abs(actions["random"] / total - 0.1) < 0.025
  assert abs(actions["keep"] / total - 0.1) < 0.025
  assert spans_mixed == 0


def spans_of(kind, words=1000, draws=40):
  """(number of words of each span but the last, which the budget shortens)."""
  draw = {"span": masking._span_words, "ngram": masking._ngram_words}[kind]
  rng, sizes = np.random.default_rng(1), []
  for _ in range(draws):
    spans = masking.choose_spans(np.ones(words, int), np.ones(words, bool), 150, rng, draw)
    sizes += [n for _, n in spans[:-1]]
    starts = sorted(s for s, _ in spans)
    assert sum(n for _, n in spans) == 150
    covered = np.concatenate([np.arange(s, s + n) for s, n in spans])
    assert len(np.unique(covered)) == covered.size  # never overlapping
  return np.array(sizes)


def test_span_lengths_follow_the_clipped_geometric():
  sizes = spans_of("span")
  pmf = 0.2 * 0.8 ** np.arange(10)
  pmf /= pmf.sum()
  assert sizes.max() <= 10 and abs(sizes.mean() - 3.8) < 0.15
  observed = np.bincount(sizes, minlength=11)[1:] / sizes.size
  assert np.abs(observed - pmf).max() < 0.03


def test_ngram_sizes_are_proportional_to_one_over_n():
  sizes = spans_of("ngram")
  observed = np.bincount(sizes, minlength=4)[1:] / sizes.size
  np.testing.assert_allclose(observed, [6 / 11, 3 / 11, 2 / 11], atol=0.03)


def test_span_boundary_features():
  rng = np.random.default_rng(2)
  for length_words in (3, 11, 30):  # odd sizes: spans run into [CLS] / [SEP] and the end
    for _ in range(30):
      tokens, word_of = sentence(rng, length_words)
      out = masking.span_mask(tokens, rng, TABLE)
      offset, chosen = out["span_offset"], out["weights"] > 0
      assert ((offset > 0) == chosen).all()
      for i in np.flatnonzero(chosen):
        start = i - offset[i] + 1
        # Spans may touch (as SpanBERT's): a boundary may be the next span's token.
        assert out["span_left"][i] == start - 1 and offset[start] == 1
        right = out["span_right"][i]
        assert right <= len(tokens) - 1 and (offset[start:right] > 0).all()
        assert right == len(tokens) - 1 or offset[right] in (0, 1)  # the span ends there
      for key in ("span_left", "span_right", "span_offset"):
        assert out[key].dtype == np.int32 and (out[key][~chosen] == 0).all()


def test_worked_example_of_the_docstring():
  pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"p{i}" for i in range(5, 16)]
  pieces[12] = "##s"
  table = masking.TokenTable.from_pieces(pieces, "wordpiece", range(5), 4)
  tokens = np.array([2, 10, 11, 12, 13, 14, 10, 15, 3])
  for seed in range(200):
    out = masking.span_mask(tokens, np.random.default_rng(seed), table, mask_rate=0.3)
    if out["weights"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0]:
      assert out["span_left"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 0]
      assert out["span_right"].tolist() == [0, 0, 4, 4, 0, 0, 0, 0, 0]
      assert out["span_offset"].tolist() == [0, 0, 1, 2, 0, 0, 0, 0, 0]
      break
  else:
    pytest.fail("the span over `cat ##s` never came")


@pytest.mark.parametrize("length", [1, 2, 13, 37])
def test_odd_lengths_and_token_masking(length):
  rng = np.random.default_rng(length)
  tokens = np.concatenate([[CLS], 5 + rng.integers(0, 2 * WORDS, max(length - 2, 0)), [SEP]])[:length]
  for kind, fn in masking.MASKINGS.items():
    out = fn(tokens.astype(np.int32), rng, TABLE)
    assert {k: v.shape for k, v in out.items()} == {k: (len(tokens),) for k in out}, kind
    assert out["weights"].sum() <= max(1, round(0.15 * (tokens >= 5).sum()))


def test_masking_step_keeps_other_features_and_adds_cls_sep():
  class Feature:
    vocabulary = WordPieceVocabulary(PIECE_LIST)
  rng = np.random.default_rng(3)
  ex = {"targets": np.arange(5, 25, dtype=np.int32), "token_type_ids": np.zeros(20, np.int32),
        "sentence_label": np.int32(1)}
  out = masking.masking_step("span")(ex, rng, {"targets": Feature})
  assert out["token_type_ids"] is ex["token_type_ids"] and out["sentence_label"] == 1
  assert out["weights"].sum() == 3 and "span_offset" in out
  out = masking.masking_step("whole_word", add_cls_sep=True)(ex, rng, {"targets": Feature})
  assert out["targets"][0] == CLS and out["targets"][-1] == SEP and len(out["inputs"]) == 22
  with pytest.raises(ConfigError, match="unknown kind"):
    masking.masking_step("spans")


def test_one_mlm_chain_takes_every_masking_as_its_kind():
  """mlm_preprocessors is the one MLM chain: kind picks a masking variant; options that only
  the default token masking has are refused for the variants, and unknown kinds by name."""
  from t5lite.data.objectives.chains import mlm_preprocessors
  from t5lite.errors import ConfigError
  steps = mlm_preprocessors(kind="span", add_cls_sep=True)
  assert steps[-1].__name__ == "masking_step(span)"
  with pytest.raises(ConfigError, match="kind=None"):
    mlm_preprocessors(kind="span", mask_id=5)
  with pytest.raises(ConfigError, match="unknown kind 'spans'"):
    mlm_preprocessors(kind="spans")
