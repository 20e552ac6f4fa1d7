"""The public `generate`: validate, tokenize, bucket, run one compiled program, build Completions."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxspec.config import INT32_MAX, SamplingParams, SpecConfig
from jaxspec.decoding.autoregressive import autoregressive_buffer_sizes, generate_autoregressive
from jaxspec.decoding.output_buffer import streaming_to
from jaxspec.decoding.prefill import Requests
from jaxspec.decoding.speculative import generate_speculative, spec_buffer_sizes
from jaxspec.distributed import to_host
from jaxspec.drafters.make import make_drafter
from jaxspec.errors import InputError
from jaxspec.model.buckets import batch_bucket, length_bucket
from jaxspec.model.target import Model
from jaxspec.sampling.processors import SamplingArrays
from jaxspec.sharding import place_batch

Prompt = str | Sequence[int]


@dataclasses.dataclass
class Completion:
    """One request's result: new tokens only (EOS included when it stopped the request)."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    stats: dict[str, Any]
    error: str | None = None  # why `text` is empty although tokens were generated (undecodable ids)


def request_id_from_string(request_id: str) -> int:
    """Stable 31-bit integer id for a string request id (the key derivation takes integers)."""
    return zlib.crc32(request_id.encode("utf-8")) & 0x7FFFFFFF


