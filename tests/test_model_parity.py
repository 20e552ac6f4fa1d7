"""Logits and greedy parity with Hugging Face transformers (the reference implementation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jaxspec
from tests.tiny_models import save_tiny

PROMPTS = [[5, 17, 99, 3], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42], list(range(30, 60))]


@pytest.mark.parametrize(
    "kind,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                },
                "rope_theta": 500000.0,
            },
        ),
        ("qwen2", {}),
        ("qwen3", {}),
        ("mistral", {}),
    ],
)  # fmt: skip
def test_tiny_logits_and_greedy_match_transformers(tmp_path, kind, overrides):
    torch_model = save_tiny(kind, tmp_path, **overrides)
    model = jaxspec.load(str(tmp_path), dtype="float32")
    worst = 0.0
    for ids in PROMPTS:
        with torch.no_grad():
            ref = torch_model(torch.tensor([ids])).logits[0].numpy()
        ours = model.logits(ids)
        worst = max(worst, float(np.abs(ours - ref).max()))
    print(f"{kind} {sorted(overrides)}: max |dlogit| = {worst:.2e}")
    assert worst <= 1e-3

    completions = jaxspec.generate(model, PROMPTS, max_new_tokens=64)
    for ids, completion in zip(PROMPTS, completions, strict=True):
        with torch.no_grad():
            ref = torch_model.generate(
                torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :].tolist()
        assert completion.token_ids == ref
        assert completion.finish_reason == "length"


@pytest.mark.slow
def test_smollm2_gguf_logits_and_greedy_match_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    from jaxspec.loading.registry import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    ref_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    ).eval()
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "Photosynthesis converts light energy into",
    ]
    prompts = [smollm2.tokenizer.encode(t) for t in texts]
    worst = 0.0
    for ids in prompts:
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0].numpy()
        worst = max(worst, float(np.abs(smollm2.logits(ids) - ref).max()))
    print(f"SmolLM2 GGUF: max |dlogit| = {worst:.2e}")
    assert worst <= 1e-3
    completions = jaxspec.generate(smollm2, prompts, max_new_tokens=64)
    for ids, completion in zip(prompts, completions, strict=True):
        with torch.no_grad():
            ref = ref_model.generate(
                torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(ids) :].tolist()
        # jaxspec stops at EOS (kept as the last token); transformers was told not to stop.
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] in smollm2.eos_token_ids
            ref = ref[: len(completion.token_ids)]
        assert completion.token_ids == ref
