"""DeepSeek-V3-family targets (MLA + MoE): parity with transformers, the MLA cache, loading."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import jaxspec
from jaxspec.models.deepseek_v3.config import DeepseekV3Config
from tests.tiny_deepseek import save_deepseek, tiny_deepseek

PROMPTS = [[5, 17, 9, 3], list(range(30, 60)), [42], [7, 7, 7, 1, 2, 3, 4, 5, 6, 8, 90]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch_model = tiny_deepseek()
    path = tmp_path_factory.mktemp("deepseek_tiny")
    save_deepseek(torch_model, path)
    return torch_model, jaxspec.load(str(path), dtype="float32")


def _check_parity(torch_model, model, num_prompts=4):
    worst = 0.0
    for ids in PROMPTS[:num_prompts]:
        with torch.no_grad():
            ref = torch_model(torch.tensor([ids])).logits[0].numpy()
        worst = max(worst, float(np.abs(model.logits(ids) - ref).max()))
    assert worst <= 1e-4, worst
    completions = jaxspec.generate(model, PROMPTS[:num_prompts], max_new_tokens=32)
    for ids, completion in zip(PROMPTS, completions, strict=False):
        with torch.no_grad():
            ref = torch_model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :].tolist()
        assert completion.token_ids == ref
    return worst


def test_tiny_deepseek_logits_and_greedy_match_transformers(tiny):
    torch_model, model = tiny
    assert isinstance(model.config, DeepseekV3Config) and model.config.yarn is not None
    worst = _check_parity(torch_model, model)
    print(f"deepseek_v3 bf16-free fp32: max |dlogit| = {worst:.2e}")


def test_fp8_block_scaled_checkpoint_is_dequantised_at_load(tmp_path):
    torch_model = tiny_deepseek(seed=1)
    save_deepseek(torch_model, tmp_path, fp8=True, shards=3)  # torch_model now holds the dequantised weights
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) == 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.self_attn.q_b_proj.weight_scale_inv" in index
    model = jaxspec.load(str(tmp_path), dtype="float32")
    worst = _check_parity(torch_model, model, num_prompts=2)
    print(f"deepseek_v3 fp8 checkpoint: max |dlogit| = {worst:.2e}")
