"""The one logical-axis -> mesh-axis rules table, and every sharding derived from it.

Mesh axes: "data" (batch rows; the axis that spans hosts) and "model" (tensor parallelism inside a
host: attention heads, MLP units, vocabulary). Parameters, draft-head parameters and KV caches all get
their shardings here, from the logical axes of their dimensions:

  logical axis  dimensions                                    default mesh axis
  batch         request rows, KV cache rows                   data
  heads         query heads (o_proj in)                       model
  kv_heads      key/value heads (KV cache)                    model
  kv_groups     kv heads with their query heads (qkv_proj)    the kv_heads axis
  mla_heads     MLA query heads, their own dimension          the heads axis
                (q_b_proj / q_proj [H, k, in], kv_b_proj [H, k, r]; DeepSeek-V3)
  experts       routed experts of a mixture of experts        model (expert parallel)
  mlp           MLP hidden units                              model
  vocab         embedding rows, LM head columns               model
  embed         model width                                   None (replicated); "data" = FSDP weights
  cache_seq     KV cache slots                                None
  head_dim      features of one head                          None

Attention is always local to a shard: a device attends its own rows and its own kv heads (with their
query heads) against its own piece of the cache, so "heads" is sharded exactly when "kv_heads" is.

Fallback, never a crash: a dimension is sharded only when the mesh axis size divides it (for the
fused heads x head_dim dimension of q/k/v/o, when it divides the number of heads); otherwise that
dimension is replicated. When the model has fewer kv heads than the "model" axis, or a count it does
not divide (e.g. SmolLM2's 3 kv heads on model=2, 4 or 8), the whole attention is REPLICATED over
"model": q/k/v/o weights and the KV cache rows of a data shard are on every model shard of it, and
each computes all heads of its rows (MLP and vocabulary stay sharded). Per-device cache bytes are then
total / data instead of total / (data * model). Sharding cache_seq or head_dim instead would save that
memory but put a collective inside every attention of every layer and round (a softmax reduction
over sequence shards, or a score all-reduce over head_dim shards), and writes at per-row dynamic
slots into a sequence-sharded buffer make XLA gather it; keeping query heads sharded over replicated
kv heads would need a gather of the queries before each attention. Replication keeps the round free
of KV collectives. MLA (DeepSeek-V3) caches one latent + rope key per token ([B, 1, S, r]): that cache
is replicated over "model" while the query heads are sharded, and each shard attends its own heads
against it, so no collective touches it either; routed experts are split over "experts" and their
weighted sum is one all-reduce. Rows: a batch the "data" axis does not divide is replicated over "data".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxspec.model.config import ModelConfig
from jaxspec.model.kv_cache import HeadCache, KVCache

DATA_AXIS = "data"
MODEL_AXIS = "model"
MESH_AXES = (DATA_AXIS, MODEL_AXIS)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (None = replicated). `ShardingRules(embed="data")` shards weights over
    the data axis too (FSDP style: XLA gathers each weight where it is used)."""

    batch: str | None = DATA_AXIS
    heads: str | None = MODEL_AXIS
    kv_heads: str | None = MODEL_AXIS
    experts: str | None = MODEL_AXIS
    mlp: str | None = MODEL_AXIS
    vocab: str | None = MODEL_AXIS
    embed: str | None = None
    cache_seq: str | None = None
    head_dim: str | None = None

    def __post_init__(self) -> None:
        if self.heads != self.kv_heads:
            raise ValueError(
                "ShardingRules: heads and kv_heads must map to the same mesh axis (local attention)"
            )

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical == "kv_groups":  # a kv head with its query group is sharded exactly like the kv head
            logical = "kv_heads"
        if logical == "mla_heads":  # MLA: query heads (their latent / rope key cache is replicated)
            logical = "heads"
        return None if logical is None else getattr(self, logical)

    def for_kv_heads(self, num_kv_heads: int, mesh: Mesh) -> ShardingRules:
        """These rules, with attention replicated when the kv-head axis does not divide num_kv_heads."""
        if num_kv_heads % axis_size(mesh, self.kv_heads) == 0:
            return self
        return dataclasses.replace(self, heads=None, kv_heads=None)


