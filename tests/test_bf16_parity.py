"""bfloat16 (the accelerator default: bf16 weights and KV cache, f32 softmax / accumulation / logits)
against float32 (the CPU default) on the tiny model.

Stated tolerance: every logit within 5% of the float32 logits' standard deviation (measured: ~3%).
Greedy tokens may differ only at near-ties: wherever float32's top-2 margin exceeds twice the largest
logit difference, the bf16 argmax must be the float32 argmax. Exact greedy-equality tests (speculative
vs autoregressive) run in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxspec
from jaxspec.bench.step_costs import single_request
from jaxspec.config import SamplingParams
from jaxspec.decoding.prefill import prefill
from jaxspec.model.forward import lm_logits
from tests.tiny_models import save_tiny

RELATIVE_TOLERANCE = 0.05  # of the float32 logits' standard deviation


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bf16")
    save_tiny("llama", path)
    return jaxspec.load(str(path), dtype="float32"), jaxspec.load(str(path), dtype="bfloat16")


def _check_parity(fp32_logits: np.ndarray, bf16_logits: np.ndarray) -> None:
    diff = np.abs(bf16_logits - fp32_logits).max()
    assert diff <= RELATIVE_TOLERANCE * fp32_logits.std(), (diff, fp32_logits.std())
    top2 = np.sort(fp32_logits, axis=-1)[..., -2:]
    decisive = top2[..., 1] - top2[..., 0] > 2 * diff
    assert decisive.mean() > 0.5  # the check below is not vacuous
    np.testing.assert_array_equal(bf16_logits.argmax(-1)[decisive], fp32_logits.argmax(-1)[decisive])


def test_bf16_logits_within_tolerance_of_fp32(models):
    fp32, bf16 = models
    assert bf16.dtype == np.dtype("bfloat16") and fp32.dtype == np.float32
    ids = list(np.random.default_rng(0).integers(1, fp32.config.vocab_size, 64))
    _check_parity(fp32.logits(ids), bf16.logits(ids))


def test_bf16_prefill_through_the_kernel_keeps_a_bf16_cache_and_fp32_parity(models):
    """The accelerator path: bf16 weights, prompt in chunks through the Pallas kernel (interpret mode),
    bf16 KV cache; logits of every prompt position against the float32 reference prefill."""
    fp32, bf16 = models
    ids = list(np.random.default_rng(1).integers(1, fp32.config.vocab_size, 64))
    requests = single_request(ids, 8, SamplingParams())
    outs = {}
    for name, model, attention in (("fp32", fp32, "reference"), ("bf16", bf16, "pallas")):
        pre = prefill(
            model.graphdef, model.params, model.config, requests, 128, attention=attention, chunk=16
        )
        outs[name] = (pre, np.asarray(lm_logits(model.graphdef, model.params, pre.hidden[0])))
    assert outs["bf16"][0].cache.keys[0].dtype == np.dtype("bfloat16")
    _check_parity(outs["fp32"][1], outs["bf16"][1])
