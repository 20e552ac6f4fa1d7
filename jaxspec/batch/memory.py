"""The batch job's memory check: the largest --batch-size, at most the one asked for, whose weights and
KV cache fit in the memory budget.

The budget is --memory-budget-gib, or else the memory free on the device once the model is loaded
(`jaxspec.model.kv_cache.available_memory_bytes`) plus the loaded weights' bytes; when the free memory
cannot be told, nothing is checked. The weights plus the KV cache may fill MEMORY_FRACTION of the
budget: the rest is left for what the estimate leaves out (activations, logits, output buffers, a
drafter's weights and state). What a batch size needs is `jaxspec.model.kv_cache.decode_memory_bytes`
at the cache length the decoding loop picks (`jaxspec.decoding.generate.cache_length`, with the draft
shape the job's policy picks at that size):

- continuous: `batch_size` slots, each with a cache sized for the longest prompt and the largest
  max_new_tokens of the input, and the prompt cache of the input's recurring prompts (at most the
  slots' KV cache, `jaxspec.decoding.continuous.prompt_cache_budget`; none with --no-prompt-cache);
- static: the largest of the planned batches' (`plan_batches`), each padded to a power of two rows and
  sized for its own requests.

Both are computed over every valid request, finished ones included, so a resumed job with the same
budget decides the same (a budget read from the free memory can differ between runs:
--memory-budget-gib pins it).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from jaxspec.batch.requests import TokenizedRequest
from jaxspec.batch.schedule import plan_batches
from jaxspec.errors import InputError
from jaxspec.model.buckets import batch_bucket

MEMORY_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """bytes: what the job's weights and KV cache share (before MEMORY_FRACTION); source: where it came
    from, for messages ("--memory-budget-gib 2" or "free memory ...")."""

    bytes: int
    source: str

    @property
    def usable(self) -> int:
        return int(self.bytes * MEMORY_FRACTION)


@dataclasses.dataclass(frozen=True)
class MemoryNeed:
    """One compiled batch's memory: `rows` rows (static: padded to a power of two) of `positions`
    cache positions; total (`decode_memory_bytes`, plus the prompt cache) and weights in bytes;
    prompt_cache: bytes of the continuous loop's recurring prompts
    (`jaxspec.decoding.continuous.prompt_cache_plan`)."""

    rows: int
    positions: int
    total: int
    weights: int
    prompt_cache: int = 0

    def describe(self) -> str:
        """'493,832 bytes (482.3 KiB) for 2 rows x 33 cache positions (weights 449.2 KiB + KV cache
        33.0 KiB)'."""
        rows = f"{self.rows} {'row' if self.rows == 1 else 'rows'} x {self.positions} cache positions"
        kv = self.total - self.weights - self.prompt_cache
        parts = f"weights {readable_bytes(self.weights)} + KV cache {readable_bytes(kv)}"
        if self.prompt_cache:
            parts += f" + prompt cache {readable_bytes(self.prompt_cache)}"
        return f"{format_bytes(self.total)} for {rows} ({parts})"


def readable_bytes(n: int) -> str:
    """'482.3 KiB', '1.5 GiB', '512 B'."""
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for larger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.1f} {unit}"


def format_bytes(n: int) -> str:
    """'483,183 bytes (471.9 KiB)': the exact count and a readable size."""
    return f"{n:,} bytes ({readable_bytes(n)})"


def memory_budget(budget_gib: float | None, model: Any) -> MemoryBudget | None:
    """--memory-budget-gib (checked by the job: finite, > 0) as a budget, or else what the device has
    for the weights and the cache with `model` loaded: its free memory now plus the weights' bytes
    (None when the free memory cannot be told: no check)."""
    from jaxspec.model.kv_cache import available_memory_bytes, weights_bytes

    if budget_gib is not None:
        return MemoryBudget(int(budget_gib * 2**30), f"--memory-budget-gib {budget_gib:g}")
    free = available_memory_bytes()
    if free is None:
        return None
    return MemoryBudget(free + weights_bytes(model.params), "free memory (the loaded weights included)")


