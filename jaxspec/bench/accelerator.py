"""The one-shot accelerator check behind scripts/accelerator_check.py.

On a GPU/TPU host it measures, in one process and within a time budget:
  1. decode and verify step times inside one compiled loop (`step_costs.forward_step_times`) at
     Llama-3.1-8B and SmolLM2-135M shapes with random weights: the v(N) = verify(N) / decode curve;
  2. autoregressive tokens/s at batch 1, jaxspec against transformers (torch, same dtype, same
     weights: the torch model is initialised randomly and its tensors loaded into jaxspec, static cache);
  3. the tree-attention kernel against the XLA reference and `jax.nn.dot_product_attention`, with
     achieved HBM bandwidth (K/V bytes a perfect kernel reads / time), each timed inside one compiled
     loop over enough input copies to defeat the L2 cache (`kernels.loop_seconds`); before the sweep,
     on GPU, a small tuning grid of the Triton kernel's launch parameters (block_kv, num_warps,
     num_stages), whose best setting is timed beside the defaults in the sweep;
  4. the compiled speculative loop's round time at the AR model's shapes (`round_times`): batch-1
     greedy generation through `jaxspec.generate` with a random head (spec head="random") for the
     README's EAGLE-3 draft shapes (`ROUND_SHAPES`), against the autoregressive loop's time per token:
     each round's cost in decode steps, v(N) + γ·c measured as a whole on the device;
  5. predicted speedups of the methods in the latest CPU benchmarks: τ (hardware independent) from
     their JSON, v(N) from (1), c from the CPU run: τ / (v(N) + γ·c); and, where (4) measured the
     method's draft shape, τ / (the measured round cost).
Sections (`SECTIONS`; `--sections` picks some) run in that order of priority; one that would start
after the budget is recorded as skipped, so the run ends in time. Off `--smoke`, an error in one
measurement is recorded and the run goes on (one chance on the device); `--smoke` runs the same code
on CPU at tiny shapes and raises.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sampling
from jaxspec.bench.kernels import (
    DEFAULT_PEAK_GBPS,
    input_copies,
    kv_bytes,
    loop_seconds,
    make_inputs,
    median_seconds,
)
from jaxspec.bench.step_costs import forward_step_times
from jaxspec.config import SamplingParams
from jaxspec.decoding.prefill import Requests
from jaxspec.model.buckets import length_bucket
from jaxspec.model.config import ModelConfig
from pallas_kernels import tree_attention, tree_attention_gpu

MODEL_SHAPES = {
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rope_theta=500000.0, rope_scaling=(8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072,
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    "tiny": ModelConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=4096,
    ),
}  # fmt: skip


# What a run can measure, in the order it runs them: batch-1 step times of the AR model, the AR
# comparison, speculative round times of the AR model, the GPU kernel's tuning grid, the kernel sweep,
# batch-1 step times of the other models, step times of the AR model at the larger batches.
SECTIONS = ("steps", "ar", "rounds", "tuning", "kernels", "other_models", "large_batches")

# A draft shape (`round_shape`): what a CPU benchmark row's round is timed by at the device's shapes.
ROUND_FIELDS = ("method", "num_speculative_tokens", "topk", "num_draft_tokens", "lookup_min_match")
# The shapes the rounds section times, the README's EAGLE-3 rows: chain of 3, with lookup >= 3, trees
# of 15 and 31 nodes from the top-8 children, depth 6 (the highest τ at those sizes).
ROUND_SHAPES = (
    ("eagle3", 3, 1, None, 0),
    ("eagle3", 3, 1, None, 3),
    ("eagle3", 6, 8, 15, 0),
    ("eagle3", 6, 8, 31, 0),
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures. kernel_heads: (Hq, Hkv, D) of the kernel sweep and tuning;
    tuning_shapes: (batch, prefix, nodes); tuning_configs: (block_kv, num_warps, num_stages, block_rows)
    of the Triton kernel (the first H200 run's grid, then larger row blocks for big trees)."""

    step_models: tuple[str, ...]
    step_batches: tuple[int, ...]
    step_nodes: tuple[int, ...]
    step_prefix: int
    ar_model: str
    ar_new_tokens: int
    kernel_batches: tuple[int, ...]
    kernel_prefixes: tuple[int, ...]
    kernel_nodes: tuple[int, ...]
    kernel_heads: tuple[int, int, int]
    round_new_tokens: int = 128
    round_shapes: tuple[tuple, ...] = ROUND_SHAPES  # in ROUND_FIELDS order
    tuning_shapes: tuple[tuple[int, int, int], ...] = ((1, 32768, 4), (8, 8192, 16), (8, 8192, 64))
    tuning_configs: tuple[tuple[int, int, int, int], ...] = (
        *((block_kv, warps, stages, 64) for block_kv in (32, 64) for warps in (4, 8) for stages in (2, 3, 4)),
        *((64, warps, stages, rows) for rows in (128, 256) for warps in (4, 8) for stages in (2, 3)),
    )
    sections: tuple[str, ...] = SECTIONS
    dtype: str = "bfloat16"
    iters: int = 10
    kernel_iters: int = 32
    budget_s: float = 420.0
    smoke: bool = False


