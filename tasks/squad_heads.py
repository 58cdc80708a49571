"""SQuAD v1.1 for a BERT-style question-answering head (HF's run_qa), from TFDS or local files.

Each question becomes one example per window of its context, `[CLS] question [SEP] context
window [SEP]`, windows overlapping by doc_stride tokens (t5lite.data.converters.head_features), with
the first answer's token span as start / end_position ([CLS], 0 and 0, in a window without it);
word pieces as BERT's uncased vocabulary has them:

  {"id": "a1", "question": "Who won?", "context": "Bo won the cup.",
   "answers": {"text": ["Bo"], "answer_start": [0]}}
    -> {"inputs": [CLS who won ? SEP bo won the cup . SEP], "token_type_ids":
        [0 0 0 0 0 1 1 1 1 1 1], "start_position": 5, "end_position": 5, "offsets":
        [[-1 -1] x 5, [0 2], [3 6], [7 10], [11 14], [14 15], [-1 -1]], "example_id": "a1",
        "context": "Bo won the cup.", "answers": ["Bo"], "truncated_tokens": 0}

squad_v010_head: a question_answering head (num_labels 2: start and end), evaluated as HF does
(t5lite.eval.qa_postprocess: the best valid span over all windows of a question, SQuAD's
EM / F1 against all its answers). An answer whose text is not at its answer_start in the
context is a ConfigError naming the question's id. Data as tasks/squad.py reads it
($T5LITE_LOCAL_DATA_DIR/squad/v1.1/<split>.jsonl, else TFDS squad/v1.1:3.0.0); vocabulary as
tasks/glue_heads.py (the embedded WordPiece; register_head_tasks for your own).
"""
from __future__ import annotations

from t5lite.data.converters import head_features as hf
from t5lite.data.registry import CACHE_POINT, add_task
from t5lite.eval import qa_postprocess as qa

from . import embedded
from .glue import split_sources
from .squad import TFDS_NAME


def register(vocabulary=None, suffix: str = "", doc_stride: int | None = None) -> None:
  """Registers squad_v010_head<suffix>; doc_stride None: 128, less for short inputs."""
  name = f"squad_v010_head{suffix}"
  add_task(name, split_sources(TFDS_NAME, ("train", "validation"), ("question", "context")),
           hf.head_output_features(vocabulary or embedded.MLM_VOCABULARY),
           (hf.encode_qa(name), CACHE_POINT, hf.qa_windows(name, doc_stride)),
           postprocess_fn=qa.qa_head_postprocess, metric_fns=(qa.squad_head_metric(),),
           head="question_answering", num_labels=2)


register()