def _as_list(value: Any, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InputError(f"generate: {name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _int_list(value: Any, n: int, name: str, low: int, high: int) -> list[int]:
    """`value` (one int, or one per prompt) as n ints, each an integer (not a float or bool) in
    [low, high]; InputError naming the parameter and prompt otherwise."""
    values = _as_list(value, n, name)
    for i, v in enumerate(values):
        where = f"generate: {name} for prompt {i}"
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise InputError(f"{where} must be an integer, got {v!r}")
        if not low <= v <= high:
            raise InputError(f"{where} must be {f'>= {low}' if v < low else f'<= {high}'}, got {v}")
    return [int(v) for v in values]


def _decode(model: Model, ids: list[int]) -> tuple[str, str | None]:
    """(text, None), or ("", why) when the tokenizer cannot decode `ids` (a model vocabulary larger
    than the tokenizer's): one row's failure must not lose the others."""
    if model.tokenizer is None:
        return "", None
    try:
        return model.tokenizer.decode(ids), None
    except InputError as exc:
        return "", f"cannot decode the generated tokens: {exc}"


def tokenize_prompts(model: Model, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Strings are encoded with the model's tokenizer; token-id lists are checked and passed through."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise InputError("generate: prompts must be a list of strings or of token-id lists")
    token_lists = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if model.tokenizer is None:
                raise InputError(f"generate: prompt {i} is text but the model has no tokenizer")
            ids = list(model.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InputError(f"generate: prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise InputError(
                f"generate: prompt {i} has token id {bad[0]} outside [0, {model.config.vocab_size})"
            )
        token_lists.append(ids)
    return token_lists


@dataclasses.dataclass(frozen=True)
class CheckedRequests:
    """`generate`'s inputs checked and expanded to one entry per prompt."""

    token_lists: list[list[int]]
    max_new: list[int]
    sampling: list[SamplingParams]
    seeds: list[int]
    request_ids: list[int]


def check_requests(
    model: Model,
    prompts: Sequence[Prompt],
    max_new_tokens: int | Sequence[int],
    sampling: SamplingParams | Sequence[SamplingParams] | None,
    seed: int | Sequence[int],
    request_ids: Sequence[int] | None,
) -> CheckedRequests:
    """Tokenize and check `generate`'s arguments (InputError naming the prompt and field)."""
    token_lists = tokenize_prompts(model, prompts)
    n = len(token_lists)
    if n == 0:
        raise InputError("generate: no prompts given")
    max_new = _int_list(max_new_tokens, n, "max_new_tokens", 1, INT32_MAX)
    for i, m in enumerate(max_new):
        context = model.config.max_position_embeddings
        if len(token_lists[i]) + m > context:
            raise InputError(
                f"generate: prompt {i} has {len(token_lists[i])} tokens + max_new_tokens {m} = "
                f"{len(token_lists[i]) + m}, beyond the model's context of {context}"
            )
    sampling_list = _as_list(sampling if sampling is not None else SamplingParams(), n, "sampling")
    seeds = _int_list(seed, n, "seed", 0, INT32_MAX)
    ids = _int_list(list(request_ids) if request_ids is not None else 0, n, "request_ids", 0, INT32_MAX)
    return CheckedRequests(token_lists, max_new, list(sampling_list), seeds, ids)


def check_spec(model: Model, spec: SpecConfig | dict | None) -> SpecConfig | None:
    """`spec` as a SpecConfig (a vLLM-style dict converted), its attention option checked against the
    model's (InputError naming the option)."""
    if isinstance(spec, dict):
        spec = SpecConfig.from_dict(spec)
    if spec is not None and spec.attention not in model.config.attention_impls:
        raise InputError(
            f"SpecConfig.attention={spec.attention!r}: a {model.config.architecture} model runs "
            f"{' | '.join(model.config.attention_impls)}"
        )
    return spec


def cache_length(model: Model, spec: SpecConfig | None, longest_prompt: int, largest_budget: int) -> int:
    """Positions a row of the KV cache `generate` and `generate_continuous` allocate for requests whose
    longest prompt has `longest_prompt` tokens and largest max_new_tokens is `largest_budget`: both
    padded to their length buckets, plus the speculative window's room when `spec` speculates
    (`spec_buffer_sizes`; its drafter is built for that: a head or draft model is loaded, once)."""
    prompt_len, new_bucket = length_bucket(longest_prompt), length_bucket(largest_budget)
    if spec is None or spec.method is None:
        return autoregressive_buffer_sizes(prompt_len, new_bucket)[1]
    drafter, _ = make_drafter(model, spec)
    return spec_buffer_sizes(drafter, prompt_len, new_bucket)[1]


def padded_requests(checked: CheckedRequests, rows: int, prompt_len: int) -> Requests:
    """The checked requests as device arrays: [rows, prompt_len] prompts (padding rows: length 1,
    budget 0, greedy)."""
    n = len(checked.token_lists)
    tokens = np.zeros((rows, prompt_len), np.int32)
    lengths = np.ones((rows,), np.int32)
    budgets = np.zeros((rows,), np.int32)
    for i, t in enumerate(checked.token_lists):
        tokens[i, : len(t)] = t
        lengths[i] = len(t)
        budgets[i] = checked.max_new[i]
    pad = rows - n
    return Requests(
        prompt_tokens=jnp.asarray(tokens),
        prompt_lengths=jnp.asarray(lengths),
        max_new_tokens=jnp.asarray(budgets),
        seeds=jnp.asarray(checked.seeds + [0] * pad, jnp.int32),
        request_ids=jnp.asarray(checked.request_ids + [0] * pad, jnp.int32),
        sampling=SamplingArrays.from_params(checked.sampling + [SamplingParams()] * pad, rows),
    )


def completion(model: Model, token_ids: np.ndarray, stopped: bool, rounds: int, stats: dict) -> Completion:
    """One request's Completion from its output row (token_ids: the kept tokens)."""
    ids = [int(t) for t in token_ids]
    text, error = _decode(model, ids)
    stats = {
        "new_tokens": len(ids),
        "rounds": int(rounds),
        # tokens emitted per verify round (the prefill's first token excluded); 1.0 without speculation
        "mean_accepted_length": (len(ids) - 1) / int(rounds) if rounds > 0 else 0.0,
        **stats,
    }
    finish = "stop" if stopped else "length"
    return Completion(token_ids=ids, text=text, finish_reason=finish, stats=stats, error=error)


def generate(
    model: Model,
    prompts: Sequence[Prompt],
    max_new_tokens: int | Sequence[int] = 64,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    seed: int | Sequence[int] = 0,
    spec: SpecConfig | dict | None = None,
    request_ids: Sequence[int] | None = None,
    stream: Callable[[list[int]], None] | None = None,
) -> list[Completion]:
    """Generate continuations for a batch of prompts in one compiled program.

    Args:
      model: from `jaxspec.load`.
      prompts: strings (encoded with the model's tokenizer, no template) or token-id lists.
      max_new_tokens: per-call or per-prompt budget of new tokens.
      sampling: SamplingParams (or one per prompt); default greedy.
      seed: per-call or per-prompt seed. With request_ids, (seed, request id) fixes a request's random
        stream: the same request gives the same tokens alone or inside any batch.
      spec: SpecConfig (or vLLM-style dict) for speculative decoding; None = autoregressive.
      request_ids: integer ids for the key derivation; default 0 for every prompt, so a request's
        stream depends only on its seed.
      stream: called from inside the compiled loop, after every step / round, with the first prompt's
        new tokens so far (a host callback; calls may repeat a prefix or, rarely, arrive out of order:
        keep the longest). The outputs are the same as without it.
    Returns:
      one Completion per prompt, in order.
    """
    spec = check_spec(model, spec)
    checked = check_requests(model, prompts, max_new_tokens, sampling, seed, request_ids)
    token_lists, max_new = checked.token_lists, checked.max_new
    n = len(token_lists)
    rows = batch_bucket(n)
    prompt_len = length_bucket(max(len(t) for t in token_lists))
    new_bucket = length_bucket(max(max_new))
    requests = padded_requests(checked, rows, prompt_len)
    if model.mesh is not None:  # rows over the "data" axis (every process passes the same inputs)
        requests = place_batch(requests, model.mesh)
    with streaming_to(stream) if stream is not None else contextlib.nullcontext():
        start = time.perf_counter()
        if spec is None or spec.method is None:
            capacity, max_len = autoregressive_buffer_sizes(prompt_len, new_bucket)
            out, rounds = generate_autoregressive(
                model.graphdef, model.params, requests, config=model.config,
                max_len=max_len, capacity=capacity,
                eos_ids=model.eos_token_ids, attention=spec.attention if spec else "auto", mesh=model.mesh,
                stream=stream is not None,
            )  # fmt: skip
            extra: dict[str, np.ndarray] = {}
        else:
            out, rounds, extra = generate_speculative(
                model, requests, spec, prompt_len, new_bucket, stream=stream is not None
            )
        # to_host: also for outputs spread over several processes (gathered to every process).
        out_tokens, counts, stopped, rounds = to_host((out.tokens, out.count, out.stopped, rounds))
    elapsed = time.perf_counter() - start
    extra = to_host(extra)
    completions = []
    for i in range(n):
        stats: dict[str, Any] = {
            "batch_time_s": elapsed,
            "batch_tokens_per_s": float(counts[:n].sum()) / elapsed,
        }
        for key, value in extra.items():
            stats[key] = value[i].tolist() if np.ndim(value[i]) else value[i].item()
        completions.append(completion(model, out_tokens[i, : counts[i]], stopped[i], rounds[i], stats))
    return completions
