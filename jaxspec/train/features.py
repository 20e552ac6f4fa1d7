"""Target features for head training: a tensorstore (zarr3) store written offline, or computed online.

Store layout (one directory), sequences padded to `max_len` along the token axis (features and argmax
past a sequence's length are zeros; the losses mask by length):
  tokens   [N, L]         int32  prompt + response token ids (0 after the sequence)
  lengths  [N]            int32  tokens in the sequence
  starts   [N]            int32  first response position (loss is taken on positions >= start - 1)
  hidden   [N, L, d]      post-norm final hidden state of the target (EAGLE-1 features, Medusa input)
  layers   [N, L, k * d]  outputs of the captured decoder layers, concatenated (EAGLE-3 input), if k > 0
  argmax   [N, L]         int32  the target's top token over its full vocabulary at each position (EAGLE-3's
                          position mask), in stores written with it (meta "argmax": true). For greedy
                          self-distilled rows it is the data's next token at every response position
                          (what the target emitted), so `argmax_from_data` stores that instead of running
                          the target's full-vocabulary LM head (the pass 1.1-1.3x faster on a CPU; README)
  meta.json               {"num_committed", "max_len", "capture_layers", "dtype", "ids", "argmax"}
Chunks are one sequence each, so appending is a metadata resize plus new chunk files. `meta.json` is
replaced atomically after every batch's writes have completed: rows past num_committed (a batch in
flight when the writer was killed) are ignored and rewritten on resume; nothing committed is lost.

On a mesh (`jaxspec.load(..., mesh=...)`) each feature batch is split over the "data" axis and the
target runs sharded by the rules table; with several processes (`jax.distributed`) every process writes
the rows its own devices computed (tokens and all), so no process writes another's chunk: process 0
creates and resizes the arrays and commits `meta.json`, between barriers, and one-sequence chunks mean
any row split is chunk-aligned (checked against the arrays' actual chunk layout before each write).

Online mode: `target_features` is a pure function usable inside a jitted train step (the target
forward runs every step instead of once); see `jaxspec.train.trainer` and the measurement in the README.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from jaxspec.distributed import barrier
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import causal_mask, lm_logits, model_forward
from jaxspec.model.kv_cache import KVCache
from jaxspec.model.live_attention import cache_prefix_attention
from jaxspec.sharding import DEFAULT_RULES, cache_shardings, place_batch, put_sharded

META = "meta.json"


def target_features(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    *,
    config: ModelConfig,
    capture_layers: tuple[int, ...] = (),
    stop_gradient: bool = True,
    cache: KVCache | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """tokens [B, L] -> (final hidden [B, L, d], captured layers concatenated [B, L, k * d] or None).

    One causal forward of the target (gradients stopped unless `stop_gradient=False`, for a trainable
    backbone); padding after a sequence cannot change its positions' features. `cache`: an empty
    KVCache of n slots made outside `jax.jit` (a cache built inside is a constant that XLA spends
    minutes constant-folding through every layer's attention on a CPU); None builds one here.
    """
    b, n = tokens.shape
    if cache is None:
        cache = KVCache.zeros(config, b, n, jax.tree.leaves(params)[0].dtype)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    hidden, captured, _ = model_forward(
        graphdef, params, tokens, positions, cache, causal_mask(b, n),
        attention="reference", capture_layers=capture_layers, attend=cache_prefix_attention(0),
    )  # fmt: skip
    layers = jnp.concatenate(captured, axis=-1) if captured else None
    if not stop_gradient:
        return hidden, layers
    return jax.lax.stop_gradient(hidden), None if layers is None else jax.lax.stop_gradient(layers)


def target_features_and_argmax(
    graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array, *, config: ModelConfig,
    capture_layers: tuple[int, ...], cache: KVCache,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:  # fmt: skip
    """`target_features` plus the target's argmax over its full vocabulary at every position [B, L]."""
    hidden, layers = target_features(
        graphdef, params, tokens, config=config, capture_layers=capture_layers, cache=cache
    )
    argmax = jax.lax.map(lambda h: jnp.argmax(lm_logits(graphdef, params, h), -1), hidden)
    return hidden, layers, argmax.astype(jnp.int32)


_jit_features_and_argmax = jax.jit(
    target_features_and_argmax, static_argnames=("graphdef", "config", "capture_layers")
)
_jit_features = jax.jit(target_features, static_argnames=("graphdef", "config", "capture_layers"))


def next_tokens(tokens: np.ndarray) -> np.ndarray:
    """[B, L] token ids -> [B, L] the token after each position (0 after the last): a greedy sequence's
    target argmax at every position that predicts one of its tokens."""
    return np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)


