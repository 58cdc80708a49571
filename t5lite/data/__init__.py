"""seqio-like data layer on grain: vocabularies, sources, preprocessors, objectives, tasks,
feature converters with packing, and deterministic, resumable, topology-independent batches.

Stable API: span_corruption(tokens, *, seed, vocab_size, ...) and span_corruption_lengths().
Modules: vocabularies (+ hf_vocabularies: BERT WordPiece, GPT-2 / RoBERTa byte-level BPE),
sources (+ tfds_source, tfrecord), preprocessors, corruption (T5 span corruption), objectives
(MLM, prefix LM, text infilling), pretraining (objective chains), registry (Task, Mixture),
converters (packing), rows (each batch row's stream), pipeline
(batches; workers computes rows in worker processes), cache, describe.
"""
from t5lite.data.objectives.span_corruption import span_corruption, span_corruption_lengths
from t5lite.data.pipeline import PipelineConfig, get_dataset
from t5lite.data.registry import (CACHE_POINT, Feature, Mixture, MixtureRegistry, Task,
                                  TaskRegistry, add_mixture, add_task, get_mixture_or_task)
# hf_vocabularies and tokenizer_json register their kinds with load_vocabulary on import
# (vocabularies.py cannot import them: they import it), and every import of t5lite.data runs
# this first. tokenizer_json comes second: an HF folder with vocab.txt or vocab.json +
# merges.txt (and a tokenizer.json too) keeps loading as WordPiece / byte-level BPE.
from t5lite.data.vocab.hf_vocabularies import ByteLevelBPEVocabulary, WordPieceVocabulary
from t5lite.data.vocab.hf_training import train_byte_level_bpe, train_wordpiece
from t5lite.data.vocab.tokenizer_json import TokenizerJsonVocabulary
from t5lite.data.vocab.vocabularies import (ByteVocabulary, SentencePieceVocabulary, Vocabulary,
                                      train_sentencepiece)

__all__ = [
    "span_corruption", "span_corruption_lengths", "PipelineConfig", "get_dataset",
    "CACHE_POINT", "Feature", "Mixture", "MixtureRegistry", "Task", "TaskRegistry", "add_task",
    "add_mixture", "get_mixture_or_task", "Vocabulary", "SentencePieceVocabulary",
    "TokenizerJsonVocabulary",
    "ByteVocabulary", "train_sentencepiece", "WordPieceVocabulary", "ByteLevelBPEVocabulary",
    "train_wordpiece", "train_byte_level_bpe",
]
