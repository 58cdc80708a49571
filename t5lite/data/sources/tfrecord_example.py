"""tf.train.Example without TensorFlow: the message classes built at runtime, and a parser.

The wire format is all that matters, so the six messages are declared here with
`google.protobuf` (in a private descriptor pool, package `t5lite.tf`, so nothing clashes
with TensorFlow's or tfds's own copies if those are imported too):

  Example{Features features=1}   Features{map<string, Feature> feature=1}
  Feature{oneof kind {BytesList bytes_list=1; FloatList float_list=2; Int64List int64_list=3}}
  BytesList{repeated bytes value=1}  FloatList{repeated float value=1}  (packed)
  Int64List{repeated int64 value=1}  (packed)
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto


def _add_field(message, name: str, number: int, kind: int, label: int = _F.LABEL_OPTIONAL,
               type_name: str | None = None, oneof: int | None = None) -> None:
  """Adds one field to a DescriptorProto."""
  field = message.field.add(name=name, number=number, type=kind, label=label)
  if type_name:
    field.type_name = type_name
  if oneof is not None:
    field.oneof_index = oneof


@functools.cache
def example_classes() -> dict[str, type]:
  """{"Example": cls, "Features": cls, "Feature": cls, ...} from a runtime-built descriptor."""
  # proto3: repeated numeric fields are packed by default, as in TensorFlow's feature.proto
  # (parsing accepts packed and unpacked encodings either way).
  fdp = descriptor_pb2.FileDescriptorProto(name="t5lite/tf_example.proto", package="t5lite.tf",
                                           syntax="proto3")
  rep = _F.LABEL_REPEATED
  for name, kind in (("BytesList", _F.TYPE_BYTES), ("FloatList", _F.TYPE_FLOAT),
                     ("Int64List", _F.TYPE_INT64)):
    _add_field(fdp.message_type.add(name=name), "value", 1, kind, rep)
  feature = fdp.message_type.add(name="Feature")
  feature.oneof_decl.add(name="kind")
  for number, name in ((1, "BytesList"), (2, "FloatList"), (3, "Int64List")):
    field_name = name.replace("List", "_list").lower()
    _add_field(feature, field_name, number, _F.TYPE_MESSAGE, type_name=f".t5lite.tf.{name}",
               oneof=0)
  features = fdp.message_type.add(name="Features")
  entry = features.nested_type.add(name="FeatureEntry")
  entry.options.map_entry = True
  _add_field(entry, "key", 1, _F.TYPE_STRING)
  _add_field(entry, "value", 2, _F.TYPE_MESSAGE, type_name=".t5lite.tf.Feature")
  _add_field(features, "feature", 1, _F.TYPE_MESSAGE, rep, ".t5lite.tf.Features.FeatureEntry")
  _add_field(fdp.message_type.add(name="Example"), "features", 1, _F.TYPE_MESSAGE,
             type_name=".t5lite.tf.Features")
  pool = descriptor_pool.DescriptorPool()
  pool.Add(fdp)
  file_desc = pool.FindFileByName(fdp.name)
  return {name: message_factory.GetMessageClass(desc)
          for name, desc in file_desc.message_types_by_name.items()}


def _texts(values: list[bytes]) -> list[str] | list[bytes]:
  """Decodes all values as UTF-8, or none of them if one is not valid UTF-8."""
  try:
    return [v.decode("utf-8") for v in values]
  except UnicodeDecodeError:
    return values


def parse_example(data: bytes, *, decode_text: bool = True, squeeze: bool = True
                  ) -> dict[str, Any]:
  """A serialized tf.train.Example -> {name: value}, keys sorted.

  bytes features -> list of str (bytes where not valid UTF-8, or decode_text=False);
  int64 -> np.int64 array; float -> np.float32 array. squeeze unwraps single values
  (C4's one "text" string); pass squeeze=False for variable-length features.
  Example: features {"text": bytes_list ["hi"], "ids": int64_list [3, 4], "n": [7]}
    -> {"ids": array([3, 4]), "n": np.int64(7), "text": "hi"}.
  """
  example = example_classes()["Example"].FromString(data)
  out: dict[str, Any] = {}
  for key, feature in sorted(example.features.feature.items()):
    kind = feature.WhichOneof("kind")
    if kind == "bytes_list":
      values: Any = list(feature.bytes_list.value)
      values = _texts(values) if decode_text else values
      out[key] = values[0] if squeeze and len(values) == 1 else values
      continue
    if kind == "int64_list":
      values = np.array(feature.int64_list.value, dtype=np.int64)
    elif kind == "float_list":
      values = np.array(feature.float_list.value, dtype=np.float32)
    else:  # a Feature with no list set: an empty value
      values = np.zeros(0, dtype=np.float32)
    out[key] = values[0] if squeeze and len(values) == 1 else values
  return out


def make_example(features: Mapping[str, Any]) -> bytes:
  """{name: value} -> serialized tf.train.Example (the inverse of parse_example).

  str / bytes (or lists of them) -> bytes_list; integers / bools -> int64_list; floats ->
  float_list. Example: make_example({"text": "hi", "ids": [3, 4]}).
  """
  example = example_classes()["Example"]()
  for key, value in features.items():
    feature = example.features.feature[key]
    values = [value] if isinstance(value, (str, bytes)) or np.ndim(value) == 0 else list(value)
    if all(isinstance(v, (str, bytes)) for v in values) and values:
      feature.bytes_list.value.extend(v.encode("utf-8") if isinstance(v, str) else v
                                      for v in values)
      continue
    array = np.asarray(values)
    if array.dtype.kind in "iub":
      feature.int64_list.value.extend(array.astype(np.int64).tolist())
    elif array.dtype.kind == "f":
      feature.float_list.value.extend(array.astype(np.float32).tolist())
    else:
      raise TypeError(f"feature {key!r}: cannot store {array.dtype} values in an Example")
  return example.SerializeToString(deterministic=True)