FULL_PLAN = Plan(
    step_models=("llama-3.1-8b", "smollm2-135m"), step_batches=(1, 8, 32),
    step_nodes=(1, 2, 4, 8, 16, 32, 64),
    step_prefix=1024, ar_model="llama-3.1-8b", ar_new_tokens=128, kernel_batches=(1, 8, 32),
    kernel_prefixes=(1024, 8192, 32768), kernel_nodes=(1, 4, 16, 64), kernel_heads=(32, 8, 128),
)  # fmt: skip
SMOKE_PLAN = Plan(
    step_models=("tiny",), step_batches=(1, 2), step_nodes=(1, 4), step_prefix=64, ar_model="tiny",
    ar_new_tokens=8, kernel_batches=(1,), kernel_prefixes=(256,), kernel_nodes=(4,),
    kernel_heads=(4, 2, 64), round_new_tokens=8, round_shapes=ROUND_SHAPES[:1],
    tuning_shapes=((1, 256, 4),), tuning_configs=((16, 4, 2, 16), (32, 4, 2, 16)), iters=2, kernel_iters=2,
    budget_s=75.0, smoke=True,
)  # fmt: skip


class Budget:
    """Wall-clock budget: `admits(cost_s)` says whether a step expected to take cost_s still fits."""

    def __init__(self, seconds: float):
        self.start = time.perf_counter()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def admits(self, cost_s: float) -> bool:
        return self.elapsed() + cost_s <= self.seconds


class Recorder:
    """Runs measurements, keeping their results, skips (budget) and errors."""

    def __init__(self, plan: Plan, budget: Budget):
        self.plan, self.budget = plan, budget
        self.skipped: list[str] = []
        self.errors: dict[str, str] = {}

    def run(self, name: str, fn: Callable[[], Any], cost_s: float) -> Any:
        """fn() unless the budget cannot take cost_s more seconds (a smoke run skips nothing)."""
        if not self.plan.smoke and not self.budget.admits(cost_s):
            self.skipped.append(name)
            print(f"[{self.budget.elapsed():6.1f}s] skipped (budget): {name}", flush=True)
            return None
        print(f"[{self.budget.elapsed():6.1f}s] {name}", flush=True)
        try:
            return fn()
        except Exception as error:  # one chance on the device: record it and go on
            if self.plan.smoke:
                raise
            self.errors[name] = "".join(traceback.format_exception_only(type(error), error)).strip()[-2000:]
            print(f"  error: {self.errors[name]}", flush=True)
            return None

    def run_attention(self, name: str, fn: Callable[[str], dict], cost_s: float) -> dict | None:
        """fn("auto") (the backend's kernel); if that raises, fn("reference") so the run still gets its
        figure. The result records which attention produced it."""
        for attention in ("auto", "reference"):
            label = name if attention == "auto" else f"{name} (attention=reference)"
            result = self.run(label, lambda attention=attention: fn(attention), cost_s)
            if result is not None:
                return {**result, "attention": attention}
            if label not in self.errors:  # skipped for the budget: do not try again
                return None
        return None


# ---------------------------------------------------------------- random models (jax and torch)


def _hf_config(config: ModelConfig):
    import transformers

    rope_scaling = None
    if config.rope_scaling is not None:
        factor, low, high, original = config.rope_scaling
        rope_scaling = {
            "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original,
        }  # fmt: skip
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        rope_scaling=rope_scaling, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings, bos_token_id=None, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip


def torch_random_model(config: ModelConfig, dtype: str):
    """A randomly initialised transformers LlamaForCausalLM of this shape on the GPU (CPU if none),
    or None when torch / transformers are missing."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        torch.manual_seed(0)
        with torch.device(device), torch.no_grad():
            model = transformers.LlamaForCausalLM(_hf_config(config)).eval()
    finally:
        torch.set_default_dtype(previous)
    return model


def _release_torch_memory() -> None:
    """Hand torch's cached device memory back (jax allocates on demand beside it)."""
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _to_numpy(tensor) -> np.ndarray:
    import ml_dtypes
    import torch

    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return tensor.cpu().numpy()


