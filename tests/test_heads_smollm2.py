"""Every head type on the real SmolLM2-135M with an untrained (random) head, and the shipped EAGLE-3
head (SpecConfig without head=: the API picks the head shipped for the model): greedy speculative
output equals greedy autoregressive output token for token (2 prompts, batch 2, 24 tokens). Chain and
tree are split across the heads here; tests/test_heads_engine.py runs all eight combinations on a tiny
model.
"""

from __future__ import annotations

import pytest

import jaxspec

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
CASES = {
    "medusa-tree": {"method": "medusa", "head": "random", "extra": (("tree_preset", "tree_16"),)},
    "eagle-chain": {"method": "eagle", "head": "random", "num_speculative_tokens": 4},
    "eagle3-tree": {
        "method": "eagle3",
        "head": "random",
        "num_speculative_tokens": 3,
        "topk": 4,
        "num_draft_tokens": 10,
    },
    "eagle3-shipped-chain": {"method": "eagle3", "num_speculative_tokens": 3},
    "mtp-chain": {
        "method": "mtp",
        "head": "random",
        "num_speculative_tokens": 3,
        "extra": (("mtp_num_modules", 2),),
    },
}


@pytest.fixture(scope="module")
def reference(smollm2):
    return [c.token_ids for c in jaxspec.generate(smollm2, PROMPTS, max_new_tokens=24)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_smollm2_head_greedy_equals_autoregressive(smollm2, reference, name):
    out = jaxspec.generate(smollm2, PROMPTS, max_new_tokens=24, spec=CASES[name])
    assert [c.token_ids for c in out] == reference
    for c in out:
        assert c.stats["rounds"] >= 1
    if "shipped" in name:  # a trained head: most rounds accept a draft (a random one accepts ~none)
        assert sum(c.stats["mean_accepted_length"] for c in out) / len(out) > 1.2
