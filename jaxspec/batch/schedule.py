"""Group requests into batches that share a compiled program.

`jaxspec.generate` compiles one program per (batch bucket, prompt-length bucket, new-token bucket,
method config). Requests sorted by (prompt bucket, new-token bucket) and cut into runs of
`batch_size` give full batches of similar length: little padding, few compilations. A batch may span
two neighbouring buckets; it then runs in the larger one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from jaxspec.batch.requests import TokenizedRequest
from jaxspec.model.buckets import length_bucket


def bucket_key(item: TokenizedRequest) -> tuple[int, int]:
    """(prompt-length bucket, new-token bucket) of one request."""
    return length_bucket(len(item.prompt_ids)), length_bucket(item.request.max_new_tokens)


def plan_batches(items: Sequence[TokenizedRequest], batch_size: int) -> list[list[TokenizedRequest]]:
    """Sort by bucket (input order within a bucket) and cut into batches of at most `batch_size`."""
    if batch_size < 1:
        raise ValueError(f"plan_batches: batch_size must be >= 1, got {batch_size}")
    ordered = sorted(items, key=lambda item: (*bucket_key(item), item.request.line))
    return [list(ordered[i : i + batch_size]) for i in range(0, len(ordered), batch_size)]


def plan_pending(
    items: Sequence[TokenizedRequest], batch_size: int, done: Collection[str]
) -> list[tuple[list[TokenizedRequest], int]]:
    """The whole job's plan (`plan_batches` over every request, finished ones included), then each
    batch's unfinished requests with the planned batch's row count; batches with nothing left dropped.

    A resumed run thereby gives every request the batch-size-dependent choices of an uninterrupted run
    (the `--policy auto` draft shape is picked from the planned row count), so with a fixed seed it gets
    the same tokens. done: keys (`Request.key`) of requests already in the results.
    """
    plan = plan_batches(items, batch_size)
    pending = [([item for item in batch if item.request.key not in done], len(batch)) for batch in plan]
    return [(batch, rows) for batch, rows in pending if batch]
