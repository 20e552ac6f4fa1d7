"""Sharded parameters and KV caches on (data x model) meshes of 8 CPU devices (tests/conftest.py).

Two tiny models: "even" has 8 kv heads (every model axis here divides them: attention is sharded) and
"fallback" has 2 kv heads (model axes 4 and 8 do not divide them: attention is replicated over "model",
see jaxspec/sharding.py).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxspec
from jaxspec.config import SamplingParams, SpecConfig
from jaxspec.decoding import speculative as engine
from jaxspec.decoding.prefill import Requests, prefill
from jaxspec.model.forward import attention_for
from jaxspec.model.kv_cache import HeadCache, KVCache
from jaxspec.sampling.processors import SamplingArrays
from jaxspec.sharding import (
    ShardingRules,
    cache_spec,
    constrain_caches,
    logical_to_spec,
    make_mesh,
    num_shards,
    param_sharding,
    parse_mesh_shape,
    place_batch,
)
from pallas_kernels import tree_attention_reference
from tests.tiny_models import save_tiny

MESHES = [(1, 8), (2, 4), (8, 1)]
# 8 rows (the data axis of (8, 1) divides the batch); repeated patterns so n-gram drafts get accepted.
PROMPTS = [[(3 * i + j % (3 + i % 3)) % 300 + 1 for j in range(6 + i)] for i in range(8)]
# Half the rows sample (temperature 1): stateless per-row keys must give the same draws on any mesh.
SAMPLING = [SamplingParams(temperature=1.0 if i % 2 else 0.0) for i in range(8)]
SEEDS = list(range(100, 108))
MAX_NEW = 8
METHODS = {
    "ngram": SpecConfig(method="ngram", num_speculative_tokens=3),
    # A random (seeded, untrained) EAGLE head: its own KV cache lives in the drafter state.
    "eagle": SpecConfig(method="eagle", head="random", num_speculative_tokens=3),
    "draft_model": SpecConfig(method="draft_model", draft_num_layers=1, num_speculative_tokens=3),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharding_models")
    save_tiny("llama", root / "even", num_attention_heads=8, num_key_value_heads=8)
    save_tiny("llama", root / "fallback", num_attention_heads=4, num_key_value_heads=2)
    return {"even": str(root / "even"), "fallback": str(root / "fallback")}


@pytest.fixture(scope="module")
def single_device_tokens(model_dirs):
    """Reference outputs without a mesh, computed once per (model, method)."""
    cache: dict[tuple[str, str], list[list[int]]] = {}

    def get(kind: str, method: str) -> list[list[int]]:
        if (kind, method) not in cache:
            model = jaxspec.load(model_dirs[kind])
            cache[(kind, method)] = run(model, method)
        return cache[(kind, method)]

    return get


def run(model, method: str) -> list[list[int]]:
    completions = jaxspec.generate(
        model, PROMPTS, max_new_tokens=MAX_NEW, sampling=SAMPLING, seed=SEEDS, spec=METHODS[method]
    )
    return [c.token_ids for c in completions]


def spec_of(x: jax.Array) -> P:
    assert isinstance(x.sharding, NamedSharding)
    return x.sharding.spec


def per_device_bytes(x: jax.Array) -> set[int]:
    return {shard.data.nbytes for shard in x.addressable_shards}


# ----------------------------------------------------------------------------------------------------
# Rules table
# ----------------------------------------------------------------------------------------------------


def test_rules_table_maps_logical_axes_with_divisibility_fallback():
    mesh = make_mesh(2, 4)
    cache_axes = ("batch", "kv_heads", "cache_seq", "head_dim")
    assert logical_to_spec(cache_axes, (8, 8, 64, 16), mesh) == P("data", "model", None, None)
    assert logical_to_spec(cache_axes, (8, 2, 64, 16), mesh) == P("data", None, None, None)  # 4 ∤ 2
    assert logical_to_spec(cache_axes, (3, 8, 64, 16), mesh) == P(None, "model", None, None)  # 2 ∤ 3
    # Fused heads x head_dim: divisibility is on the head count (64 = 4 heads of 16: yes; 2 of 32: no).
    assert logical_to_spec(("embed", "heads"), (64, 64), mesh, head_dim=16) == P(None, "model")
    assert logical_to_spec(("embed", "heads"), (64, 64), mesh, head_dim=32) == P(None, None)
    # A mesh axis is used once per array (FSDP rules: embed and batch both on "data").
    fsdp = ShardingRules(embed="data")
    assert logical_to_spec(("embed", "mlp"), (64, 128), mesh, fsdp) == P("data", "model")
    assert logical_to_spec(("batch", "embed"), (8, 64), mesh, fsdp) == P("data", None)
    assert num_shards(P("data", "model", None), mesh) == 8 and num_shards(P(None, "model"), mesh) == 4
    assert parse_mesh_shape("2x4") == (2, 4)
    with pytest.raises(ValueError):
        ShardingRules(heads="model", kv_heads=None)
    with pytest.raises(ValueError):
        make_mesh(4, 4)


def test_param_shardings_from_nnx_paths(model_dirs):
    mesh = make_mesh(2, 4)
    even = jaxspec.load(model_dirs["even"], mesh=mesh)
    assert even.mesh is mesh
    attn = even.params["layers"][0]["self_attn"]
    mlp = even.params["layers"][0]["mlp"]
    # Weights are [*out, in]: qkv_proj [Hkv, G + 2, D, d] is sharded over its kv-head groups.
    assert spec_of(attn["qkv_proj"]["weight"][...]) == P("model", None, None, None)
    assert spec_of(attn["o_proj"]["weight"][...]) == P(None, "model")
    assert spec_of(mlp["gate_up_proj"]["weight"][...]) == P(None, "model", None)
    assert spec_of(mlp["down_proj"]["weight"][...]) == P(None, "model")
    assert spec_of(even.params["embed_tokens"]["embedding"][...]) == P("model", None)
    assert spec_of(even.params["lm_head"]["weight"][...]) == P("model", None)
    assert spec_of(even.params["norm"]["weight"][...]) == P(None)
    # Each device holds only its slice: qkv_proj [8 kv heads, 1 + 2, 8, 64] over model=4 -> 2 groups each.
    qkv = attn["qkv_proj"]["weight"][...]
    assert {s.data.shape for s in qkv.addressable_shards} == {(2, 3, 8, 64)}
    assert per_device_bytes(qkv) == {qkv.nbytes // 4}
    # Same values as the unsharded load.
    plain = jaxspec.load(model_dirs["even"])
    np.testing.assert_array_equal(
        np.asarray(qkv), np.asarray(plain.params["layers"][0]["self_attn"]["qkv_proj"]["weight"][...])
    )

    fallback = jaxspec.load(model_dirs["fallback"], mesh=mesh)  # 2 kv heads, model axis 4
    attn = fallback.params["layers"][0]["self_attn"]
    assert spec_of(attn["qkv_proj"]["weight"][...]) == P(None, None, None, None)
    assert spec_of(attn["o_proj"]["weight"][...]) == P(None, None)
    gate_up = fallback.params["layers"][0]["mlp"]["gate_up_proj"]["weight"][...]
    assert spec_of(gate_up) == P(None, "model", None)
    # Unknown parameters (e.g. a draft head's own layers) are replicated, never an error.
    unknown = param_sharding(("medusa", 0, "linear", "kernel"), (64, 64), mesh, config=fallback.config)
    assert unknown.spec == P(None, None)


# ----------------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------------


def prefill_cache(model, mesh):
    batch = len(PROMPTS)
    tokens = np.zeros((batch, 16), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, : len(p)] = p
    requests = Requests(
        prompt_tokens=tokens,
        prompt_lengths=np.asarray([len(p) for p in PROMPTS], np.int32),
        max_new_tokens=np.full((batch,), MAX_NEW, np.int32),
        seeds=np.asarray(SEEDS, np.int32),
        request_ids=np.zeros((batch,), np.int32),
        sampling=jax.tree.map(np.asarray, SamplingArrays.from_params(SAMPLING, batch)),
    )
    run_prefill = jax.jit(prefill, static_argnames=("graphdef", "config", "max_len", "attention", "mesh"))
    result = run_prefill(
        model.graphdef, model.params, model.config, place_batch(requests, mesh), 48, attention="reference",
        mesh=mesh,
    )  # fmt: skip
    return result.cache


@pytest.mark.parametrize(
    "kind, shape, expected_spec, shards",
    [
        ("even", (1, 8), P("data", "model", None, None), 8),
        ("even", (2, 4), P("data", "model", None, None), 8),
        ("even", (8, 1), P("data", "model", None, None), 8),
        ("fallback", (2, 4), P("data", None, None, None), 2),  # kv heads replicated over model=4
    ],
)
def test_kv_cache_named_sharding_and_per_device_bytes(model_dirs, kind, shape, expected_spec, shards):
    mesh = make_mesh(*shape)
    model = jaxspec.load(model_dirs[kind], mesh=mesh)
    cache = prefill_cache(model, mesh)
    config = model.config
    for buffer in cache.keys + cache.values:
        assert buffer.shape == (8, config.num_kv_heads, 48, config.head_dim)
        assert buffer.sharding.is_equivalent_to(NamedSharding(mesh, expected_spec), 4)
        assert spec_of(buffer) == expected_spec or cache_spec(buffer.shape, mesh) == expected_spec
        assert per_device_bytes(buffer) == {buffer.nbytes // shards}
        assert len(buffer.addressable_shards) == 8
    assert cache.lengths.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 1)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [len(p) for p in PROMPTS])


def test_drafter_state_caches_are_pinned():
    """constrain_caches pins every KVCache and draft-head cache inside a drafter state (4-D and MTP's
    5-D layouts) and leaves other leaves alone."""
    mesh = make_mesh(2, 4)
    state = {
        "target": KVCache(
            keys=(jnp.ones((8, 4, 32, 16)),), values=(jnp.ones((8, 4, 32, 16)),), lengths=jnp.ones(8)
        ),
        "head": HeadCache(keys=jnp.ones((8, 4, 36, 16)), values=jnp.ones((8, 4, 36, 16))),
        "mtp": HeadCache(keys=jnp.ones((2, 8, 2, 36, 16)), values=jnp.ones((2, 8, 2, 36, 16))),
        "other": jnp.ones((8, 5)),
    }
    out = jax.jit(lambda s: constrain_caches(s, mesh))(state)
    assert spec_of(out["target"].keys[0]) == P("data", "model")
    assert spec_of(out["target"].lengths) == P("data")
    assert spec_of(out["head"].values) == P("data", "model")
    assert spec_of(out["mtp"].keys) == P(None, "data")  # 2 kv heads: replicated over model=4
    assert constrain_caches(state, None) is state


# ----------------------------------------------------------------------------------------------------
# Attention per shard (Pallas kernels cannot be partitioned by XLA: they run inside shard_map)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_attention_runs_per_shard_and_matches_unsharded(impl):
    mesh = make_mesh(2, 4)
    b, hq, hkv, n, s, d = 4, 8, 4, 4, 128, 64
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (b, hq, n, d))
    k_cache, v_cache = (jax.random.normal(k, (b, hkv, s, d)) for k in keys[1:3])
    k_tree, v_tree = (jax.random.normal(k, (b, hkv, n, d)) for k in keys[3:5])
    lengths = jnp.asarray([5, 60, s - n, 17], jnp.int32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
    expected = tree_attention_reference(q, k_cache, v_cache, lengths, k_tree, v_tree, mask, scale=d**-0.5)

    kv = cache_spec(k_cache.shape, mesh)
    assert kv == P("data", "model", None, None)
    arrays = (q, k_cache, v_cache, lengths, k_tree, v_tree, mask)
    specs = (kv, kv, kv, P("data"), kv, kv, P("data"))
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(arrays, specs, strict=True)]
    attend = jax.jit(lambda *a: attention_for(impl, mesh)(*a, scale=d**-0.5))
    out = attend(*placed)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "model")), 4)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-5, rtol=2e-5)
    hlo = attend.lower(*placed).compile().as_text()
    assert collective_shapes(hlo) == []


# ----------------------------------------------------------------------------------------------------
# Compiled program: no collective moves the KV cache
# ----------------------------------------------------------------------------------------------------

# One HLO instruction per line: `[ROOT ]name = TYPE op(operands), attributes`. TYPE is a shape or a tuple
# of any arity, whose listing holds "/*index=5*/"-style comments (with "=") every five results: take
# everything between the instruction's "=" and the op name. `-start` is an async collective's first half
# (its `-done` is not counted again).
COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?\S+ = (?P<type>.*?) "
    r"(?P<op>all-gather|all-to-all|collective-permute|all-reduce)(?:-start)?\((?P<rest>.*)$",
    re.MULTILINE,
)
SHAPE = re.compile(r"[a-z0-9]+\[([0-9,]*)\]")


def collective_ops(hlo_text: str) -> list[tuple[str, list[tuple[int, ...]], str]]:
    """(op, result shapes, the rest of the line: operands and attributes) of every collective in
    compiled HLO text; a tuple result gives all its shapes, whatever its arity."""
    found = []
    for m in COLLECTIVE.finditer(hlo_text):
        shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in SHAPE.findall(m.group("type"))]
        found.append((m.group("op"), shapes, m.group("rest")))
    return found


def collective_shapes(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(op, result shape) of every collective in compiled HLO text (tuple results give several)."""
    return [(op, shape) for op, shapes, _ in collective_ops(hlo_text) for shape in shapes]