def random_model(config: ModelConfig, dtype: str, torch_model=None):
    """(graphdef, params): the torch model's weights when given (same weights on both sides), else a
    random jax initialisation."""
    if torch_model is not None:
        from jaxspec.loading.weights import state_from_hf_tensors

        tensors = {name: _to_numpy(t) for name, t in torch_model.state_dict().items()}
        return state_from_hf_tensors(config, tensors, jnp.dtype(dtype), source="random torch weights")
    from flax import nnx

    from jaxspec.model.llama import LlamaModel

    return nnx.split(LlamaModel(config, jnp.dtype(dtype), rngs=nnx.Rngs(0)))


# ---------------------------------------------------------------- measurements


def step_times(recorder: Recorder, name: str, graphdef, params, batches: tuple[int, ...]) -> dict:
    plan = recorder.plan
    config = MODEL_SHAPES[name]
    out = {}
    for batch in batches:
        # ~15 s per tree size for Llama-3.1-8B shapes (first H200 run: 107 s for 7 sizes and decode)
        cost = 3.0 * len(plan.step_nodes) * (1 + config.num_layers / 8)
        result = recorder.run_attention(
            f"step times {name} batch {batch}",
            lambda attention, batch=batch: forward_step_times(
                graphdef,
                params,
                config,
                batch=batch,
                prefix=plan.step_prefix,
                nodes=plan.step_nodes,
                attention=attention,
                iters=plan.iters,
            ),  # fmt: skip
            cost,
        )
        if result is not None:
            out[batch] = result
    return out


def jaxspec_ar(
    graphdef, params, config: ModelConfig, prompt: np.ndarray, new_tokens: int, attention: str = "auto"
) -> dict:
    """Autoregressive greedy generation at batch 1 (the compiled prefill + decode loop)."""
    from jaxspec.decoding.autoregressive import generate_autoregressive

    p = length_bucket(len(prompt))
    tokens = np.zeros((1, p), np.int32)
    tokens[0, : len(prompt)] = prompt
    requests = Requests(
        prompt_tokens=jnp.asarray(tokens), prompt_lengths=jnp.asarray([len(prompt)], jnp.int32),
        max_new_tokens=jnp.asarray([new_tokens], jnp.int32), seeds=jnp.zeros((1,), jnp.int32),
        request_ids=jnp.zeros((1,), jnp.int32),
        sampling=sampling.SamplingArrays.from_params(SamplingParams(), 1),
    )  # fmt: skip
    capacity = length_bucket(new_tokens)
    run = functools.partial(
        generate_autoregressive, graphdef, params, requests, config=config, max_len=p + capacity + 16,
        capacity=capacity, eos_ids=(), attention=attention,
    )  # fmt: skip
    seconds = median_seconds(lambda: run()[0].tokens, 3)
    out, _ = run()
    return {
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds,
        "tokens": np.asarray(out.tokens[0, :new_tokens]),
    }


def transformers_ar(torch_model, prompt: np.ndarray, new_tokens: int) -> dict:
    """transformers greedy generate, batch 1, static cache."""
    import torch

    device = next(torch_model.parameters()).device
    ids = torch.as_tensor(np.asarray(prompt)[None], device=device)

    def run():
        with torch.no_grad():
            out = torch_model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                cache_implementation="static", pad_token_id=0,
            )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    run()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = out[0, len(prompt) :].cpu().numpy()
    return {"seconds": seconds, "tokens_per_s": new_tokens / seconds, "tokens": tokens}


def ar_comparison(
    graphdef, params, torch_model, config: ModelConfig, new_tokens: int, attention: str = "auto"
) -> dict:
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, 16).astype(np.int32)
    ours = jaxspec_ar(graphdef, params, config, prompt, new_tokens, attention)
    result: dict[str, Any] = {
        "new_tokens": new_tokens,
        "prompt_tokens": len(prompt),
        "jaxspec_tok_s": ours["tokens_per_s"],
    }
    if torch_model is not None:
        theirs = transformers_ar(torch_model, prompt, new_tokens)
        same = np.asarray(ours["tokens"]) == np.asarray(theirs["tokens"])
        result.update(
            transformers_tok_s=theirs["tokens_per_s"],
            ratio=ours["tokens_per_s"] / theirs["tokens_per_s"],
            # Same weights: greedy tokens agree until the first bf16 near-tie.
            leading_tokens_equal=int(np.argmin(same)) if not same.all() else len(same),
        )
    return result