def packed_length(row: dict, max_len: int) -> int:
    """Tokens a distill row keeps in a store of `max_len`: prompt + response, truncated."""
    return min(len(row["prompt_ids"]) + len(row["response_ids"]), max_len)


def pack_sequences(rows: Sequence[dict], max_len: int) -> dict[str, np.ndarray]:
    """Distill rows -> {"tokens" [B, L], "lengths" [B], "starts" [B]} (prompt + response, truncated)."""
    tokens = np.zeros((len(rows), max_len), np.int32)
    lengths = np.zeros((len(rows),), np.int32)
    starts = np.zeros((len(rows),), np.int32)
    for i, row in enumerate(rows):
        lengths[i] = packed_length(row, max_len)
        tokens[i, : lengths[i]] = (list(row["prompt_ids"]) + list(row["response_ids"]))[: lengths[i]]
        starts[i] = min(len(row["prompt_ids"]), max_len)
    return {"tokens": tokens, "lengths": lengths, "starts": starts}


FEATURE_WIDTH_STEP = 64


def feature_width(longest: int, max_len: int) -> int:
    """The token width a feature batch runs at: its longest sequence rounded up to a multiple of
    FEATURE_WIDTH_STEP, at most max_len (so a store of max_len 320 compiles at most five widths)."""
    return min(max_len, -(-max(longest, 1) // FEATURE_WIDTH_STEP) * FEATURE_WIDTH_STEP)


def _past_length_zeroed(block: np.ndarray, lengths: np.ndarray, max_len: int) -> np.ndarray:
    """[n, w, ...] features of sequences of `lengths` [n] -> [n, max_len, ...], zero at every position
    >= the row's length (never read: the losses mask by length), so what is stored for a sequence
    does not depend on the width or the neighbours it was computed with."""
    pad = [(0, 0), (0, max_len - block.shape[1])] + [(0, 0)] * (block.ndim - 2)
    inside = np.arange(max_len)[None, :] < lengths[:, None]
    return np.pad(block, pad) * inside.reshape(inside.shape + (1,) * (block.ndim - 2)).astype(block.dtype)


def _spec(path: Path, name: str, dtype: str, shape: tuple[int, ...], create: bool) -> dict:
    # tensorstore's file driver rejects relative paths with ".." (e.g. --workdir ../runs): resolve first.
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str((path / name).resolve())}}
    if create:
        spec["metadata"] = {
            "shape": list(shape), "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, *shape[1:]]}},
        }  # fmt: skip
    return spec


