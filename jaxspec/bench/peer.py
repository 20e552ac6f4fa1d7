"""The peer column: Hugging Face transformers (PyTorch, CPU, float32) on the same model file and the
same prompt token ids — plain greedy `generate` and prompt lookup
(`generate(..., prompt_lookup_num_tokens=K)`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def peer_available() -> bool:
    """True when torch, transformers and accelerate (needed to read GGUF) are importable."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers", "accelerate"))


@dataclasses.dataclass
class PeerModel:
    """A transformers causal LM and a counter of its forward calls (verify rounds + prefill)."""

    model: Any
    eos_token_ids: tuple[int, ...]
    forward_calls: list[int]

    def generate(
        self, prompt_ids: Sequence[int], max_new_tokens: int, prompt_lookup_num_tokens: int | None = None
    ) -> dict[str, Any]:
        """Greedy generation for one prompt -> a stats dict shaped like `Completion.stats`
        (new_tokens, rounds = forwards after the prefill, batch_time_s, token_ids)."""
        import torch

        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        kwargs: dict[str, Any] = {}
        if prompt_lookup_num_tokens:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
        self.forward_calls[0] = 0
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=list(self.eos_token_ids) or None, pad_token_id=(*self.eos_token_ids, 0)[0],
                **kwargs,
            )  # fmt: skip
        elapsed = time.perf_counter() - start
        new = [int(t) for t in out[0, ids.shape[1] :]]
        return {
            "new_tokens": len(new),
            "rounds": max(self.forward_calls[0] - 1, 0),
            "batch_time_s": elapsed,
            "token_ids": new,
        }


def load_peer(
    model_path: str | Path, eos_token_ids: Sequence[int], num_threads: int | None = None
) -> PeerModel:
    """Load `model_path` (a .gguf file or a Hugging Face directory) with transformers in float32.

    num_threads: torch intra-op threads (default: `fastest_thread_count`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    calls = [0]

    def count(_module, _args):
        calls[0] += 1

    model.register_forward_pre_hook(count)
    torch.set_num_threads(num_threads or fastest_thread_count(model))
    return PeerModel(model=model, eos_token_ids=tuple(eos_token_ids), forward_calls=calls)


def fastest_thread_count(model, trials: int = 3) -> int:
    """1 or all visible CPUs, whichever runs a one-token forward faster right now.

    On an oversubscribed machine torch's spinning worker threads can make 2 threads ten times slower
    than 1; on an idle one more threads win. The peer gets its better setting."""
    import torch

    cpus = len(os.sched_getaffinity(0))
    if cpus == 1:
        return 1
    ids = torch.zeros((1, 1), dtype=torch.long)
    best = (float("inf"), 1)
    for threads in (1, cpus):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            model(ids)
            times = []
            for _ in range(trials):
                start = time.perf_counter()
                model(ids)
                times.append(time.perf_counter() - start)
        best = min(best, (sorted(times)[len(times) // 2], threads))
    return best[1]
