"""Per-row output token buffer shared by the autoregressive loop and the speculative engine."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OutputBuffer:
    """tokens [B, T] (T = max new tokens bucket + slack), count [B], done [B], stopped [B] (EOS seen)."""

    tokens: jax.Array
    count: jax.Array
    done: jax.Array
    stopped: jax.Array

    @classmethod
    def empty(cls, batch: int, capacity: int) -> OutputBuffer:
        return cls(
            tokens=jnp.zeros((batch, capacity), jnp.int32),
            count=jnp.zeros((batch,), jnp.int32),
            done=jnp.zeros((batch,), bool),
            stopped=jnp.zeros((batch,), bool),
        )


def append_tokens(
    out: OutputBuffer, new: jax.Array, num_new: jax.Array, max_new: jax.Array, eos_ids: jax.Array
) -> tuple[OutputBuffer, jax.Array]:
    """Append up to num_new[b] tokens of new [B, K] to each unfinished row.

    A row keeps tokens up to and including its first EOS, and never more than max_new[b] in total.
    The buffer's capacity must be >= max(max_new) + K (the K tokens are written as a block).
    Returns the updated buffer and kept [B], the number of tokens each row actually kept.
    """
    k = new.shape[1]
    j = jnp.arange(k)[None, :]
    is_eos = jnp.isin(new, eos_ids) & (j < num_new[:, None])
    first_eos = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1), k)
    kept = jnp.minimum(jnp.minimum(num_new, first_eos + 1), max_new - out.count)
    kept = jnp.where(out.done, 0, jnp.maximum(kept, 0))
    tokens = jax.vmap(lambda row, upd, at: jax.lax.dynamic_update_slice(row, upd, (at,)))(
        out.tokens, new.astype(jnp.int32), out.count
    )
    hit_eos = (first_eos < kept) & ~out.done
    count = out.count + kept
    stopped = out.stopped | hit_eos
    done = out.done | stopped | (count >= max_new)
    return OutputBuffer(tokens=tokens, count=count, done=done, stopped=stopped), kept


def first_output(
    first_token: jax.Array, capacity: int, max_new: jax.Array, eos_ids: jax.Array, stream: bool = False
) -> OutputBuffer:
    """The output buffer after prefill: an empty [B, capacity] buffer with each row's first token
    (first_token [B], sampled by prefill) appended, streamed to the host when `stream`."""
    batch = first_token.shape[0]
    out, _ = append_tokens(
        OutputBuffer.empty(batch, capacity),
        first_token[:, None],
        jnp.ones((batch,), jnp.int32),
        max_new,
        eos_ids,
    )
    if stream:
        stream_first_row(out)
    return out


# Streaming: a loop compiled with stream=True calls `stream_first_row` after every step / round; the
# host callback hands row 0's tokens so far to the listeners `streaming_to` installs for one call.
_LISTENERS: list[Callable[[list[int]], None]] = []


@contextlib.contextmanager
def streaming_to(listener: Callable[[list[int]], None]) -> Iterator[None]:
    """Within the block, every `stream_first_row` call passes row 0's new tokens so far to `listener`."""
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)


def _emit(tokens: np.ndarray, count: np.ndarray) -> None:
    ids = [int(t) for t in np.asarray(tokens)[: int(count)]]
    for listener in list(_LISTENERS):
        listener(ids)


def stream_first_row(out: OutputBuffer) -> None:
    """Host callback from inside the compiled loop: row 0's tokens [T] and count (no effect on outputs;
    callbacks may arrive out of order, so listeners keep the longest prefix they have seen)."""
    jax.debug.callback(_emit, out.tokens[0], out.count[0])
