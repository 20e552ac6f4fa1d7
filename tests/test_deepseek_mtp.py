"""DeepSeek-V3's own MTP layer (model.layers.{L}) as the MTP drafter's module: its forward against a
torch composition of transformers' DeepSeek-V3 layer, and inside the speculative engine (greedy
speculative == greedy autoregressive, forced-acceptance runs, recorded draft logits recomputed from
scratch; chain and tree, batch 4 and 1), and the statistical exactness test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec.drafters.heads.mtp.module import DeepseekMtpModule, mtp_sequence_forward
from jaxspec.drafters.heads.registry import head_for, make_head_drafter
from jaxspec.model.deepseek_v3.config import DeepseekV3Config
from jaxspec.model.forward import causal_mask, model_forward
from jaxspec.model.kv_cache import KVCache
from tests import test_heads_engine, test_heads_exactness
from tests.tiny_deepseek import mtp_reference_logits, save_deepseek, tiny_deepseek, tiny_mtp_layer

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 3, 14], [50, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [7, 7, 7, 10, 20, 30],
           list(range(30, 45))]  # fmt: skip
DEPTH = test_heads_engine.DEPTH


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    torch_model = tiny_deepseek()
    torch_model.config._attn_implementation = "eager"
    tensors, parts = tiny_mtp_layer(torch_model)
    path = tmp_path_factory.mktemp("deepseek_mtp")
    save_deepseek(torch_model, path, mtp=(tensors, parts), fp8=True)
    return torch_model, parts, path, jaxspec.load(str(path), dtype="float32")


def test_mtp_layer_loads_and_matches_the_torch_reference(with_mtp):
    torch_model, parts, path, model = with_mtp
    head = head_for(model, jaxspec.SpecConfig(method="mtp"))  # no head=: the checkpoint's own MTP layer
    assert head.source == str(path)
    assert isinstance(head.config.layer, DeepseekV3Config) and head.config.num_modules == 1
    assert isinstance(nnx.merge(head.graphdef, jax_tree_first(head.params)), DeepseekMtpModule)
    assert head.params["block"]["mlp"]["experts"]["gate_up_proj"].get_value().shape == (1, 8, 2, 16, 32)
    ids = [5, 17, 9, 3, 44, 12, 80, 1, 2, 60]
    n = len(ids)
    hidden, _, _ = model_forward(
        model.graphdef, model.params, jnp.asarray([ids]), jnp.arange(n)[None],
        KVCache.zeros(model.config, 1, n, jnp.float32), causal_mask(1, n),
    )  # fmt: skip
    target = nnx.merge(model.graphdef, model.params)
    _, normed = mtp_sequence_forward(
        head.graphdef, head.params, 0, target.embed(jnp.asarray([ids[1:]])), hidden[:, :-1]
    )
    ours = np.asarray(target.lm_logits(normed))[0]
    ref = mtp_reference_logits(torch_model, parts, ids).numpy()
    assert np.abs(ours - ref).max() <= 1e-4


def jax_tree_first(stacked):
    return jax.tree.map(lambda x: x[0], stacked)


SHAPES = {
    "deepseek-mtp-chain": {"method": "mtp", "num_speculative_tokens": DEPTH},
    "deepseek-mtp-tree": {"method": "mtp", "num_speculative_tokens": DEPTH, "topk": 2, "num_draft_tokens": 5},
}


@pytest.mark.parametrize(
    "name,rows",
    [
        ("deepseek-mtp-chain", 4),
        pytest.param("deepseek-mtp-tree", 4, marks=pytest.mark.slow),
        pytest.param("deepseek-mtp-chain", 1, marks=pytest.mark.slow),
        pytest.param("deepseek-mtp-tree", 1, marks=pytest.mark.slow),
    ],
)
def test_deepseek_mtp_drafter_in_the_engine(monkeypatch, with_mtp, name, rows):
    """`test_heads_engine.check_runs` with the checkpoint's MTP layer: plain greedy == autoregressive,
    oracle-forced drafts all accepted, partial acceptance, every recorded draft logits recomputed."""
    _, _, path, model = with_mtp
    monkeypatch.setitem(test_heads_engine.SHAPES, name, dict(SHAPES[name], head=str(path)))
    test_heads_engine.check_runs(monkeypatch, model, name, PROMPTS[:rows])


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_vocab16")
    save_deepseek(tiny_deepseek(vocab_size=test_heads_exactness.VOCAB), path)
    return jaxspec.load(str(path), dtype="float32")


@pytest.mark.slow
def test_deepseek_mtp_drafts_keep_the_target_distribution(monkeypatch, small_vocab):
    """The statistical exactness test of the other heads, with a random DeepSeek-V3 MTP module (MLA +
    MoE block) drafting for a DeepSeek-V3 target."""
    spec = test_heads_exactness.SPECS["mtp"]
    drafter, _ = make_head_drafter(small_vocab, spec)
    assert isinstance(drafter.config.layer, DeepseekV3Config)
    monkeypatch.setitem(test_heads_exactness.SPECS, "deepseek-mtp", spec)
    test_heads_exactness.test_head_drafts_keep_the_target_distribution(small_vocab, "deepseek-mtp")


@pytest.mark.slow
def test_the_head_trainer_fine_tunes_the_mtp_layer_with_the_target_frozen(with_mtp, tmp_path):
    """The checkpoint's MTP layer trained on the target's own greedy continuations (target frozen):
    its loss falls and its accuracy rises; saved in jaxspec's format and loaded back, it drafts with
    more accepted tokens and the same greedy output."""
    from jaxspec.train.export import save_head
    from jaxspec.train.features import write_features
    from jaxspec.train.losses import Objective
    from jaxspec.train.trainer import TrainConfig, split_trainable, train

    _, _, path, model = with_mtp
    prompts = [np.random.default_rng(i).integers(1, 96, 4).tolist() for i in range(32)]
    continuations = jaxspec.generate(model, prompts, max_new_tokens=20)
    rows = [{"id": f"g{i}", "prompt_ids": p, "response_ids": c.token_ids}
            for i, (p, c) in enumerate(zip(prompts, continuations, strict=True))]  # fmt: skip
    store = write_features(
        model, rows, tmp_path / "fs", max_len=32, capture_layers=(), batch_size=8, progress=False
    )
    head = head_for(model, jaxspec.SpecConfig(method="mtp", head=str(path)))
    trainable, head_fixed = split_trainable(head.params)
    objective = Objective(head.graphdef, head.config, model.graphdef, model.config, depth=2, num_positions=8)
    target_before = [np.asarray(x) for x in jax.tree.leaves(model.params)]
    config = TrainConfig(
        steps=40, batch_size=8, learning_rate=1e-2, warmup_steps=5, log_every=5, checkpoint_every=40
    )
    result = train(objective, {"head": trainable}, {"target": model.params, "head_fixed": head_fixed}, store,
                   tmp_path / "run", config, progress=False)  # fmt: skip
    first, last = result.metrics[0], result.metrics[-1]
    assert last["loss"] < 0.8 * first["loss"]
    assert last["depth_acc"][0] > first["depth_acc"][0] + 0.1
    assert all(
        np.array_equal(a, np.asarray(b))
        for a, b in zip(target_before, jax.tree.leaves(model.params), strict=True)
    )

    trained = nnx.merge_state(result.trainable["head"], head_fixed)
    save_head(tmp_path / "trained", head.config, head.graphdef, trained, dtype="float32")
    spec = dict(method="mtp", num_speculative_tokens=2)
    reference = jaxspec.generate(model, prompts[:4], max_new_tokens=16)
    before = jaxspec.generate(model, prompts[:4], max_new_tokens=16, spec=dict(spec, head=str(path)))
    after = jaxspec.generate(
        model, prompts[:4], max_new_tokens=16, spec=dict(spec, head=str(tmp_path / "trained"))
    )
    assert [c.token_ids for c in after] == [c.token_ids for c in reference] == [c.token_ids for c in before]
    mean = lambda out: np.mean([c.stats["mean_accepted_length"] for c in out])  # noqa: E731
    print(f"MTP fine-tune: loss {first['loss']:.3f} -> {last['loss']:.3f}, depth-1 accuracy "
          f"{first['depth_acc'][0]:.2f} -> {last['depth_acc'][0]:.2f}; mean accepted length "
          f"{mean(before):.2f} -> {mean(after):.2f}")  # fmt: skip
    assert mean(after) > mean(before) + 0.2, (mean(before), mean(after))