DEFAULT_RULES = ShardingRules()

# (module name, parameter name) -> logical axes of the parameter's dimensions. The target's
# `Projection` weights are [*out, in] (qkv_proj [Hkv, G + 2, D, d], gate_up_proj [2, f, d]); draft
# heads' NNX Linear kernels are [in, out]; the embedding is [vocab, embed]. Parameters not listed are
# replicated.
PARAM_AXES: dict[tuple[str, str], tuple[str | None, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "weight"): ("vocab", "embed"),
    ("qkv_proj", "weight"): ("kv_groups", None, "head_dim", "embed"),
    ("qkv_proj", "bias"): ("kv_groups", None, "head_dim"),
    ("o_proj", "weight"): ("embed", "heads"),
    ("gate_up_proj", "weight"): (None, "mlp", "embed"),
    ("down_proj", "weight"): ("embed", "mlp"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "heads"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("q_norm", "weight"): ("head_dim",),
    ("k_norm", "weight"): ("head_dim",),
    # DeepSeek-V3 (jaxspec.model.deepseek_v3): MLA per-head projections, routed experts. q_a_proj,
    # kv_a_proj_with_mqa and the router are replicated; shared experts / dense MLPs use the MLP rows.
    ("q_b_proj", "weight"): ("mla_heads", None, None),
    ("q_proj", "weight"): ("mla_heads", None, "embed"),
    ("kv_b_proj", "weight"): ("mla_heads", None, None),
    ("experts", "gate_up_proj"): ("experts", None, None, "embed"),
    ("experts", "down_proj"): ("experts", "embed", None),
}
NORM_AXES = ("embed",)  # input_layernorm, post_attention_layernorm, norm: weight [embed]
# Logical axes whose dimension is heads x head_dim fused: divisibility is checked on the head count.
FUSED_HEAD_AXES = ("heads", "kv_heads")
# KV cache buffers [B, Hkv, S, D].
CACHE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")


# ----------------------------------------------------------------------------------------------------
# Meshes
# ----------------------------------------------------------------------------------------------------


def make_mesh(data: int = 1, model: int | None = None, devices: list | None = None) -> Mesh:
    """A (data, model) mesh over the first data * model devices (default: all, model = rest).

    Works the same on one host and across hosts (`jax.devices()` is global after
    `jax.distributed.initialize`); rows of the mesh follow device order, so with one process per host
    and model <= devices per host, "model" stays inside a host and "data" spans hosts.
    """
    devices = list(devices if devices is not None else jax.devices())
    if model is None:
        model = len(devices) // data
    if data < 1 or model < 1 or data * model > len(devices):
        raise ValueError(
            f"make_mesh: a {data}x{model} mesh needs {data * model} devices, have {len(devices)}"
        )
    return jax.make_mesh(
        (data, model), MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[: data * model]
    )


def parse_mesh_shape(text: str) -> tuple[int, int]:
    """Parse "2x4" -> (2, 4) (data x model)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"mesh shape must look like DATAxMODEL (e.g. 2x4), got {text!r}")
    return int(parts[0]), int(parts[1])


def axis_size(mesh: Mesh, axis: str | None) -> int:
    return 1 if axis is None else mesh.shape[axis]


# ----------------------------------------------------------------------------------------------------
# Logical axes -> PartitionSpec
# ----------------------------------------------------------------------------------------------------


def logical_to_spec(
    logical_axes: tuple[str | None, ...],
    shape: tuple[int, ...],
    mesh: Mesh,
    rules: ShardingRules = DEFAULT_RULES,
    *,
    head_dim: int | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dimensions have `logical_axes`.

    A dimension keeps its mesh axis only if that axis divides it (heads/kv_heads with `head_dim`:
    divides its number of heads) and the axis is not already used by an earlier dimension.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {logical_axes} do not match shape {shape}")
    used: set[str] = set()
    spec: list[str | None] = []
    for logical, size in zip(logical_axes, shape, strict=True):
        axis = rules.mesh_axis(logical)
        count = size
        if logical in FUSED_HEAD_AXES and head_dim is not None:
            count = size // head_dim if size % head_dim == 0 else 0
        if axis is None or axis in used or count == 0 or count % axis_size(mesh, axis) != 0:
            spec.append(None)
            continue
        used.add(axis)
        spec.append(axis)
    return PartitionSpec(*spec)


def num_shards(spec: PartitionSpec, mesh: Mesh) -> int:
    """How many distinct pieces an array with `spec` is cut into (the rest is replication)."""
    return math.prod(axis_size(mesh, axis) for axis in spec if axis is not None)


# ----------------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------------


def _names(path: tuple) -> tuple:
    """A jax key path or an NNX flat-state path -> plain names, without the Variable's `.value`."""
    names = []
    for entry in path:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                entry = getattr(entry, attr)
                break
        names.append(entry)
    if names and names[-1] == "value":
        names.pop()
    return tuple(names)


def param_logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the parameter at NNX `path` (e.g. ('layers', 0, 'self_attn', 'q_proj',
    'kernel')). Unknown parameters (e.g. a draft head's own layers) are replicated."""
    names = _names(path)
    key = tuple(str(n) for n in names[-2:])
    axes = PARAM_AXES.get(key)
    if axes is None and len(key) == 2 and key[1] == "weight" and key[0].endswith("norm"):
        axes = NORM_AXES
    if axes is None or len(axes) != ndim:
        return (None,) * ndim
    return axes


def param_sharding(
    path: tuple,
    shape: tuple[int, ...],
    mesh: Mesh,
    *,
    config: ModelConfig,
    rules: ShardingRules = DEFAULT_RULES,
) -> NamedSharding:
    """NamedSharding of one parameter of a model with `config`, from its NNX path and shape."""
    axes = param_logical_axes(path, len(shape))
    rules = rules.for_kv_heads(config.num_kv_heads, mesh)
    return NamedSharding(mesh, logical_to_spec(axes, tuple(shape), mesh, rules, head_dim=config.head_dim))


def param_shardings(
    params: Any, mesh: Mesh, *, config: ModelConfig, rules: ShardingRules = DEFAULT_RULES
) -> Any:
    """Pytree of NamedShardings with the structure of `params` (an nnx.State or any pytree)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: param_sharding(path, np.shape(x), mesh, config=config, rules=rules), params
    )


def put_sharded(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array with `sharding` from a host array that every process holds in full: each device
    receives only its own slice (no full copy per device). Works across processes."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def param_placer(
    mesh: Mesh, *, config: ModelConfig, dtype: Any, rules: ShardingRules = DEFAULT_RULES
) -> Callable[[tuple, np.ndarray], jax.Array]:
    """`place(path, host_array) -> sharded jax.Array` in `dtype`, for loaders filling a parameter tree."""

    def place(path: tuple, host: np.ndarray) -> jax.Array:
        host = np.asarray(host).astype(dtype)
        return put_sharded(host, param_sharding(path, host.shape, mesh, config=config, rules=rules))

    return place


def shard_params(
    params: Any, mesh: Mesh, *, config: ModelConfig, rules: ShardingRules = DEFAULT_RULES
) -> Any:
    """Move an already built parameter pytree (e.g. draft-head weights) onto `mesh` by the rules.

    Leaves that already carry their target sharding are kept as they are.
    """

    def move(x: Any, sharding: NamedSharding) -> Any:
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return put_sharded(np.asarray(x), sharding)

    return jax.tree.map(move, params, param_shardings(params, mesh, config=config, rules=rules))


# ----------------------------------------------------------------------------------------------------
# KV cache, batch arrays
# ----------------------------------------------------------------------------------------------------


def cache_spec(shape: tuple[int, ...], mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec of one KV buffer [B, Hkv, S, D] (kv heads replicated when "model" does not divide
    them; see the module docstring)."""
    return logical_to_spec(CACHE_AXES, tuple(shape), mesh, rules)


def batch_spec(shape: tuple[int, ...], mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec of a per-row array [B, ...]: rows over "data", the rest replicated."""
    return logical_to_spec(("batch",) + (None,) * (len(shape) - 1), tuple(shape), mesh, rules)


def cache_shardings(cache: KVCache, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> KVCache:
    """A KVCache of NamedShardings matching `cache` (arrays or ShapeDtypeStructs)."""

    def named(spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(mesh, spec)

    return KVCache(
        keys=tuple(named(cache_spec(k.shape, mesh, rules)) for k in cache.keys),
        values=tuple(named(cache_spec(v.shape, mesh, rules)) for v in cache.values),
        lengths=named(batch_spec(cache.lengths.shape, mesh, rules)),
    )


def constrain_cache(cache: KVCache, mesh: Mesh | None, rules: ShardingRules = DEFAULT_RULES) -> KVCache:
    """Inside jit: pin the cache to its NamedShardings. Identity when mesh is None."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh, rules))


def constrain_head_cache(cache: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """Pin a draft head's cache: keys/values [B, Hkv, S, D], or [M, B, Hkv, S, D] (one per MTP module or
    EAGLE decoder layer)."""

    lead = cache.batch_axis

    def pin(x: jax.Array) -> jax.Array:
        spec = PartitionSpec(*((None,) * lead), *cache_spec(x.shape[lead:], mesh, rules))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return dataclasses.replace(cache, keys=pin(cache.keys), values=pin(cache.values))


def constrain_caches(tree: Any, mesh: Mesh | None, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """Pin every KVCache and draft-head cache found inside `tree` (e.g. a drafter's state) to the cache
    shardings. Identity when mesh is None."""
    if mesh is None:
        return tree

    def pin(x: Any) -> Any:
        if isinstance(x, KVCache):
            return constrain_cache(x, mesh, rules)
        if isinstance(x, HeadCache):
            return constrain_head_cache(x, mesh, rules)
        return x

    return jax.tree.map(pin, tree, is_leaf=lambda x: isinstance(x, (KVCache, HeadCache)))


def place_batch(tree: Any, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Any:
    """Host-side per-row arrays (each [B, ...], identical on every process) -> global arrays with rows
    over "data"."""
    return jax.tree.map(
        lambda x: put_sharded(np.asarray(x), NamedSharding(mesh, batch_spec(np.shape(x), mesh, rules))), tree
    )


# ----------------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------------


def shard_attention(
    attention_fn: Callable[..., Any],
    mesh: Mesh,
    rules: ShardingRules = DEFAULT_RULES,
    *,
    returns_cache: bool = False,
):
    """Run a tree-attention function (the `tree_attention_reference` signature) per shard.

    returns_cache: attention_fn returns (out, k_cache, v_cache)
    (`jaxspec.model.forward.cached_attention`); the caches keep their sharding.

    Each device attends its own rows and kv heads against its own piece of the KV cache, so the
    attention needs no collective and a Pallas kernel (which XLA cannot partition) sees plain local
    arrays. Query heads follow the kv heads: sharded over "model" together with them, else replicated
    (the fallback: the cache is replicated over "model", so each shard computes all heads of its rows).
    """

    def sharded(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask, *, scale):
        kv = cache_spec(k_cache.shape, mesh, rules)
        q_spec = PartitionSpec(kv[0], kv[1], None, None)
        tree_spec = PartitionSpec(kv[0], kv[1], None, None)
        row = PartitionSpec(kv[0])
        mask_spec = PartitionSpec(kv[0], None, None)

        def local(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask):
            return attention_fn(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask, scale=scale)

        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(q_spec, kv, kv, row, tree_spec, tree_spec, mask_spec),
            out_specs=(q_spec, kv, kv) if returns_cache else q_spec,
            check_vma=False,
        )(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask)

    return sharded