def test_collective_parser_reads_tuple_results_of_any_arity():
    """XLA combines the data-axis reductions into one tuple all-reduce; past five results its type
    listing holds "/*index=5*/" comments. Every result shape must be seen (7 here), and the hand-written
    line pins a 12-result tuple (comments at 5 and 10)."""
    mesh = make_mesh(8, 1)
    arrays = [jax.device_put(jnp.ones((8, k + 2)), NamedSharding(mesh, P("data"))) for k in range(7)]
    summed = jax.jit(lambda xs: [x.sum(0) for x in xs], out_shardings=NamedSharding(mesh, P()))
    hlo = summed.lower(arrays).compile().as_text()
    assert "/*index=5*/" in hlo
    assert sorted(s for op, s in collective_shapes(hlo) if op == "all-reduce") == [(k + 2,) for k in range(7)]
    results = ", ".join((f"/*index={i}*/" if i % 5 == 0 and i else "") + f"f32[{i + 1},3]{{1,0}}"
                        for i in range(12))  # fmt: skip
    line = f"  ROOT %all-reduce.9 = ({results}) all-reduce(%a), channel_id=1, replica_groups={{{{0,1}}}}"
    assert collective_shapes("%p = f32[2]{0} parameter(0)\n" + line) == [
        ("all-reduce", (i + 1, 3)) for i in range(12)
    ]


