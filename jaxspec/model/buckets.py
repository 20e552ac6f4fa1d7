"""Shape buckets: pad batch and lengths so similar calls reuse one compiled program."""

from __future__ import annotations


def next_power_of_two(n: int, minimum: int = 1) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


def batch_bucket(batch: int) -> int:
    """1, 2, 4, 8, ... rows."""
    return next_power_of_two(batch, 1)


def length_bucket(length: int) -> int:
    """Token lengths padded to powers of two, at least 16."""
    return next_power_of_two(length, 16)