def _kernel_inputs(plan: Plan, batch: int, prefix: int, nodes: int) -> list[dict[str, jax.Array]]:
    """The operands at this shape, in enough copies to defeat the cache (one in a smoke run)."""
    q_heads, kv_heads, head_dim = plan.kernel_heads

    def make(seed: int) -> dict[str, jax.Array]:
        return make_inputs(
            batch, prefix, nodes, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=plan.dtype,
            seed=seed,
        )  # fmt: skip

    inputs = make(0)
    return [inputs] if plan.smoke else input_copies(inputs, make)


def _gpu_kernel(plan: Plan, config: tuple[int, ...]) -> Callable[..., jax.Array]:
    """The Triton kernel at one (block_kv, num_warps, num_stages, block_rows); interpreted on CPU
    (smoke)."""
    block_kv, num_warps, num_stages, block_rows = config
    return functools.partial(
        tree_attention_gpu, scale=plan.kernel_heads[2] ** -0.5, block_kv=block_kv, num_warps=num_warps,
        num_stages=num_stages, block_rows=block_rows, interpret=jax.default_backend() == "cpu",
    )  # fmt: skip


def kernel_tuning(recorder: Recorder) -> dict:
    """Times the Triton kernel at each of plan.tuning_configs on each of plan.tuning_shapes.
    Returns {"rows": [{shape, config, us, gbps}], "best": the config with the lowest geometric-mean
    time over the shapes (among those that ran at every shape), "best_by_shape": {"BxPxN": config}}."""
    plan = recorder.plan
    rows = []
    for batch, prefix, nodes in plan.tuning_shapes:
        copies = _kernel_inputs(plan, batch, prefix, nodes)
        for config in plan.tuning_configs:
            seconds = recorder.run(
                f"tuning batch {batch} prefix {prefix} nodes {nodes} config {config}",
                lambda c=config, x=copies: loop_seconds(_gpu_kernel(plan, c), x, plan.kernel_iters),
                3.0,
            )  # fmt: skip
            if seconds is not None:
                rows.append({
                    "batch": batch, "prefix": prefix, "nodes": nodes, "config": list(config),
                    "us": seconds * 1e6, "gbps": kv_bytes(copies[0]) / seconds / 1e9,
                })  # fmt: skip
    shapes = {(r["batch"], r["prefix"], r["nodes"]) for r in rows}
    complete = [
        c for c in plan.tuning_configs
        if sum(1 for r in rows if tuple(r["config"]) == c) == len(shapes) and shapes
    ]  # fmt: skip

    def log_mean(config: tuple[int, ...]) -> float:
        return statistics.mean(math.log(r["us"]) for r in rows if tuple(r["config"]) == config)

    by_shape: dict[str, dict] = {}
    for r in rows:
        key = f"{r['batch']}x{r['prefix']}x{r['nodes']}"
        if key not in by_shape or r["us"] < by_shape[key]["us"]:
            by_shape[key] = r
    return {
        "rows": rows,
        "best": list(min(complete, key=log_mean)) if complete else None,
        "best_by_shape": {key: r["config"] for key, r in by_shape.items()},
    }


def kernel_row(
    batch: int, prefix: int, nodes: int, plan: Plan, peak_gbps: float | None, tuned: list[int] | None = None
) -> dict:
    copies = _kernel_inputs(plan, batch, prefix, nodes)
    inputs = copies[0]
    scale = plan.kernel_heads[2] ** -0.5
    kernel = functools.partial(tree_attention, scale=scale, impl="pallas")
    reference = functools.partial(tree_attention, scale=scale, impl="reference")
    dpa = functools.partial(_dpa, scale=scale)
    iters = plan.kernel_iters
    expected = jax.jit(reference)(**inputs).astype(jnp.float32)
    nbytes = kv_bytes(inputs)

    def measure(fn: Callable[..., jax.Array]) -> tuple[float, float, float | None, float]:
        """(µs per call, GB/s of K/V read, share of peak, max |error| against the reference)."""
        us = loop_seconds(fn, copies, iters) * 1e6
        gbps = nbytes / (us * 1e-6) / 1e9
        error = float(jnp.max(jnp.abs(jax.jit(fn)(**inputs).astype(jnp.float32) - expected)))
        return us, gbps, gbps / peak_gbps if peak_gbps else None, error

    row: dict[str, Any] = {"batch": batch, "prefix": prefix, "nodes": nodes, "copies": len(copies)}
    row["kernel_us"], row["kernel_gbps"], row["of_peak"], row["max_abs_err"] = measure(kernel)
    row["reference_us"] = loop_seconds(reference, copies, iters) * 1e6
    row["dot_product_attention_us"] = loop_seconds(dpa, copies, iters) * 1e6
    row["tuned_config"] = tuned
    if tuned is not None:
        tuned_kernel = _gpu_kernel(plan, tuple(tuned))
        row["tuned_us"], row["tuned_gbps"], row["tuned_of_peak"], row["tuned_max_abs_err"] = measure(
            tuned_kernel
        )
    return row