def cache_collectives(hlo_text: str, max_len: int) -> list[tuple[str, tuple[int, ...]]]:
    """Collectives whose result is (a piece of) a KV buffer [..., H, S, D] with S >= max_len slots (the
    target's cache has max_len slots, a draft head's a few more)."""
    return [(op, s) for op, s in collective_shapes(hlo_text) if len(s) >= 4 and s[-2] >= max_len]


def test_collective_detector_sees_a_cache_all_gather():
    """The checker below must be able to fail: gathering a sharded cache buffer is detected."""
    mesh = make_mesh(2, 4)
    buffer = jax.ShapeDtypeStruct(
        (8, 8, 48, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", "model", None, None))
    )
    gather = jax.jit(lambda x: x + 1.0, out_shardings=NamedSharding(mesh, P()))
    text = gather.lower(buffer).compile().as_text()
    assert any(op == "all-gather" for op, _ in cache_collectives(text, 48))


@pytest.fixture
def loop_args(monkeypatch):
    """Records the arguments `generate` passes to the speculative loop (to lower the same program)."""
    real = engine.speculative_loop
    recorded = {"real": real}

    def spy(*args, **kwargs):
        recorded["args"], recorded["kwargs"] = args, kwargs
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "speculative_loop", spy)
    return recorded


