"""Device mesh, logical axis rules, and where params, optimizer state and batches live.

The model names every parameter and key activation axis logically (`batch`, `embed`, `heads`,
...; see t5lite/models/layers.py). This module owns the other half: a 4-D mesh with axes
('data', 'fsdp', 'expert', 'tensor') and the rules that map logical names onto it.

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rules = logical_axis_rules(fsdp=True)
    shardings = param_shardings(config, mesh, rules)         # params born sharded under jit
    batch = global_batch(host_batch, mesh)                 # this process's rows -> global arrays
    with activate(mesh, rules):                            # activation constraints take effect
      logits = jax.jit(forward)(params, batch)

Parameter embed vs activation embed under FSDP: the model uses one name, `embed`, for both the
d_model axis of parameters and of activations (B, L, embed). FSDP wants the first sharded over
'fsdp' and the second whole. As in T5X's 2-D parameter partitioning (`embed -> data` while
`batch -> data`), this falls out of flax's rule resolution: rules are tried in order and a mesh
axis is given to at most one array dimension. `batch -> ('data', 'fsdp')` comes first, so in any
activation (which always carries `batch`) 'fsdp' is taken before `embed -> 'fsdp'` is tried and
embed stays unsharded; parameters have no `batch` axis, so their embed dimension gets 'fsdp'.
No second name (maxtext's `activation_embed`) is needed, and the model stays unaware of FSDP.
The rule order is therefore load-bearing: keep `batch` before `embed`.

Expert parallelism (Mixture-of-Experts, t5lite.models.moe.layer): the 'expert' axis splits the batch
like 'data' and, in the sparse layers, the experts: kernels (E, D, F) and the dispatched
tokens (E, B, C, D) put their `expert` dimension on it, so each device group computes its
experts for the tokens of its data shard, and GSPMD moves tokens with all-to-alls. The
`expert` rule comes first: in a dispatched array it takes the 'expert' axis, and `batch`
falls back to ('data', 'fsdp'); arrays without an `expert` dimension split `batch` over all
three.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from t5lite.errors import ConfigError
from t5lite.families import Family, family_of
from t5lite.models.config import ModelConfig

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# Mesh axes that split the batch: data parallelism, FSDP and the expert axis each give each
# device its rows (the expert axis also splits the experts of Mixture-of-Experts layers).
BATCH_AXES = ("data", "fsdp", "expert")

LogicalRules = list[tuple[str, "str | tuple[str, ...] | None"]]
Tree = Any


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the mesh axes; -1 (at most one) means "all remaining devices".

  The default is pure data parallelism over every device.
  """

  data: int = -1
  """Data-parallel replicas: params replicated, batch rows split."""
  fsdp: int = 1
  """Fully sharded data parallelism: batch rows split and, with FSDP rules, params' embed axis."""
  tensor: int = 1
  """Tensor (model) parallelism: heads, mlp and vocab axes split (Megatron style)."""
  expert: int = 1
  """Expert parallelism: batch rows split, and a Mixture-of-Experts model's experts (its
  num_experts must be a multiple of this)."""

  def __post_init__(self):
    for name, size in zip(MESH_AXES, self.sizes):
      if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
        raise ConfigError(f"mesh axis {name!r} has size {size!r}: use a positive int or -1")
    if self.sizes.count(-1) > 1:
      raise ConfigError(f"mesh {self.sizes} has more than one -1: at most one axis can take "
                        "the remaining devices")

  @property
  def sizes(self) -> tuple[int, int, int, int]:
    """(data, fsdp, expert, tensor) as written (MESH_AXES order), possibly with a -1."""
    return (self.data, self.fsdp, self.expert, self.tensor)

  def resolve(self, num_devices: int | None = None) -> tuple[int, int, int, int]:
    """Concrete (data, fsdp, expert, tensor) sizes for num_devices (default:
    jax.device_count()).

    Raises ValueError naming the sizes and the device count when they do not fit.
    """
    where = "were given"
    if num_devices is None:
      num_devices = jax.device_count()
      where = "this host has" if jax.process_count() == 1 else (
          f"the {jax.process_count()} processes have")
    fixed = math.prod(s for s in self.sizes if s != -1)
    if -1 in self.sizes:
      if num_devices % fixed:
        raise ConfigError(f"mesh {self.sizes} cannot fill the devices: {num_devices} devices "
                          f"({where} {num_devices}) do not divide by {fixed}")
      return tuple(num_devices // fixed if s == -1 else s for s in self.sizes)
    if fixed != num_devices:
      raise ConfigError(f"mesh {self.sizes} needs {fixed} devices, {where} {num_devices}")
    return self.sizes


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None,
              num_slices: int = 1) -> Mesh:
  """A ('data', 'fsdp', 'expert', 'tensor') mesh over all devices (or the given ones).

  Axes are AxisType.Auto (GSPMD): jax.make_mesh defaults to Explicit axes, under which linen's
  logical constraints assert shardings instead of requesting them. jax.make_mesh also orders
  devices by physical topology; the last axis (tensor, the chattiest) varies fastest, so its
  groups are neighbouring devices. Several TPU slices (num_slices, joined by the data-center
  network): the 'data' axis spans them, each slice holding data / num_slices of its groups, so
  only the gradient all-reduce crosses slices.
  """
  sizes = config.resolve(None if devices is None else len(devices))
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  if num_slices == 1:
    return jax.make_mesh(sizes, MESH_AXES, axis_types=axis_types, devices=devices)
  if sizes[0] % num_slices:
    named = " x ".join(f"{a}={n}" for a, n in zip(MESH_AXES, sizes))
    raise ConfigError(f"mesh {named} over {num_slices} slices: the data axis spans the "
                      f"slices, so it must be a multiple of {num_slices}")
  from jax.experimental import mesh_utils
  grid = mesh_utils.create_hybrid_device_mesh(
      (sizes[0] // num_slices, *sizes[1:]), (num_slices,) + (1,) * (len(sizes) - 1),
      devices=devices if devices is not None else jax.devices())
  return Mesh(grid, MESH_AXES, axis_types=axis_types)


def logical_axis_rules(fsdp: bool = False) -> LogicalRules:
  """T5X's standard rules on our mesh axes; with fsdp, parameters' embed axis goes on 'fsdp'.

  Order matters: flax gives each mesh axis to the first rule that claims it within one array,
  and `batch` must claim 'fsdp' before `embed` can (see the module docstring).
  """
  return [
      ("expert", "expert"),  # first: a dispatched array's experts take the 'expert' axis
      ("batch", BATCH_AXES),
      ("batch", ("data", "fsdp")),  # ... and its batch dimension what is left
      ("vocab", "tensor"),
      ("mlp", "tensor"),
      ("heads", "tensor"),
      ("kv", None),
      ("length", None),
      ("relpos_buckets", None),
      ("classes", None),  # a sentence head's few classes: replicated
      ("kv_heads", None),  # grouped-query key/value heads: replicated
      ("layers", None),  # scanned stacks: every device holds every layer (of its shard)
      ("embed", "fsdp" if fsdp else None),  # params only: activations lost 'fsdp' to batch
  ]


@contextlib.contextmanager
def activate(mesh: Mesh, rules: LogicalRules) -> Iterator[Mesh]:
  """Enters the mesh and the logical rules together, so linen's with_logical_constraint acts.

  jax.set_mesh, not the legacy `with mesh:`, under which linen silently skips constraints.
  An AbstractMesh (devices not at hand: `t5lite compile --platform cuda`) is entered with
  jax.sharding.use_abstract_mesh, enough to trace and lower.
  """
  enter = (jax.sharding.use_abstract_mesh if isinstance(mesh, jax.sharding.AbstractMesh)
           else jax.set_mesh)
  with enter(mesh), nn.logical_axis_rules(rules):
    yield mesh


def _path_str(path) -> str:
  return "/".join(key_name(k) for k in path)


def key_name(key) -> str:
  """The plain name of a pytree path entry (DictKey.key, GetAttrKey.name, SequenceKey.idx)."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _axis_size(mesh: Mesh, entry: str | tuple[str, ...] | None) -> int:
  """Devices that one PartitionSpec entry splits a dimension over."""
  if entry is None:
    return 1
  names = (entry,) if isinstance(entry, str) else tuple(entry)
  return math.prod(mesh.shape[n] for n in names)


def param_shardings(model_config: ModelConfig | Family, mesh: Mesh, rules: LogicalRules) -> Tree:
  """Params tree of NamedShardings: the model's logical axis names mapped through the rules
  (of a ModelConfig's family, or of a family object such as a distillation recipe).

  Raises ValueError listing every parameter dimension that the mesh cannot split evenly
  (e.g. 6 heads over tensor=4): jit refuses uneven output shardings, and a named list is
  easier to act on than XLA's message about one array.
  """
  family = model_config if isinstance(model_config, Family) else family_of(model_config)
  moe = family.config.moe
  experts_axis = dict(mesh.shape).get("expert", 1)
  if moe is not None and moe.num_experts % experts_axis:
    raise ConfigError(f"MoeConfig.num_experts={moe.num_experts} does not divide over the mesh's "
                      f"expert axis of {experts_axis} devices (MeshConfig.expert="
                      f"{experts_axis}): make num_experts a multiple of it, or the axis a "
                      "divisor of num_experts")
  logical_tree = family.param_logical_axes()
  shardings = nn.logical_to_mesh_sharding(logical_tree, mesh, rules)
  logical = jax.tree_util.tree_leaves(logical_tree, is_leaf=lambda x: isinstance(x, P))
  flat_shapes = jax.tree_util.tree_leaves_with_path(family.abstract_params())
  problems = []
  for (path, shape), names, sharding in zip(flat_shapes, logical,
                                            jax.tree_util.tree_leaves(shardings)):
    for dim, (size, entry) in enumerate(zip(shape.shape, sharding.spec)):
      if size % _axis_size(mesh, entry):
        problems.append(f"{_path_str(path)} dim {dim} ({names[dim]}, size {size}) over "
                        f"{entry!r} ({_axis_size(mesh, entry)} devices)")
  if problems:
    more = [f"... and {len(problems) - 8} more"] if len(problems) > 8 else []
    raise ConfigError(f"mesh {dict(mesh.shape)} cannot split these parameters evenly; pick axis "
                      "sizes that divide them:\n  " + "\n  ".join(problems[:8] + more))
  return shardings


def abstract_sharded(tree: Tree, shardings: Tree) -> Tree:
  """jax.ShapeDtypeStructs of `tree`'s leaves carrying `shardings`: restore targets that say
  where each array goes (orbax reads every shard onto its device)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _fit_spec(mesh: Mesh, entries: Sequence, shape: Sequence[int]) -> tuple:
  """Spec entries with any entry that does not divide its dimension replaced by None."""
  return tuple(e if size % _axis_size(mesh, e) == 0 else None for e, size in zip(entries, shape))


def state_shardings(abstract_state: Tree, state_axes: Tree, mesh: Mesh,
                    rules: LogicalRules) -> Tree:
  """NamedShardings for an optimizer state, from the logical axes its optimizer declares.

  state_axes: PartitionSpecs over logical names shaped exactly like the state, e.g.
  optimizer.state_axes(params) (t5lite.train.optimizers). They go through the same rules as
  the params, so each statistic lies where the matching dims of its param lie. A mesh split that
  does not divide a leaf's dimension is dropped (that dimension is kept whole): statistics can be
  smaller than their params, and jit refuses uneven output shardings.
  abstract_state: arrays or jax.ShapeDtypeStructs, e.g. jax.eval_shape(optimizer.init, params).
  """
  axes_structure = jax.tree.structure(state_axes, is_leaf=lambda x: isinstance(x, P))
  if axes_structure != jax.tree.structure(abstract_state):
    raise ValueError("the declared state axes are not shaped like the optimizer state: declare "
                     "them with the optimizer that made the state, for the same params\n"
                     f"  state: {jax.tree.structure(abstract_state)}\n  axes:  {axes_structure}")
  shardings = nn.logical_to_mesh_sharding(state_axes, mesh, rules)

  def fit(path, leaf, sharding):
    shape = np.shape(leaf)
    if len(sharding.spec) > len(shape):
      raise ValueError(f"optimizer state {_path_str(path)} of shape {shape} is declared with "
                       f"more axes, {sharding.spec}")
    return NamedSharding(mesh, P(*_fit_spec(mesh, sharding.spec, shape)))

  return jax.tree_util.tree_map_with_path(fit, abstract_state, shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis split over ('data', 'fsdp', 'expert'); other axes whole."""
  return NamedSharding(mesh, P(BATCH_AXES))


def check_batch_size(global_batch_size: int, mesh: Mesh) -> None:
  """Every batch shard (a device group along 'data' x 'fsdp') must get the same number of rows.

  Raises ValueError naming the batch size, the shard count and the nearest sizes that work.
  """
  shards = _axis_size(mesh, BATCH_AXES)
  if global_batch_size % shards:
    lower = global_batch_size // shards * shards
    options = [n for n in (lower, lower + shards) if n > 0]
    raise ConfigError(
        f"global batch size {global_batch_size} does not divide evenly over the {shards} batch "
        f"shards of mesh data={mesh.shape['data']} x fsdp={mesh.shape['fsdp']} x "
        f"expert={mesh.shape['expert']} (over "
        f"{mesh.size} devices in {jax.process_count()} process(es)); use a multiple of {shards}, "
        f"e.g. BATCH_SIZE={' or '.join(map(str, options))}")


def process_batch_slice(mesh: Mesh, process_index: int | None = None) -> tuple[int, int]:
  """(i, n): a process feeds slice i of the global batch cut into n equal, contiguous slices.

  Usually (jax.process_index(), jax.process_count()). Read from the mesh, not assumed: where
  processes' devices hold the same rows (a tensor axis that spans hosts), they feed the same
  slice, and n is smaller than the process count. This is what the data pipeline gets as its
  (process_index, process_count), so each process computes exactly the rows that its devices
  hold in the global array (jax.make_array_from_process_local_data).
  """
  process_index = jax.process_index() if process_index is None else process_index
  shards = _axis_size(mesh, BATCH_AXES)
  index = batch_sharding(mesh).devices_indices_map((shards,))  # one row per batch shard
  held: dict[int, set[int]] = {}
  for device, where in index.items():
    held.setdefault(device.process_index, set()).add(where[0].start or 0)
  return slice_of_process(held, shards, process_index)


def slice_of_process(held: dict[int, set[int]], shards: int, process_index: int
                     ) -> tuple[int, int]:
  """(i, n) for a process from the batch shards each process's devices hold (see
  process_batch_slice); ValueError when they do not cut the batch into equal, contiguous runs.

    >>> slice_of_process({0: {0, 1}, 1: {2, 3}}, 4, 1)   # 2 processes x 2 devices
    (1, 2)
    >>> slice_of_process({0: {0, 1}, 1: {0, 1}}, 2, 1)   # tensor=2 across the 2 processes
    (0, 1)
  """
  runs = sorted({tuple(sorted(shard_ids)) for shard_ids in held.values()})
  contiguous = all(run == tuple(range(run[0], run[0] + len(run))) for run in runs)
  tiled = [i for run in runs for i in run] == list(range(shards))
  if not (contiguous and tiled and len({len(run) for run in runs}) == 1):
    layout = {p: sorted(ids) for p, ids in sorted(held.items())}
    raise ConfigError(
        f"the mesh gives processes these batch shards: {layout}; each process's devices must "
        "hold an equal, contiguous run of the batch shards (order the mesh's devices by "
        "process, as jax.make_mesh does)")
  return runs.index(tuple(sorted(held[process_index]))), len(runs)


def _local_batch_shards(mesh: Mesh) -> int:
  """How many distinct batch slices this process's devices hold (tensor replicas share one)."""
  sharding = batch_sharding(mesh)
  rows = _axis_size(mesh, BATCH_AXES)
  index = sharding.devices_indices_map((rows,))  # one row per batch shard
  return len({index[d][0].start for d in mesh.local_devices})


def global_batch(host_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """This process's rows of a batch -> global jax.Arrays split over the BATCH_AXES.

  Every process passes its own, equally sized slice of the global batch (single process: the
  whole batch); the global batch is their concatenation, in the order of the processes' batch
  shards. The local rows must split evenly over the batch shards held by this process's
  devices.
  """
  sharding = batch_sharding(mesh)
  shards = _local_batch_shards(mesh)
  out = {}
  for key, value in host_batch.items():
    value = np.asarray(value)
    if value.ndim == 0:
      raise ValueError(f"batch feature {key!r} is a scalar; every feature needs a batch axis")
    if value.shape[0] % shards:
      raise ConfigError(
          f"batch feature {key!r} has {value.shape[0]} local rows, which do not divide over the "
          f"{shards} batch shards of this process's devices (mesh data={mesh.shape['data']} x "
          f"fsdp={mesh.shape['fsdp']} x expert={mesh.shape['expert']}); use a per-process "
          f"batch size divisible by {shards}")
    out[key] = jax.make_array_from_process_local_data(sharding, value)
  return out