@functools.partial(jax.jit, static_argnames=("scale",))
def _dpa(q, k_cache, v_cache, lengths, k_tree, v_tree, tree_mask, *, scale):
    """The same attention through `jax.nn.dot_product_attention` (cuDNN / XLA) over prefix + tree."""
    s = k_cache.shape[2]
    keys = jnp.concatenate([k_cache, k_tree], axis=2).transpose(0, 2, 1, 3)  # [B, S + N, Hkv, D]
    values = jnp.concatenate([v_cache, v_tree], axis=2).transpose(0, 2, 1, 3)
    prefix_ok = jnp.arange(s)[None, None, :] < lengths[:, None, None]  # [B, 1, S]
    visible = jnp.concatenate([jnp.broadcast_to(prefix_ok, (*tree_mask.shape[:2], s)), tree_mask], axis=2)
    out = jax.nn.dot_product_attention(
        q.transpose(0, 2, 1, 3), keys, values, mask=visible[:, None], scale=scale
    )  # [B, N, Hq, D]
    return out.transpose(0, 2, 1, 3)


def _v_at(v_by_nodes: dict[int, float], nodes: int) -> float | None:
    """v(N) at the smallest measured N >= nodes (the forward pads nothing, so cost grows with N)."""
    measured = sorted(n for n in v_by_nodes if n >= nodes)
    return v_by_nodes[measured[0]] if measured else None


def round_shape(spec: dict | None) -> dict | None:
    """A CPU benchmark variant's draft shape (ROUND_FIELDS), or None where a random head cannot draft
    it: no head method, or a Medusa tree (built from the trained head's calibration)."""
    from jaxspec.config import HEAD_METHODS

    if not spec or spec.get("method") not in HEAD_METHODS:
        return None
    if spec["method"] == "medusa" and (spec.get("topk", 1) > 1 or spec.get("tree_choices")):
        return None
    shape = {field: spec.get(field) for field in ROUND_FIELDS}
    shape["lookup_min_match"] = shape["lookup_min_match"] or 0
    return shape


def cpu_bench_methods(bench_dir: Path) -> list[dict]:
    """Speculative rows of the CPU benchmarks under bench_dir/*/bench.json: label, τ, γ, N, c (CPU),
    draft shape (`round_shape`)."""
    rows = []
    for path in sorted(bench_dir.glob("*/bench.json")):
        data = json.loads(path.read_text())
        variants = {v["label"]: v for v in data.get("raw", {}).get("variants", [])}
        for row in data.get("summary", {}).get("rows", []):
            variant = variants.get(row["label"], {})
            cost = variant.get("step_costs") or {}
            if row.get("method") in (None, "ar") or row.get("tau") is None or not cost:
                continue
            rows.append({
                "bench": path.parent.name, "label": row["label"], "tau": row["tau"],
                "gamma": cost.get("gamma", 1), "nodes": cost.get("num_nodes", 1), "c_cpu": cost.get("c", 0.0),
                "cpu_speedup": row.get("speedup"), "round_shape": round_shape(variant.get("spec")),
            })  # fmt: skip
    return rows


def generate_seconds(target, spec, new_tokens: int) -> tuple[float, dict]:
    """(median seconds of 3 runs after a compiling one, the stats of one) of batch-1 greedy generation
    of `new_tokens` from a fixed 16-token prompt through `jaxspec.generate`: prefill + the compiled loop
    (spec None or method None: autoregressive)."""
    from jaxspec.decoding.generate import generate

    prompt = np.random.default_rng(0).integers(1, target.config.vocab_size, 16).tolist()
    generate(target, [prompt], max_new_tokens=new_tokens, spec=spec)  # compiles
    runs = [generate(target, [prompt], max_new_tokens=new_tokens, spec=spec)[0] for _ in range(3)]
    return statistics.median(run.stats["batch_time_s"] for run in runs), runs[0].stats