@dataclasses.dataclass
class FeatureStore:
    """An open feature store (see the module docstring). `arrays` maps name -> tensorstore."""

    path: Path
    meta: dict
    arrays: dict[str, ts.TensorStore]
    written: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # rows [lo, hi) written here

    @property
    def num_sequences(self) -> int:
        return int(self.meta["num_committed"])

    @property
    def max_len(self) -> int:
        return int(self.meta["max_len"])

    @classmethod
    def open_or_create(
        cls, path: str | Path, *, max_len: int, hidden_size: int, capture_layers: tuple[int, ...],
        dtype: str = "float32",
    ) -> FeatureStore:  # fmt: skip
        """Open an existing store (its layout must match) or create an empty one."""
        path = Path(path)
        if (path / META).exists():
            store = cls.open(path)
            want = {"max_len": max_len, "capture_layers": list(capture_layers), "dtype": dtype}
            have = {k: store.meta[k] for k in want}
            if have != want:
                raise ValueError(f"feature store {path}: layout {have} != requested {want}")
            return store
        path.mkdir(parents=True, exist_ok=True)
        shapes = {
            "tokens": ("int32", (0, max_len)), "lengths": ("int32", (0,)), "starts": ("int32", (0,)),
            "hidden": (dtype, (0, max_len, hidden_size)),
        }  # fmt: skip
        if capture_layers:
            shapes["layers"] = (dtype, (0, max_len, hidden_size * len(capture_layers)))
        shapes["argmax"] = ("int32", (0, max_len))
        for name, (dt, shape) in shapes.items():
            ts.open(_spec(path, name, dt, shape, True), create=True, delete_existing=True).result()
        meta = {"num_committed": 0, "max_len": max_len, "capture_layers": list(capture_layers),
                "dtype": dtype, "ids": [], "argmax": True}  # fmt: skip
        _write_meta(path, meta)
        return cls.open(path)

    @classmethod
    def open(cls, path: str | Path) -> FeatureStore:
        path = Path(path)
        meta = json.loads((path / META).read_text())
        names = ["tokens", "lengths", "starts", "hidden"] + (["layers"] if meta["capture_layers"] else [])
        names += ["argmax"] if meta.get("argmax") else []
        arrays = {name: ts.open(_spec(path, name, "", (), False)).result() for name in names}
        return cls(path=path, meta=meta, arrays=arrays)

    def reserve(self, rows: int) -> None:
        """Grow every array to at least `rows` rows (a metadata write: one process does it)."""
        for name, array in self.arrays.items():
            if array.shape[0] < rows:
                self.arrays[name] = array.resize(
                    exclusive_max=[rows, *array.shape[1:]], expand_only=True
                ).result()

    def reopen(self) -> None:
        """Re-read the arrays' metadata (after another process resized them)."""
        self.arrays = type(self).open(self.path).arrays

    def check_own_chunks(self, lo: int, hi: int, end: int) -> None:
        """Raise unless rows [lo, hi) cover whole chunks of every array (or end at `end`, the last row
        of this writing session): then no other process's rows share a chunk with them."""
        for name, array in self.arrays.items():
            rows = array.chunk_layout.write_chunk.shape[0]
            if lo % rows or (hi % rows and hi != end):
                raise ValueError(
                    f"feature store {self.path}: {name} has chunks of {rows} rows; rows [{lo}, {hi}) of "
                    f"process {jax.process_index()} would share a chunk with another writer's rows"
                )

    def write_rows(self, lo: int, values: dict[str, np.ndarray]) -> list[ts.WriteFutures]:
        """Start writing rows [lo, lo + n) of the named arrays (every value [n, ...]); the futures."""
        futures = []
        for name, value in values.items():
            array = self.arrays[name]
            futures.append(
                array[lo : lo + len(value)].write(np.asarray(value).astype(array.dtype.numpy_dtype))
            )
        return futures

    def commit(self, ids: Sequence[str], *, write: bool = True) -> None:
        """Rows [num_committed, num_committed + len(ids)) are complete: record them in meta.json
        (`write=False`: only in memory, for the processes that do not own the file)."""
        self.meta["num_committed"] = self.num_sequences + len(ids)
        self.meta["ids"] = list(self.meta["ids"]) + list(ids)
        if write:
            _write_meta(self.path, self.meta)

    def read(self, indices: Sequence[int], names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Rows `indices` of the named arrays (default all) as numpy arrays [len(indices), ...]."""
        names = list(names or self.arrays)
        idx = np.asarray(indices, np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_sequences):
            raise IndexError(f"feature store {self.path}: index outside [0, {self.num_sequences})")
        futures = {name: self.arrays[name][ts.d[0].translate_to[0]].oindex[idx].read() for name in names}
        return {name: np.asarray(f.result()) for name, f in futures.items()}


def _write_meta(path: Path, meta: dict) -> None:
    tmp = path / (META + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / META)


def local_row_blocks(array: jax.Array) -> list[tuple[int, int, np.ndarray]]:
    """(lo, hi, rows [hi - lo, ...]) of a global array [B, ...] sharded by rows only: the blocks held by
    this process's devices, each block taken once in the whole run (from its replica 0)."""
    blocks = {}
    for shard in array.addressable_shards:
        if shard.replica_id != 0:
            continue
        lo, hi, _ = (shard.index[0] if shard.index else slice(None)).indices(array.shape[0])
        if tuple(shard.data.shape[1:]) != tuple(array.shape[1:]):
            raise ValueError(f"local_row_blocks: {array.sharding} splits more than the rows")
        blocks[(lo, hi)] = shard.data
    return [(lo, hi, np.asarray(data)) for (lo, hi), data in sorted(blocks.items())]


def write_features(
    model,
    rows: Sequence[dict],
    path: str | Path,
    *,
    max_len: int = 256,
    capture_layers: tuple[int, ...] = (),
    batch_size: int = 8,
    dtype: str = "float32",
    progress: bool = True,
    argmax_from_data: bool = False,
) -> FeatureStore:
    """Run the target over distill `rows` and append their features to the store at `path`.

    argmax_from_data: the rows are greedy self-distillation (every response token is the target's
    argmax after its prefix), so the stored argmax is the data's next token (`next_tokens`) and the
    target's full-vocabulary LM head is not run. Wrong for sampled responses.

    Resumable: rows already committed (by id) are skipped. Rows run longest first, each batch at the
    narrowest `feature_width` that holds it (one compiled program per width). Returns the open store.
    On a mesh (`model.mesh`), each batch of `batch_size` rows (a multiple of the "data" axis) is split
    over "data"; with several processes every process calls this with the same arguments and writes its
    own devices' rows (`FeatureStore.written` lists them).
    """
    mesh = getattr(model, "mesh", None)
    if mesh is not None and batch_size % mesh.shape[DEFAULT_RULES.batch]:
        raise ValueError(
            f"write_features: batch size {batch_size} (--feature-batch) is not a multiple of the mesh's "
            f"{DEFAULT_RULES.batch} axis {mesh.shape[DEFAULT_RULES.batch]}: every data shard needs whole rows"
        )
    primary = jax.process_index() == 0

    def open_store() -> FeatureStore:
        return FeatureStore.open_or_create(
            path, max_len=max_len, hidden_size=model.config.hidden_size, capture_layers=capture_layers,
            dtype=dtype,
        )  # fmt: skip

    if primary:  # creates it when missing; the others open it once it exists
        with contextlib.suppress(ValueError):  # a layout mismatch: raised below by every process alike
            open_store()
    barrier("features/created")
    store = open_store()
    done = set(store.meta["ids"])
    # Longest first, so a batch holds sequences of similar length and runs at the narrowest width that
    # holds them (`feature_width`): padding costs as much as real tokens. Rows are stored by id, so
    # the order changes nothing the trainer reads.
    todo = sorted((r for r in rows if r["id"] not in done), key=lambda r: -packed_length(r, max_len))
    end = store.num_sequences + len(todo)
    if primary:
        store.reserve(end)
    barrier("features/reserved")
    store.reopen()
    compute = _jit_features if argmax_from_data else _jit_features_and_argmax
    if mesh is not None:
        compute = jax.jit(
            target_features if argmax_from_data else target_features_and_argmax,
            static_argnames=("graphdef", "config", "capture_layers"),
            out_shardings=NamedSharding(mesh, PartitionSpec(DEFAULT_RULES.batch)),
        )  # fmt: skip
    empty_caches: dict[int, KVCache] = {}

    def run(tokens: jax.Array) -> tuple[jax.Array, ...]:
        width = tokens.shape[1]
        if width not in empty_caches:  # one empty cache (and one compiled program) per width
            empty = KVCache.zeros(model.config, batch_size, width, model.dtype)
            if mesh is not None:
                empty = jax.tree.map(
                    lambda x, s: put_sharded(np.asarray(x), s), empty, cache_shardings(empty, mesh)
                )
            empty_caches[width] = empty
        return compute(
            model.graphdef, model.params, tokens, config=model.config, capture_layers=capture_layers,
            cache=empty_caches[width],
        )  # fmt: skip

    bar = tqdm(range(0, len(todo), batch_size), desc="features", disable=not (progress and primary))
    for start in bar:
        chunk = todo[start : start + batch_size]
        n, first = len(chunk), store.num_sequences
        packed = pack_sequences(chunk, max_len)
        width = feature_width(int(packed["lengths"].max()), max_len)
        tokens = packed["tokens"][:, :width]
        if n < batch_size:  # keep one compiled shape per width
            tokens = np.concatenate([tokens, np.zeros((batch_size - n, width), np.int32)])
        tokens = place_batch(tokens, mesh) if mesh is not None else jnp.asarray(tokens)
        hidden, layers, *argmax = run(tokens)
        outputs = {"hidden": hidden, "layers": layers, "argmax": argmax[0] if argmax else None}
        outputs = {
            name: local_row_blocks(outputs[name])
            for name in store.arrays
            if name in outputs and outputs[name] is not None
        }
        futures = []
        for i, (lo, hi, _) in enumerate(outputs["hidden"]):
            hi = min(hi, n)  # the padding rows past the batch are not stored
            if lo >= hi:
                continue
            store.check_own_chunks(first + lo, first + hi, end)
            values = {name: packed[name][lo:hi] for name in ("tokens", "lengths", "starts")}
            if argmax_from_data and "argmax" in store.arrays:
                following = next_tokens(packed["tokens"][lo:hi])
                values["argmax"] = _past_length_zeroed(following, packed["lengths"][lo:hi], max_len)
            values.update(
                {
                    name: _past_length_zeroed(blocks[i][2][: hi - lo], packed["lengths"][lo:hi], max_len)
                    for name, blocks in outputs.items()
                }
            )
            futures += store.write_rows(first + lo, values)
            store.written.append((first + lo, first + hi))
        for f in futures:
            f.result()
        barrier(f"features/written/{first}")  # every process's rows are on disk: commit them
        store.commit([r["id"] for r in chunk], write=primary)
    barrier("features/done")  # meta.json is final for every process that reads the store next
    return store