def batch_need(model: Any, batch: Sequence[TokenizedRequest], rows: int, spec: Any) -> MemoryNeed:
    """The memory of one compiled batch of `rows` rows holding `batch`'s requests, decoded with `spec`."""
    from jaxspec.decoding.generate import cache_length
    from jaxspec.model.kv_cache import decode_memory_bytes, weights_bytes

    longest_prompt = max(len(item.prompt_ids) for item in batch)
    largest_budget = max(item.request.max_new_tokens for item in batch)
    positions = cache_length(model, spec, longest_prompt, largest_budget)
    total = decode_memory_bytes(model.config, model.params, rows, positions)
    return MemoryNeed(rows, positions, total, weights_bytes(model.params))


def job_need(
    model: Any,
    items: Sequence[TokenizedRequest],
    batch_size: int,
    continuous: bool,
    pick_spec: Callable[[int], Any],
    prompt_cache: bool = True,
) -> MemoryNeed:
    """The most memory the job holds at once with `batch_size` (module docstring). items: non-empty.
    prompt_cache: whether a continuous job keeps its recurring prompts' prefills (`--no-prompt-cache`)."""
    if continuous:
        import jax  # here, not at the top: `jaxspec generate --help` must not import jax

        from jaxspec.decoding.continuous import prompt_cache_plan

        need = batch_need(model, items, batch_size, pick_spec(batch_size))
        if not prompt_cache:
            return need
        prompts = [item.prompt_ids for item in items]
        dtype = jax.tree.leaves(model.params)[0].dtype
        _, cached = prompt_cache_plan(model.config, prompts, batch_size, need.positions, dtype)
        return dataclasses.replace(need, total=need.total + cached, prompt_cache=cached)
    needs = []
    for batch in plan_batches(items, batch_size):
        rows = batch_bucket(len(batch))
        needs.append(batch_need(model, batch, rows, pick_spec(rows)))
    return max(needs, key=lambda need: need.total)


def fit_batch_size(
    model: Any,
    items: Sequence[TokenizedRequest],
    batch_size: int,
    continuous: bool,
    pick_spec: Callable[[int], Any],
    budget: MemoryBudget | None,
    input_path: str,
    prompt_cache: bool = True,
) -> int:
    """`batch_size` when it fits `budget` (or no budget is known, or there are no requests), else the
    largest smaller size that fits, found by bisection (the need grows with the size), with a note on
    stderr. InputError naming the longest request when not even 1 fits."""
    if budget is None or not items:
        return batch_size

    def need(size: int) -> MemoryNeed:
        return job_need(model, items, size, continuous, pick_spec, prompt_cache)

    asked = need(batch_size)
    if asked.total <= budget.usable:
        return batch_size
    over = f"over {MEMORY_FRACTION:.0%} of the {format_bytes(budget.bytes)} of {budget.source}"
    one = need(1)
    if one.total > budget.usable:
        longest = max(items, key=lambda item: len(item.prompt_ids) + item.request.max_new_tokens)
        raise InputError(
            f"not enough memory for even --batch-size 1: it needs {one.describe()}, {over}; the longest "
            f"request is {input_path}:{longest.request.line} (id {json.dumps(longest.request.id)}, "
            f"{len(longest.prompt_ids)} prompt tokens + max_new_tokens {longest.request.max_new_tokens})"
        )
    fits, fits_need, fails = 1, one, batch_size  # need(fits) = fits_need fits, need(fails) does not
    while fails - fits > 1:
        middle = (fits + fails) // 2
        middle_need = need(middle)
        if middle_need.total <= budget.usable:
            fits, fits_need = middle, middle_need
        else:
            fails = middle
    print(
        f"jaxspec: note: --batch-size {batch_size} does not fit in memory: it needs {asked.describe()}, "
        f"{over}; running --batch-size {fits} instead, which needs {format_bytes(fits_need.total)}",
        file=sys.stderr,
    )
    return fits