def round_times(recorder: Recorder, graphdef, params, name: str) -> dict | None:
    """The speculative loop's seconds per round at model `name`'s shapes for each of the plan's draft
    shapes (`ROUND_SHAPES`), with a random head (SpecConfig head="random"), against the autoregressive
    loop's seconds per token; each timed apart (`generate_seconds`), so a failing shape loses only
    itself. A random head's drafts are rarely accepted, so this measures a round's cost, not τ:
    round_cost = seconds per round / seconds per AR token, in decode steps (the v(N) + γ·c of the
    speedup model, measured as a whole). Both include the one prefill, spread over the rounds and over
    the tokens (~1/rounds of a decode step more in the round cost when few drafts are accepted)."""
    from jaxspec.config import SpecConfig
    from jaxspec.model.target import Model

    plan, config = recorder.plan, MODEL_SHAPES[name]
    target = Model(config=config, graphdef=graphdef, params=params, tokenizer=None, source="random weights")
    new_tokens = plan.round_new_tokens
    cost = 10.0 + 20.0 * config.num_layers / 32  # one compile + 4 runs; a tree's compile ~2x (8B shapes)
    base = recorder.run_attention(
        f"AR token time {name}",
        lambda attention: {
            "token_s": generate_seconds(target, SpecConfig(attention=attention), new_tokens)[0]
        },
        cost,
    )
    if base is None:
        return None
    token_s = base["token_s"] / new_tokens
    rows = []
    for values in plan.round_shapes:
        shape = dict(zip(ROUND_FIELDS, values, strict=True))

        def row(attention: str, shape=shape) -> dict:
            seconds, stats = generate_seconds(
                target, SpecConfig(**shape, head="random", attention=attention), new_tokens
            )
            round_s = seconds / max(stats["rounds"], 1)
            return {
                "shape": shape, "seconds": seconds, "rounds": stats["rounds"], "round_s": round_s,
                "round_cost": round_s / token_s, "tau_random_head": stats["mean_accepted_length"],
            }  # fmt: skip

        label = ", ".join(f"{k}={v}" for k, v in shape.items() if v not in (None, 0))
        measured = recorder.run_attention(f"round time {name} {label}", row, 2 * cost)
        if measured is not None:
            rows.append(measured)
    return {"new_tokens": new_tokens, "ar_token_s": token_s, "attention": base["attention"], "rows": rows}


def predictions(methods: list[dict], v_by_nodes: dict[int, float], rounds: dict | None = None) -> list[dict]:
    """Each method's predicted speedup from v(N) and the CPU's c, and (`predicted_from_round`) from the
    round cost measured at its draft shape (`round_times`), where that was measured."""
    costs = {tuple(r["shape"].items()): r["round_cost"] for r in (rounds or {}).get("rows", [])}
    out = []
    for m in methods:
        v = _v_at(v_by_nodes, m["nodes"])
        predicted = m["tau"] / (v + m["gamma"] * m["c_cpu"]) if v else None
        shape = m.get("round_shape")
        cost = costs.get(tuple(shape.items())) if shape is not None else None
        out.append({
            **m, "v_device": v, "predicted_speedup": predicted, "round_cost_device": cost,
            "predicted_from_round": m["tau"] / cost if cost else None,
        })  # fmt: skip
    return out


# ---------------------------------------------------------------- the run and its report


def run_check(plan: Plan, bench_dir: Path) -> dict:
    budget = Budget(plan.budget_s)
    recorder = Recorder(plan, budget)
    backend = jax.default_backend()
    results: dict[str, Any] = {
        "device": jax.devices()[0].device_kind, "backend": backend, "jax": jax.__version__,
        "python": platform.python_version(), "plan": dataclasses.asdict(plan), "smoke": plan.smoke,
        "step_times": {}, "ar": None, "rounds": None, "kernel": [], "predictions": [],
    }  # fmt: skip
    peak = None if backend == "cpu" else DEFAULT_PEAK_GBPS.get(backend)
    results["peak_gbps"] = peak

    wants = set(plan.sections)
    results["tuning"] = None

    # 1 + 2: the AR model first (batch 1 v(N), then the AR comparison on the same weights).
    first = plan.ar_model
    config = MODEL_SHAPES[first]
    torch_model = model = None
    if "ar" in wants:
        torch_model = recorder.run(
            f"random torch model {first}", lambda: torch_random_model(config, plan.dtype), 30.0
        )
    if wants & {"steps", "ar", "rounds", "large_batches"}:
        model = recorder.run(
            f"random jax model {first}", lambda: random_model(config, plan.dtype, torch_model), 30.0
        )
    results["step_times"][first] = {}
    if model is not None:
        graphdef, params = model
        if "steps" in wants:
            results["step_times"][first] = step_times(
                recorder, first, graphdef, params, plan.step_batches[:1]
            )
        if "ar" in wants:
            results["ar"] = recorder.run_attention(
                f"AR tok/s {first}",
                lambda attention: ar_comparison(
                    graphdef, params, torch_model, config, plan.ar_new_tokens, attention
                ),
                60.0,
            )
    torch_model = None  # free the torch copy (and its cached device memory) before the rounds and kernels
    _release_torch_memory()
    methods = cpu_bench_methods(bench_dir)
    results["rounds"] = None
    if model is not None and "rounds" in wants:
        results["rounds"] = round_times(recorder, *model, first)

    # 3: the Triton kernel's tuning grid (GPU; interpreted in a smoke run), then the kernel sweep.
    tuned = None
    if "tuning" in wants and backend in ("gpu", "cpu"):
        results["tuning"] = kernel_tuning(recorder)
        tuned = results["tuning"]["best"]
    if "kernels" in wants:
        for batch in plan.kernel_batches:
            for prefix in plan.kernel_prefixes:
                for nodes in plan.kernel_nodes:
                    row = recorder.run(
                        f"kernel batch {batch} prefix {prefix} nodes {nodes}",
                        lambda b=batch, p=prefix, n=nodes: kernel_row(b, p, n, plan, peak, tuned),
                        8.0,
                    )
                    if row is not None:
                        results["kernel"].append(row)

    # Then the other models at batch 1, then the larger batches.
    if "other_models" in wants:
        for name in [m for m in plan.step_models if m != first]:
            built = recorder.run(
                f"random jax model {name}", lambda n=name: random_model(MODEL_SHAPES[n], plan.dtype), 20.0
            )
            if built is not None:
                results["step_times"][name] = step_times(recorder, name, *built, plan.step_batches[:1])
    if model is not None and "large_batches" in wants:
        results["step_times"][first].update(step_times(recorder, first, *model, plan.step_batches[1:]))

    v_batch1 = results["step_times"].get(first, {}).get(plan.step_batches[0], {}).get("v", {})
    results["predictions"] = predictions(methods, v_batch1, results["rounds"])
    results["skipped"] = recorder.skipped
    results["errors"] = recorder.errors
    results["elapsed_s"] = budget.elapsed()
    return results


