"""DeepSeek-V3 targets on meshes of 8 CPU devices: attention heads over "model", routed experts over
the experts axis (expert parallel), the latent cache over "data"; same greedy tokens as one device and
no collective moves the KV cache (the HLO check of tests/test_sharding.py)."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

import jaxspec
from jaxspec.model.kv_cache import KVCache
from jaxspec.sharding import cache_spec, make_mesh
from tests.test_sharding import cache_collectives, collective_shapes, loop_args  # noqa: F401 (fixture)
from tests.tiny_deepseek import save_deepseek, tiny_deepseek, tiny_mtp_layer

PROMPTS = [[(3 * i + j % (3 + i % 3)) % 90 + 1 for j in range(6 + i)] for i in range(8)]
MAX_NEW = 8


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_sharded")
    torch_model = tiny_deepseek()
    save_deepseek(torch_model, path, mtp=tiny_mtp_layer(torch_model))
    return str(path)


def run(model) -> list[list[int]]:
    spec = jaxspec.SpecConfig(method="mtp", head=model.source, num_speculative_tokens=2)
    return [c.token_ids for c in jaxspec.generate(model, PROMPTS, max_new_tokens=MAX_NEW, spec=spec)]


def test_experts_and_heads_are_sharded_by_the_rules_table(deepseek_dir):
    mesh = make_mesh(2, 4)
    model = jaxspec.load(deepseek_dir, mesh=mesh)
    layer = model.params["layers"][1]
    spec = lambda x: x.get_value().sharding.spec  # noqa: E731
    assert spec(layer["mlp"]["experts"]["gate_up_proj"]) == P("model", None, None, None)
    assert spec(layer["mlp"]["experts"]["down_proj"]) == P("model", None, None)
    assert spec(layer["self_attn"]["q_b_proj"]["weight"]) == P("model", None, None)
    assert spec(layer["self_attn"]["kv_b_proj"]["weight"]) == P("model", None, None)
    assert spec(layer["self_attn"]["o_proj"]["weight"]) == P(None, "model")
    assert spec(layer["self_attn"]["kv_a_proj_with_mqa"]["weight"]) == P(None, None)
    assert spec(layer["mlp"]["shared_experts"]["gate_up_proj"]["weight"]) == P(None, "model", None)
    expert_bytes = {
        s.data.nbytes for s in layer["mlp"]["experts"]["gate_up_proj"].get_value().addressable_shards
    }
    assert expert_bytes == {8 * 2 * 16 * 32 * 4 // 4}  # a quarter of the experts per device
    cache = KVCache.zeros(model.config, 8, 32, jax.numpy.float32)
    assert cache_spec(cache.keys[0].shape, mesh) == P("data", None, None, None)  # latent: rows over data


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
def test_sharded_mtp_generation_matches_single_device(deepseek_dir, loop_args, shape):  # noqa: F811
    expected = run(jaxspec.load(deepseek_dir))
    mesh = make_mesh(*shape)
    tokens = run(jaxspec.load(deepseek_dir, mesh=mesh))
    assert tokens == expected and all(len(t) == MAX_NEW for t in tokens)
    kwargs = loop_args["kwargs"]
    assert kwargs["mesh"] is mesh
    hlo = loop_args["real"].lower(*loop_args["args"], **kwargs).compile().as_text()
    assert "while" in hlo
    assert cache_collectives(hlo, kwargs["max_len"]) == []
    assert any(op == "all-reduce" for op, _ in collective_shapes(hlo))  # experts / heads summed
