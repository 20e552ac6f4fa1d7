"""Head training on a (data, model) mesh: where every array of the train step lives.

The shardings come from the one rules table of `jaxspec.sharding` (nothing here invents a second one):
  fixed["target"]      the frozen target, sharded like an inference load (vocab / MLP / heads over
                       "model"; each device holds only its slice)
  fixed["empty_cache"] the online target forward's empty KV cache, rows over "data" like a decode cache
  trainable["head"]    the head's parameters and their optimizer state: replicated on every device, but
                       for vocabulary-sized dimensions, sharded by the same table's "vocab" rule (EAGLE-3's
                       draft LM head [d, V_draft] over "model"; the logits stay vocabulary-sharded and
                       the cross entropy reduces them with small [B, L] all-reduces, no weight gather)
  trainable["backbone"] (MTP trained jointly) sharded like the target, its optimizer state alike
  batch                every per-row array [B, ...] split over "data" (B must divide by it)
The step is one `jax.jit` with these shardings in and out: XLA partitions the global-batch loss, so the
gradient of the replicated head is the all-reduce over "data" of the per-shard partial sums inside the
compiled program; no host-side reduction, and the update is the same on every device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.model.config import ModelConfig
from jaxspec.sharding import (
    DATA_AXIS,
    DEFAULT_RULES,
    ShardingRules,
    cache_shardings,
    param_shardings,
    place_batch,
    put_sharded,
)


def _put(x: Any, sharding: NamedSharding) -> jax.Array:
    """x on `sharding` (kept as is when it already is there); host values are sliced per device."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    return put_sharded(np.asarray(x), sharding)


def shardings_of(tree: Any) -> Any:
    """The pytree of `.sharding` of placed arrays (the compiled step's output shardings)."""
    return jax.tree.map(lambda x: x.sharding, tree)


@dataclasses.dataclass(frozen=True)
class TrainMesh:
    """A mesh for head training and the rules that place the target on it."""

    mesh: Mesh
    rules: ShardingRules = DEFAULT_RULES

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def data_size(self) -> int:
        return int(self.mesh.shape[DATA_AXIS])

    @property
    def num_devices(self) -> int:
        return int(self.mesh.devices.size)

    def describe(self) -> str:
        return "x".join(str(n) for n in self.mesh.devices.shape)

    def check_batch_size(self, batch_size: int) -> None:
        if batch_size % self.data_size:
            raise ValueError(
                f"train: batch size {batch_size} (--batch-size) is not a multiple of the mesh's data axis "
                f"{self.data_size} (--mesh {self.describe()}): every data shard needs the same number of rows"
            )

    @property
    def head_rules(self) -> ShardingRules:
        """The rules for a head's own parameters: only its vocabulary dimensions sharded (the rest is
        small; replicated, it needs no collective in the head's forward)."""
        return dataclasses.replace(self.rules, heads=None, kv_heads=None, mlp=None, embed=None)

    def place_trainable(self, trainable: dict[str, Any], target_config: ModelConfig) -> dict[str, Any]:
        """{"head": vocabulary over "model", the rest replicated; "backbone": sharded like the target}."""
        out = {}
        for name, tree in trainable.items():
            rules = self.rules if name == "backbone" else self.head_rules
            shardings = param_shardings(tree, self.mesh, config=target_config, rules=rules)
            out[name] = jax.tree.map(_put, tree, shardings)
        return out

    def place_opt_state(
        self, optimizer: optax.GradientTransformation, opt_state: Any, trainable: dict[str, Any]
    ) -> Any:
        """Moments with their parameter's sharding, counters replicated."""
        return optax.tree_map_params(
            optimizer, lambda state, param: _put(state, param.sharding), opt_state, trainable,
            transform_non_params=lambda x: _put(x, self.replicated),
        )  # fmt: skip

    def place_fixed(self, fixed: dict[str, Any], target_config: ModelConfig) -> dict[str, Any]:
        """The frozen target by the rules table, the online empty cache like a KV cache, the rest
        replicated."""
        out = {}
        for name, tree in fixed.items():
            if name == "target":
                shardings = param_shardings(tree, self.mesh, config=target_config, rules=self.rules)
                out[name] = jax.tree.map(_put, tree, shardings)
            elif name == "empty_cache":
                out[name] = jax.tree.map(_put, tree, cache_shardings(tree, self.mesh, self.rules))
            else:
                out[name] = jax.tree.map(lambda x: _put(x, self.replicated), tree)
        return out

    def place_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host rows [B, ...] (the same on every process) -> global arrays with rows over "data"."""
        return place_batch(batch, self.mesh, self.rules)
