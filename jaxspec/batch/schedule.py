"""Group requests into batches that share a compiled program.

`jaxspec.generate` compiles one program per (batch bucket, prompt-length bucket, new-token bucket,
method config). Requests sorted by (prompt bucket, new-token bucket) and cut into runs of
`batch_size` give full batches of similar length: little padding, few compilations. A batch may span
two neighbouring buckets; it then runs in the larger one.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxspec.batch.requests import TokenizedRequest
from jaxspec.buckets import length_bucket


def bucket_key(item: TokenizedRequest) -> tuple[int, int]:
    """(prompt-length bucket, new-token bucket) of one request."""
    return length_bucket(len(item.prompt_ids)), length_bucket(item.request.max_new_tokens)


def plan_batches(items: Sequence[TokenizedRequest], batch_size: int) -> list[list[TokenizedRequest]]:
    """Sort by bucket (input order within a bucket) and cut into batches of at most `batch_size`."""
    if batch_size < 1:
        raise ValueError(f"plan_batches: batch_size must be >= 1, got {batch_size}")
    ordered = sorted(items, key=lambda item: (*bucket_key(item), item.request.line))
    return [list(ordered[i : i + batch_size]) for i in range(0, len(ordered), batch_size)]
