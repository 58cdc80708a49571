"""T5X checkpoints written in T5X's own layouts, independently of t5lite/interop/t5x/: the key
names come from t5x/examples/t5/network.py + layers.py, the files from t5x/checkpoints.py
(`Checkpointer.save`: msgpack + tensorstore; `OrbaxCheckpointManagerInterface`: orbax).
Used by test_t5x_import and test_import_limits."""
import os

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import serialization, traverse_util

from helpers import tiny

V11 = tiny()  # T5 v1.1: gated-gelu, untied
STEP = 1000

# T5X examples/t5 param names -> how the array is made from the t5lite param of the same
# name: 'same'; 'qkv' (embed, heads, kv) -> (embed, heads*kv) ('embed', 'joined_kv');
# 'out' (heads, kv, embed) -> (heads*kv, embed); 'relpos' (buckets, heads) -> (heads, buckets).
TOP = [("token_embedder/embedding", "same"),
       ("encoder/relpos_bias/rel_embedding", "relpos"), ("encoder/encoder_norm/scale", "same"),
       ("decoder/relpos_bias/rel_embedding", "relpos"), ("decoder/decoder_norm/scale", "same")]
UNTIED = [("decoder/logits_dense/kernel", "same")]  # absent with logits_via_embedding


def _attention(name):
  return [(f"{name}/query/kernel", "qkv"), (f"{name}/key/kernel", "qkv"),
          (f"{name}/value/kernel", "qkv"), (f"{name}/out/kernel", "out")]


MLP = {"relu": [("mlp/wi/kernel", "same"), ("mlp/wo/kernel", "same")],
       "gated-gelu": [("mlp/wi_0/kernel", "same"), ("mlp/wi_1/kernel", "same"),
                      ("mlp/wo/kernel", "same")]}
ENCODER_LAYER = (_attention("attention") + [("pre_attention_layer_norm/scale", "same"),
                                            ("pre_mlp_layer_norm/scale", "same")])
DECODER_LAYER = (_attention("self_attention") + _attention("encoder_decoder_attention")
                 + [("pre_self_attention_layer_norm/scale", "same"),
                    ("pre_cross_attention_layer_norm/scale", "same"),
                    ("pre_mlp_layer_norm/scale", "same")])


def t5x_target(config, params) -> dict[str, np.ndarray]:
  """T5X examples/t5 'target' (flat, '/'-joined names) holding t5lite `params`."""
  flat = {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()}
  rows = TOP + ([] if config.tie_output_embedding else UNTIED)
  for stack, n, layer in (("encoder", config.num_encoder_layers, ENCODER_LAYER),
                          ("decoder", config.num_decoder_layers, DECODER_LAYER)):
    rows += [(f"{stack}/layers_{i}/{name}", how) for i in range(n)
             for name, how in layer + MLP[config.mlp_activation]]
  assert {name for name, _ in rows} == set(flat)  # the table covers every param
  out = {}
  for name, how in rows:
    x = flat[name]
    if how == "qkv":
      x = x.reshape(x.shape[0], -1)
    elif how == "out":
      x = x.reshape(-1, x.shape[-1])
    elif how == "relpos":
      x = x.T
    out[name] = np.ascontiguousarray(x)
  return out


def _nest(flat: dict[str, object]) -> dict:
  return traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})


def _write_zarr(path: str, x: np.ndarray, compressor="gzip") -> dict:
  """One array as T5X's tensorstore writes it; returns the spec's metadata."""
  chunks = [max(1, x.shape[0] // 2)] + list(x.shape[1:]) if x.ndim else []
  metadata = {"compressor": {"id": compressor}, "shape": list(x.shape), "chunks": chunks}
  spec = {"driver": "zarr", "dtype": x.dtype.name, "metadata": metadata,
          "kvstore": {"driver": "file", "path": path}}
  ts.open(spec, create=True, open=True).result().write(x).result()
  return metadata


def _moments(target: dict[str, np.ndarray]) -> dict:
  """Adafactor param_states for two params: the importer must drop them."""
  emb = target["token_embedder/embedding"]
  return {"token_embedder/embedding/v_row": np.ones(emb.shape[0], np.float32),
          "token_embedder/embedding/v_col": np.ones(emb.shape[1], np.float32),
          "encoder/encoder_norm/scale/v": np.ones(emb.shape[1], np.float32)}


def write_msgpack_checkpoint(ckpt_dir: str, target: dict[str, np.ndarray], step: int,
                             inline=("encoder/encoder_norm/scale",), paths=None) -> None:
  """t5x/checkpoints.py Checkpointer.save: a zarr folder per partitioned array, named
  name.replace('/', '.'), its relative spec in the msgpack; unpartitioned arrays (no mesh
  axes, e.g. the step) inlined. `paths` overrides spec paths (for the safety tests)."""
  os.makedirs(ckpt_dir)
  state = {"state/step": np.int32(step)}
  state.update({f"state/param_states/{k}": v for k, v in _moments(target).items()})
  leaves = {}
  for name, x in [(f"target/{k}", v) for k, v in target.items()] + list(state.items()):
    if name.removeprefix("target/") in inline or np.ndim(x) == 0:
      leaves[name] = x
      continue
    relpath = name.replace("/", ".")
    metadata = _write_zarr(os.path.join(ckpt_dir, relpath), x)
    # What flax writes for a ts.Spec (t5x register_ts_spec_for_serialization: to_json()).
    leaves[name] = ts.Spec({"driver": "zarr", "dtype": x.dtype.name, "metadata": metadata,
                            "kvstore": {"driver": "file", "path": relpath}}).to_json()
    if name in (paths or {}):  # a hostile file, which tensorstore itself would not write
      leaves[name]["kvstore"]["path"] = paths[name]
  blob = serialization.msgpack_serialize({"version": 3, "optimizer": _nest(leaves)})
  with open(os.path.join(ckpt_dir, "checkpoint"), "wb") as f:
    f.write(blob)


def write_orbax_checkpoint(t5x_dir: str, target: dict[str, np.ndarray], step: int) -> None:
  """T5X's OrbaxCheckpointManagerInterface: item 'state', step_prefix 'checkpoint',
  PyTreeCheckpointHandler(use_ocdbt=False), the train state dict with 'target' on top."""
  state = {"target": _nest(target), "state": {"step": np.int32(step),
                                              "param_states": _nest(_moments(target))}}
  manager = ocp.CheckpointManager(
      t5x_dir, item_names=("state",),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(use_ocdbt=False)},
      options=ocp.CheckpointManagerOptions(step_prefix="checkpoint"))
  manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
  manager.wait_until_finished()
  manager.close()


def write_orbax_aggregate_checkpoint(ckpt_dir: str, target: dict[str, np.ndarray],
                                     step: int) -> None:
  """The orbax of T5X's time: state/checkpoint is msgpack of the tree with each array leaf
  'PLACEHOLDER://<keys joined by .>' (orbax utils.leaf_placeholder), its zarr folder beside."""
  state_dir = os.path.join(ckpt_dir, "state")
  os.makedirs(state_dir)
  leaves = {"state/step": np.int32(step)}
  for name, x in [(f"target/{k}", v) for k, v in target.items()]:
    relpath = name.replace("/", ".")
    _write_zarr(os.path.join(state_dir, relpath), x, compressor="zstd")
    leaves[name] = "PLACEHOLDER://" + relpath
  with open(os.path.join(state_dir, "checkpoint"), "wb") as f:
    f.write(serialization.msgpack_serialize(_nest(leaves)))