# ----------------------------------------------------------------------------------------------------
# Sharded generation == single device
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, shape, method",
    [("even", s, m) for m in ("ngram", "eagle") for s in MESHES]
    + [("fallback", (2, 4), "eagle"), ("fallback", (2, 4), "draft_model")],
)
def test_sharded_speculative_generation_matches_single_device(
    model_dirs, single_device_tokens, loop_args, kind, shape, method
):
    expected = single_device_tokens(kind, method)
    mesh = make_mesh(*shape)
    model = jaxspec.load(model_dirs[kind], mesh=mesh)
    tokens = run(model, method)
    assert tokens == expected
    assert all(len(t) == MAX_NEW for t in tokens)

    # The program generate just ran (cached: lowering again does not recompile) moves no KV cache.
    kwargs = loop_args["kwargs"]
    assert kwargs["mesh"] is mesh
    hlo = loop_args["real"].lower(*loop_args["args"], **kwargs).compile().as_text()
    assert "while" in hlo
    assert cache_collectives(hlo, kwargs["max_len"]) == []
    if shape[1] > 1 and kind == "even":  # tensor parallel: the expected all-reduces are there
        assert any(op == "all-reduce" for op, _ in collective_shapes(hlo))


@pytest.mark.slow
def test_sampled_rows_really_sample(model_dirs, single_device_tokens):
    """The temperature-1 rows above draw random tokens (so equal outputs across meshes mean equal keys):
    they differ from greedy decoding of the same prompts (same compiled program, greedy parameters)."""
    sampled = single_device_tokens("even", "ngram")
    model = jaxspec.load(model_dirs["even"])
    greedy = jaxspec.generate(model, PROMPTS, max_new_tokens=MAX_NEW, seed=SEEDS, spec=METHODS["ngram"])
    greedy_tokens = [c.token_ids for c in greedy]
    assert [greedy_tokens[i] for i in range(0, 8, 2)] == [sampled[i] for i in range(0, 8, 2)]
    assert any(greedy_tokens[i] != sampled[i] for i in range(1, 8, 2))