def _fmt(x: Any, spec: str = ".3g") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def report_markdown(results: dict, command: str) -> str:
    lines = [
        "# Accelerator check",
        "",
        f"`{command}` on {results['device']} ({results['backend']}, jax {results['jax']}), "
        f"{results['elapsed_s']:.0f} s."
        + (" SMOKE RUN: tiny shapes on CPU, times are not meaningful." if results["smoke"] else ""),
        "",
        "## Decode and verify step times (one compiled loop, random weights)",
        "",
        "v(N) = verify step over N nodes / decode step; prefix "
        f"{results['plan']['step_prefix']} tokens, {results['plan']['dtype']}.",
        "",
    ]
    nodes = results["plan"]["step_nodes"]
    lines += ["| model | batch | attention | decode ms | " + " | ".join(f"v({n})" for n in nodes) + " |"]
    lines += ["|" + "---|" * (4 + len(nodes))]
    for name, by_batch in results["step_times"].items():
        for batch, r in sorted(by_batch.items()):
            vs = " | ".join(_fmt(r["v"].get(n), ".2f") for n in nodes)
            lines.append(f"| {name} | {batch} | {r['attention']} | {r['decode_s'] * 1e3:.2f} | {vs} |")
    ar = results["ar"]
    lines += [
        "",
        f"## Autoregressive tokens/s, batch 1 ({results['plan']['ar_model']} shapes, random weights)",
        "",
    ]
    if ar:
        lines += [
            "| attention | jaxspec tok/s | transformers tok/s | ratio | leading greedy tokens equal |",
            "|---|---|---|---|---|",
            f"| {ar['attention']} | {_fmt(ar['jaxspec_tok_s'], '.1f')} | "
            f"{_fmt(ar.get('transformers_tok_s'), '.1f')} | "
            f"{_fmt(ar.get('ratio'), '.2f')} | {ar.get('leading_tokens_equal', '—')} / {ar['new_tokens']} |",
        ]
    else:
        lines.append("not measured (see errors / skipped)")
    q_heads, kv_heads, head_dim = results["plan"]["kernel_heads"]
    tuning = results.get("tuning")
    if tuning:
        lines += ["", "## Triton kernel launch parameters (tuning grid)", ""]
        lines += [
            f"Hq={q_heads} Hkv={kv_heads} D={head_dim}; µs per call (GB/s of K/V read), timed in one "
            f"compiled loop; best (lowest geometric mean over the shapes): {tuning['best']}; best per "
            f"shape: {tuning.get('best_by_shape')}.",
            "",
        ]
        shapes = sorted({(r["batch"], r["prefix"], r["nodes"]) for r in tuning["rows"]})
        lines += [
            "| block_kv, warps, stages, block_rows | "
            + " | ".join(f"B{b} P{p} N{n}" for b, p, n in shapes)
            + " |"
        ]
        lines += ["|" + "---|" * (1 + len(shapes))]
        by_config: dict[tuple, dict] = {}
        for r in tuning["rows"]:
            by_config.setdefault(tuple(r["config"]), {})[(r["batch"], r["prefix"], r["nodes"])] = r
        for config, cells in by_config.items():
            row = " | ".join(
                f"{cells[x]['us']:.1f} ({cells[x]['gbps']:.0f})" if x in cells else "—" for x in shapes
            )
            lines.append(f"| {', '.join(map(str, config))} | {row} |")
    lines += ["", "## Tree attention: Pallas kernel vs XLA reference vs jax.nn.dot_product_attention", ""]
    lines += [
        f"Hq={q_heads} Hkv={kv_heads} D={head_dim}; µs per call timed inside one compiled loop over `copies` "
        "input sets (K/V read from HBM, not L2); bandwidth = K/V bytes read / kernel time. "
        "tuned = the kernel at the tuning grid's best launch parameters.",
        "",
    ]
    lines += [
        "| batch | prefix | nodes | copies | kernel us | tuned us | reference us | dot_product_attention us "
        "| GB/s | of peak | tuned GB/s | tuned of peak | max err |"
    ]
    lines += ["|" + "---|" * 13]
    for r in results["kernel"]:
        lines.append(
            f"| {r['batch']} | {r['prefix']} | {r['nodes']} | {r.get('copies', 1)} | {r['kernel_us']:.1f} | "
            f"{_fmt(r.get('tuned_us'), '.1f')} | {r['reference_us']:.1f} | "
            f"{r['dot_product_attention_us']:.1f} | {r['kernel_gbps']:.1f} | {_fmt(r['of_peak'], '.1%')} | "
            f"{_fmt(r.get('tuned_gbps'), '.1f')} | {_fmt(r.get('tuned_of_peak'), '.1%')} | "
            f"{r['max_abs_err']:.2e} |"
        )
    rounds = results.get("rounds")
    lines += [
        "",
        f"## Speculative round times, batch 1 ({results['plan']['ar_model']} shapes, random head)",
        "",
    ]
    if rounds:
        lines += [
            f"`jaxspec.generate`, greedy, {rounds['new_tokens']} new tokens, a random head of the method "
            f"(its drafts are rarely accepted: this times a round, not τ); autoregressive "
            f"{rounds['ar_token_s'] * 1e3:.2f} ms per token. Round cost = round time / AR token time, "
            f"in decode steps (v(N) + γ·c measured as a whole); attention {rounds['attention']}.",
            "",
            "| draft shape | rounds | round ms | round cost | τ of the random head |",
            "|---|---|---|---|---|",
        ]
        for r in rounds["rows"]:
            shape = ", ".join(f"{k}={v}" for k, v in r["shape"].items() if v not in (None, 0))
            lines.append(
                f"| {shape} | {r['rounds']} | {r['round_s'] * 1e3:.2f} | {r['round_cost']:.2f} | "
                f"{r['tau_random_head']:.2f} |"
            )
    else:
        lines.append("not measured (see errors / skipped)")
    lines += ["", "## Predicted speedups on this device", ""]
    lines += [
        "τ from the CPU benchmark JSON, v(N) measured here at batch 1, c from the CPU run: τ / (v(N) + γ·c); "
        "from round: τ / the round cost measured above at the method's draft shape.",
        "",
    ]
    lines += [
        "| bench | method | τ | γ | N | v(N) | c (CPU) | predicted | round cost | predicted from round "
        "| CPU measured |",
        "|" + "---|" * 11,
    ]
    for p in results["predictions"]:
        lines.append(
            f"| {p['bench']} | {p['label']} | {p['tau']:.2f} | {p['gamma']} | {p['nodes']} | "
            f"{_fmt(p['v_device'], '.2f')} | {p['c_cpu']:.3f} | {_fmt(p['predicted_speedup'], '.2f')} | "
            f"{_fmt(p.get('round_cost_device'), '.2f')} | {_fmt(p.get('predicted_from_round'), '.2f')} | "
            f"{_fmt(p['cpu_speedup'], '.2f')} |"
        )
    lines += ["", f"Skipped (time budget): {', '.join(results['skipped']) or 'none'}.", ""]
    if results["errors"]:
        lines += (
            ["## Errors", ""]
            + [f"- {k}: `{v.splitlines()[-1]}`" for k, v in results["errors"].items()]
            + [""]
        )
    return "\n".join(lines)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def write_report(results: dict, out_dir: Path, command: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(_jsonable(results), indent=1) + "\n")
    (out_dir / "report.md").write_text(report_markdown(results, command))
