"""GLUE and SuperGLUE in T5's text-to-text format (t5.data.glue_utils), from TFDS or local files.

Each example becomes "<benchmark> <field>: <text> <field>: <text> ..." -> "<label name>":

  glue_cola_v002:  {"sentence": "He left.", "label": 1}
                   -> "cola sentence: He left." -> "acceptable"
  glue_stsb_v002:  {"sentence1": "A", "sentence2": "B", "label": 3.8} -> "stsb sentence1: A
                   sentence2: B" -> "3.8" (rounded to the nearest 0.2)

Tasks: glue_{cola,sst2,mrpc,qqp,stsb,mnli,mnli_matched,mnli_mismatched,qnli,rte,wnli,ax}_v002,
super_glue_{boolq,cb,copa,multirc,record,rte,wic,axb,axg}_v102 and
super_glue_wsc_v102_simple_{train,eval}. Mixtures (examples-proportional, as T5):
glue_v002_proportional (no wnli, no eval-only tasks) and super_glue_v102_proportional.
Not registered: T5's wnli_simple / dpr tasks (heuristic pronoun matching, another dataset).

Data (decided when a split is first read, never at import):
- $T5LITE_LOCAL_DATA_DIR/<tfds name>/<split>.jsonl (.jsonl.gz, <split>-*.jsonl[.gz], or .tsv
  with a header line), e.g. $T5LITE_LOCAL_DATA_DIR/glue/cola/train.jsonl holding lines like
  {"sentence": "He left.", "label": 1, "idx": 0} (TFDS's field names), when that dataset
  folder exists;
- otherwise the TFDS array_record dataset (e.g. glue/cola:2.0.0) in $T5LITE_TFDS_DATA_DIR, or
  TFDS's default data_dir.
Predictions go through T5's postprocess_fn(text, example=None, is_target=False).
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import os
from typing import Any, Callable, Mapping, Sequence

import grain
import numpy as np

from t5lite.data import preprocessors as pp
from t5lite.data.registry import CACHE_POINT, add_mixture, add_task, rate_num_examples
from t5lite.data.sources.readers import JsonlSource, TfdsSource, TsvSource
from t5lite.errors import ConfigError
from t5lite.eval import metrics

from . import vocab

LOCAL_DATA_ENV = "T5LITE_LOCAL_DATA_DIR"
TFDS_DATA_DIR_ENV = "T5LITE_TFDS_DATA_DIR"
GLUE_VERSION, SUPER_GLUE_VERSION = "2.0.0", "1.0.2"  # TFDS versions (T5 read glue 1.0.0)


# ---------------------------------------------------------------- sources (shared by tasks)

def as_text(value: Any) -> str:
  """str of a text field; TFDS gives bytes inside nested sequences. A null (JSON's None)
  is a data error, never the text "None"."""
  if value is None:
    raise ConfigError("a text field is null (None) in a data file; fix or drop that row")
  return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)


def local_dataset_dir(tfds_name: str) -> str | None:
  """$T5LITE_LOCAL_DATA_DIR/<name without version>, if that folder exists."""
  root = os.environ.get(LOCAL_DATA_ENV)
  path = os.path.join(os.path.expanduser(root), tfds_name.split(":")[0]) if root else None
  return path if path and os.path.isdir(path) else None


def _tsv_header(path: str) -> list[str]:
  with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
    return f.readline().rstrip("\r\n").lstrip("\ufeff").split("\t")


def local_source(directory: str, split: str, text_fields: Sequence[str] = ()):
  """The JSONL or TSV files of one split in a local dataset folder. text_fields: the fields
  the task reads as text; a row without one (or with a number or null there) is an error
  naming the file, line and field."""
  for pattern in (f"{split}.jsonl", f"{split}.jsonl.gz", f"{split}-*.jsonl", f"{split}-*.jsonl.gz"):
    if glob.glob(os.path.join(glob.escape(directory), pattern)):
      return JsonlSource(os.path.join(directory, pattern), text_fields=text_fields)
  for name in (f"{split}.tsv", f"{split}.tsv.gz"):
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      header = _tsv_header(path)
      missing = [f for f in text_fields if f not in header]
      if missing:
        raise ConfigError(f"{path}:1: the header {header} has no field "
                          f"{', '.join(map(repr, missing))}")
      return TsvSource(path, header, skip_header=True)
  raise FileNotFoundError(f"no {split}.jsonl, {split}.jsonl.gz, {split}-*.jsonl[.gz] or "
                          f"{split}.tsv in {directory} (from ${LOCAL_DATA_ENV})")


def open_split(tfds_name: str, split: str, text_fields: Sequence[str] = ()):
  """One split's source: local files when $T5LITE_LOCAL_DATA_DIR has the dataset, else TFDS."""
  directory = local_dataset_dir(tfds_name)
  if directory is not None:
    return local_source(directory, split, text_fields)
  return TfdsSource(tfds_name, split, data_dir=os.environ.get(TFDS_DATA_DIR_ENV) or None)


def split_sources(tfds_name: str, splits: Sequence[str],
                  text_fields: Sequence[str] = ()) -> dict[str, Callable]:
  """{split: zero-argument factory}: nothing is looked up until a split is read. text_fields
  are checked in each row of local files (see local_source)."""
  return {split: functools.partial(open_split, tfds_name, split, tuple(text_fields))
          for split in splits}


# ---------------------------------------------------------------- preprocessors

def glue(benchmark: str, label_names: Sequence[str] | None,
         fields: Sequence[str | tuple[str, str]]) -> Callable:
  """T5's `glue` preprocessor: "<benchmark> name: text ..." -> label name ("<unk>" for -1).

  fields are feature names in T5's order (sorted, unless T5 fixes one), or (name shown,
  feature read) pairs. MultiRC also drops <br> / <b> markup and keeps its idx parts.
  Example (qqp): {"question1": "Why?", "question2": "How?", "label": 1, "idx": 10}
    -> {"inputs": "qqp question1: Why? question2: How?", "targets": "duplicate", "idx": 10}
  """
  fields = [(f, f) if isinstance(f, str) else tuple(f) for f in fields]

  def apply(ex: dict) -> dict:
    parts = [benchmark]
    for shown, key in fields:
      parts += [f"{shown}:", as_text(ex[key])]
    inputs = " ".join(parts)
    label = int(ex.get("label", -1))  # TSV files give "1"; unlabeled test files none
    out = {"targets": "<unk>" if label == -1 else label_names[label]}
    if benchmark == "multirc":
      inputs = inputs.replace("<br>", " ").replace("<b>", "").replace("</b>", "")
      out.update({f"idx/{k}": int(ex["idx"][k]) for k in ("paragraph", "question", "answer")})
    elif "idx" in ex:
      out["idx"] = ex["idx"]
    return {"inputs": inputs, **out}
  apply.__name__ = f"glue_{benchmark}"
  return apply


def stsb(ex: dict) -> dict:
  """STS-B: the score rounded to the nearest 0.2 as text, half to even in float32 like TF.

  Example: {"sentence1": "A", "sentence2": "B", "label": 3.25, "idx": 0}
    -> {"inputs": "stsb sentence1: A sentence2: B", "targets": "3.2", "idx": 0}
    (label 0.5 -> "0.4": 2.5 rounds to 2)
  """
  value = np.round(np.float32(ex["label"]) * np.float32(5)) / np.float32(5)
  return {"inputs": f"stsb sentence1: {as_text(ex['sentence1'])} sentence2: "
                    f"{as_text(ex['sentence2'])}",
          "targets": f"{value:.1f}", "idx": ex.get("idx", -1)}


def record_passage(ex: dict) -> dict:
  """ReCoRD, formatted: "record query: Q entities: a, b passage: P" -> the answer; its
  "@highlight" lines become sentences. Runs after record_per_answer.

  Example: {"query": "@placeholder flies.", "entities": ["Bo", "Al"], "passage":
    "Bo is here.\\n@highlight\\nAl left", "answers": ["Bo"], "targets": "Bo",
    "idx": {"passage": 3, "query": 7}}
    -> {"inputs": "record query: @placeholder flies. entities: Bo, Al passage: Bo is here.
        Al left", "targets": "Bo", "answers": ["Bo"], "idx/passage": 3, "idx/query": 7}
  """
  passage = as_text(ex["passage"])
  # A headline that ends a sentence joins with a space, others with ". " (T5's two regexes).
  for end in ".?!\"'":
    passage = passage.replace(f"{end}\n@highlight\n", f"{end} ")
  passage = passage.replace("\n@highlight\n", ". ")
  entities = ", ".join(as_text(e) for e in ex["entities"])
  return {"inputs": f"record query: {as_text(ex['query'])} entities: {entities} passage: {passage}",
          "targets": ex["targets"], "answers": [as_text(a) for a in ex["answers"]],
          "idx/passage": int(ex["idx"]["passage"]), "idx/query": int(ex["idx"]["query"])}


class _PerAnswer(grain.experimental.FlatMapTransform):
  max_fan_out = 1 << 10

  def flat_map(self, ex):
    answers = [as_text(a) for a in ex["answers"]] or ["<unk>"]
    return [{**ex, "targets": answer} for answer in answers]


@pp.stream_preprocessor
def record_per_answer(ds: grain.IterDataset) -> grain.IterDataset:
  """ReCoRD: one example per answer (T5 trains on each), "<unk>" targets when there is none.

  Example: {"answers": ["Bo", "Bob"], ...} -> {..., "targets": "Bo"}, {..., "targets": "Bob"}
  """
  return grain.experimental.FlatMapIterDataset(ds, _PerAnswer())


# T5's two hand-fixed WSC texts, whose span2_index points at the wrong word.
_WSC_FIXED = {
    'The boy continued to whip the pony , and eventually the pony threw him over. John laughed '
    'out quite loud. "Good for him," he said. ':
    'The boy continued to whip the pony , and eventually the pony threw him over. John laughed '
    'out quite loud. "Good for X ," he said.',
    'When they had eventually calmed down a bit , and had gotten home, Mr. Farley put the magic '
    'pebble in an iron safe . Some day they might want to use it , but really for now, what '
    'more could they wish for?':
    'When they had eventually calmed down a bit , and had gotten home, Mr. Farley put the magic '
    'pebble in an iron safe . Some day they might want to use X , but really for now, what '
    'more could they wish for?',
}


def wsc_simple(ex: dict) -> dict:
  """T5's simple WSC: the pronoun (word span2_index) marked with *, target = the referent.

  Example: {"text": "Mitchell asked Tom if he could lend some money.", "span1_text": "Tom",
    "span2_text": "he", "span2_index": 4, "label": 1, "idx": 0}
    -> {"inputs": "wsc: Mitchell asked Tom if *he* could lend some money.",
        "targets": "Tom", "label": 1, "idx": 0}
  """
  text, pronoun = as_text(ex["text"]), as_text(ex["span2_text"])
  if text in _WSC_FIXED:
    marked = _WSC_FIXED[text]
  else:
    words, i = text.split(" "), int(ex["span2_index"])
    if not 0 < i < len(words) or words[i] != pronoun:
      raise ValueError(f"wsc: word {i} of {text!r} is not {pronoun!r}")
    marked = " ".join(words[:i] + ["X"] + words[i + 1:])
  return {"inputs": "wsc: " + marked.replace(" X ", f" *{pronoun}* "),
          "targets": as_text(ex["span1_text"]), "label": int(ex.get("label", 0)),
          "idx": ex.get("idx", -1)}


def is_correct_referent(ex: dict) -> bool:
  """WSC training keeps only examples whose span1 is the pronoun's referent (label 1)."""
  return bool(int(ex.get("label", 0)))


# ---------------------------------------------------------------- postprocessors

def string_label_to_class_id(label_names: Sequence[str]) -> Callable:
  """Decoded text -> index in label_names, -1 if it is none of them."""
  def postprocess(text: str, example=None, is_target: bool = False) -> int:
    return list(label_names).index(text) if text in label_names else -1
  postprocess.__name__ = "string_label_to_class_id"
  return postprocess


def string_to_float(text: str, example=None, is_target: bool = False) -> float:
  """"3.8" -> 3.8; text that is no number -> -1.0."""
  try:
    return float(text)
  except ValueError:
    return -1.0


def multirc_postprocess(text: str, example=None, is_target: bool = False) -> dict:
  """{"value": class id}, plus the question ("group") for targets, for per-question EM."""
  value = string_label_to_class_id(("False", "True"))(text)
  if is_target:
    return {"value": value, "group": (example["idx/paragraph"], example["idx/question"])}
  return {"value": value}


def record_postprocess(text: str, example=None, is_target: bool = False) -> dict:
  """Targets: all answers of the query (its group); predictions: the text."""
  if is_target:
    return {"value": list(example["answers"]),
            "group": (example["idx/passage"], example["idx/query"])}
  return {"value": text}


def wsc_simple_postprocess(text: str, example=None, is_target: bool = False) -> int:
  """Targets: the label; predictions: 1 if the text names the marked referent, else 0
  (ignoring case and determiners; "Bob" is not "Bob's hat")."""
  if is_target:
    return int(example["label"])
  determiners = {"a", "an", "few", "her", "his", "each", "every", "many", "much", "my", "our",
                 "some", "that", "the", "their", "these", "this", "those", "which", "whose",
                 "your"}
  clean = lambda s: " ".join(w for w in s.strip().lower().split(" ") if w not in determiners)
  referent, prediction = clean(as_text(example["targets_pretokenized"])), clean(text)
  if ("'" in prediction) != ("'" in referent):
    return 0
  predicted, wanted = set(prediction.split(" ")), set(referent.split(" "))
  return int(predicted <= wanted or wanted <= predicted)


# ---------------------------------------------------------------- registration

@dataclasses.dataclass(frozen=True)
class Benchmark:
  """One TFDS config and how T5 casts it."""
  config: str
  labels: tuple[str, ...] | None
  fields: tuple = ()
  metric_fns: tuple = ()
  splits: tuple[str, ...] = ("train", "validation", "test")
  text_name: str | None = None  # the name in the inputs text, when not the config's


_NLI = ("entailment", "neutral", "contradiction")
_RTE = ("entailment", "not_entailment")
_BOOL = ("False", "True")
_HP = ("hypothesis", "premise")
_MNLI_EVAL = ("validation", "test")

GLUE = (
    Benchmark("cola", ("unacceptable", "acceptable"), ("sentence",), (metrics.matthews_corrcoef,)),
    Benchmark("sst2", ("negative", "positive"), ("sentence",), (metrics.accuracy,)),
    Benchmark("mrpc", ("not_equivalent", "equivalent"), ("sentence1", "sentence2"),
              (metrics.f1_score_with_invalid, metrics.accuracy)),
    Benchmark("qqp", ("not_duplicate", "duplicate"), ("question1", "question2"),
              (metrics.f1_score_with_invalid, metrics.accuracy)),
    Benchmark("stsb", None, (), (metrics.pearson_corrcoef, metrics.spearman_corrcoef)),
    Benchmark("mnli", _NLI, _HP, (metrics.accuracy,),
              ("train", "validation_matched", "validation_mismatched", "test_matched",
               "test_mismatched")),
    Benchmark("mnli_matched", _NLI, _HP, (metrics.accuracy,), _MNLI_EVAL, "mnli"),
    Benchmark("mnli_mismatched", _NLI, _HP, (metrics.accuracy,), _MNLI_EVAL, "mnli"),
    Benchmark("qnli", _RTE, ("question", "sentence"), (metrics.accuracy,)),
    Benchmark("rte", _RTE, ("sentence1", "sentence2"), (metrics.accuracy,)),
    Benchmark("wnli", ("not_entailment", "entailment"), ("sentence1", "sentence2"),
              (metrics.accuracy,)),
    Benchmark("ax", _NLI, _HP, (), ("test",), "mnli"),  # diagnostics: test only
)

SUPER_GLUE = (
    Benchmark("boolq", _BOOL, ("passage", "question"), (metrics.accuracy,)),
    Benchmark("cb", ("entailment", "contradiction", "neutral"), _HP,
              (metrics.mean_multiclass_f1(3), metrics.accuracy)),
    Benchmark("copa", ("choice1", "choice2"), ("choice1", "choice2", "premise", "question"),
              (metrics.accuracy,)),
    Benchmark("multirc", _BOOL, ("question", "answer", "paragraph"),
              (metrics.multirc_f1_over_all_answers,
               metrics.mean_group_metric(metrics.exact_match))),
    Benchmark("record", None, (), (metrics.deduplicate_metric(metrics.squad),)),
    Benchmark("rte", _RTE, _HP, (metrics.accuracy,)),
    Benchmark("wic", _BOOL, ("sentence1", "sentence2", "word"), (metrics.accuracy,)),
    # Diagnostics, cast as RTE; axb names its fields sentence1 / sentence2.
    Benchmark("axb", _RTE, (("hypothesis", "sentence2"), ("premise", "sentence1")), (),
              ("test",), "rte"),
    Benchmark("axg", _RTE, _HP, (), ("test",), "rte"),
)

_TAIL = (pp.tokenize, CACHE_POINT, pp.append_eos_after_trim)


def _text_steps(b: Benchmark) -> tuple:
  if b.config == "stsb":
    return (stsb,)
  if b.config == "record":
    return (record_per_answer, record_passage)
  return (glue(b.text_name or b.config, b.labels, b.fields),)


def _postprocess(b: Benchmark) -> Callable:
  return {"stsb": string_to_float, "multirc": multirc_postprocess,
          "record": record_postprocess}.get(b.config) or string_label_to_class_id(b.labels)


def _text_fields(b: Benchmark) -> tuple[str, ...]:
  """The features a benchmark's preprocessor reads as text."""
  special = {"stsb": ("sentence1", "sentence2"), "record": ("passage", "query")}
  return special.get(b.config) or tuple(f if isinstance(f, str) else f[1] for f in b.fields)


def _add(name: str, tfds_name: str, b: Benchmark, features: Mapping) -> None:
  add_task(name, split_sources(tfds_name, b.splits, _text_fields(b)), features,
           _text_steps(b) + _TAIL, postprocess_fn=_postprocess(b), metric_fns=b.metric_fns)


def register(vocabulary=None) -> None:
  """Registers the GLUE and SuperGLUE tasks and mixtures (at import, with T5's vocabulary)."""
  features = vocab.default_output_features(vocabulary)
  for b in GLUE:
    _add(f"glue_{b.config}_v002", f"glue/{b.config}:{GLUE_VERSION}", b, features)
  for b in SUPER_GLUE:
    _add(f"super_glue_{b.config}_v102", f"super_glue/{b.config}:{SUPER_GLUE_VERSION}", b,
         features)
  wsc = f"super_glue/wsc.fixed:{SUPER_GLUE_VERSION}"
  wsc_text = ("text", "span1_text", "span2_text")
  add_task("super_glue_wsc_v102_simple_train", split_sources(wsc, ("train",), wsc_text),
           features, (pp.filter_by(is_correct_referent), wsc_simple) + _TAIL)
  add_task("super_glue_wsc_v102_simple_eval",
           split_sources(wsc, ("validation", "test"), wsc_text), features,
           (wsc_simple,) + _TAIL, postprocess_fn=wsc_simple_postprocess,
           metric_fns=(metrics.accuracy,))
  # T5 leaves wnli out (it trains on WSC instead); eval-only tasks have no train split.
  glue_train = [f"glue_{b.config}_v002" for b in GLUE if "train" in b.splits and b.config != "wnli"]
  add_mixture("glue_v002_proportional", [(t, rate_num_examples) for t in glue_train])
  super_glue_train = [f"super_glue_{b.config}_v102" for b in SUPER_GLUE if "train" in b.splits]
  add_mixture("super_glue_v102_proportional",
              [(t, rate_num_examples)
               for t in super_glue_train + ["super_glue_wsc_v102_simple_train"]])


register()
