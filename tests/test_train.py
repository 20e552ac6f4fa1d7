"""Head training on a tiny model: data files survive kills, heads learn, training resumes exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.train.distill import append_jsonl_rows, read_jsonl_rows
from tests.xla_flags import xla_flags

REPO = Path(__file__).resolve().parents[1]
VOCAB = 320
LEARNING_RATE = 2e-2


def self_distilled_rows(model, n: int, length: int = 24, prompt_len: int = 4, seed: int = 0) -> list[dict]:
    """The tiny target's own greedy continuations of random prompts (labels = the target's argmax)."""
    import jax.numpy as jnp

    from jaxspec.model.forward import lm_logits
    from jaxspec.train.features import target_features

    @jax.jit
    def next_tokens(tokens, last):
        hidden, _ = target_features(model.graphdef, model.params, tokens, config=model.config)
        logits = lm_logits(model.graphdef, model.params, hidden[:, last])
        return jnp.argmax(logits, -1).astype(jnp.int32)

    tokens = np.zeros((n, length), np.int32)
    tokens[:, :prompt_len] = np.random.default_rng(seed).integers(1, VOCAB, (n, prompt_len))
    for pos in range(prompt_len, length):  # causal: the padding after `pos` cannot change its logits
        tokens[:, pos] = np.asarray(next_tokens(jnp.asarray(tokens), pos - 1))
    return [
        {"id": f"g{i}", "prompt_ids": t[:prompt_len].tolist(), "response_ids": t[prompt_len:].tolist()}
        for i, t in enumerate(tokens)
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import save_tiny

    directory = tmp_path_factory.mktemp("tiny_llama")
    save_tiny("llama", directory)
    return directory


@pytest.fixture(scope="module")
def tiny_model(tiny):
    import jaxspec

    return jaxspec.load(str(tiny))


@pytest.fixture(scope="module")
def rows(tiny_model):
    return self_distilled_rows(tiny_model, 32)


@pytest.fixture(scope="module")
def store(tiny_model, rows, tmp_path_factory):
    from jaxspec.train.features import write_features

    path = tmp_path_factory.mktemp("features")
    return write_features(tiny_model, rows, path, max_len=32, capture_layers=(0, 1, 1),
                          batch_size=8, progress=False)  # fmt: skip


def test_jsonl_torn_last_line_is_cut_and_rows_kept(tmp_path):
    path = tmp_path / "out.jsonl"
    append_jsonl_rows(path, [{"id": "a"}, {"id": "b"}])
    with open(path, "ab") as f:
        f.write(b'{"id": "c", "respo')  # killed mid-write
    assert [r["id"] for r in read_jsonl_rows(path)] == ["a", "b"]
    assert path.read_bytes().endswith(b'"b"}\n')
    append_jsonl_rows(path, [{"id": "c"}])
    assert [r["id"] for r in read_jsonl_rows(path)] == ["a", "b", "c"]
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(ValueError, match="out.jsonl:2"):
        read_jsonl_rows(path)


def test_feature_store_opens_under_a_relative_path_with_dotdot(tmp_path, monkeypatch):
    from jaxspec.train.features import FeatureStore

    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # as `jaxspec train --workdir ../runs` from a checkout
    created = FeatureStore.open_or_create("../runs/fs", max_len=8, hidden_size=4, capture_layers=())
    assert created.num_sequences == 0
    assert FeatureStore.open("../runs/fs").num_sequences == 0
    assert (tmp_path / "runs" / "fs" / "tokens").is_dir()


def test_feature_store_resumes_and_ignores_uncommitted_rows(tiny_model, rows, store, tmp_path):
    from jaxspec.train.features import FeatureStore, write_features

    part = write_features(tiny_model, rows[:8], tmp_path / "fs", max_len=32, capture_layers=(0, 1, 1),
                          batch_size=8, progress=False)  # fmt: skip
    # A batch in flight when the writer died: data written past num_committed but never committed.
    garbage = {k: np.ones((8,) + tuple(a.shape[1:]), a.dtype.numpy_dtype) for k, a in part.arrays.items()}
    part.arrays = {k: a.resize(exclusive_max=[16, *a.shape[1:]]).result() for k, a in part.arrays.items()}
    for k, a in part.arrays.items():
        a[8:16].write(garbage[k]).result()
    assert FeatureStore.open(tmp_path / "fs").num_sequences == 8
    resumed = write_features(tiny_model, rows, tmp_path / "fs", max_len=32, capture_layers=(0, 1, 1),
                             batch_size=8, progress=False)  # fmt: skip
    assert resumed.num_sequences == 32
    # Rows are stored longest first within a writing session, so compare them by id.
    full, again = _rows_by_id(store, [r["id"] for r in rows]), _rows_by_id(resumed, [r["id"] for r in rows])
    for name in full:
        np.testing.assert_array_equal(full[name], again[name], err_msg=name)
    assert full["lengths"][0] == 24 and full["starts"][0] == 4
    assert np.abs(full["hidden"][:, :24]).sum() > 0


def _rows_by_id(store, ids):
    index = {row_id: i for i, row_id in enumerate(store.meta["ids"])}
    return store.read([index[row_id] for row_id in ids])


def test_feature_batches_run_at_the_narrowest_width_and_store_the_same_values(
    tiny_model, rows, store, tmp_path, monkeypatch
):
    from jaxspec.train import features

    # Sequences of 8..31 tokens in a store of max_len 160: stored longest first, every batch at the
    # narrowest multiple of 64 that holds it (not 160); inside its length a sequence's stored values
    # equal the max_len-32 store's (causal: a prefix's features), zeros after.
    varied = [dict(r, response_ids=r["response_ids"][: 4 + (7 * i) % 17]) for i, r in enumerate(rows)]
    lengths = np.array([len(r["prompt_ids"]) + len(r["response_ids"]) for r in varied])
    widths = []
    compute = features._jit_features_and_argmax

    def recording(*args, **kwargs):
        widths.append(args[2].shape[1])
        return compute(*args, **kwargs)

    monkeypatch.setattr(features, "_jit_features_and_argmax", recording)
    wide = features.write_features(tiny_model, varied, tmp_path / "wide", max_len=160,
                                   capture_layers=(0, 1, 1), batch_size=8, progress=False)  # fmt: skip
    assert widths == [64] * 4
    ids = [r["id"] for r in varied]
    stored_lengths = wide.read(range(32), ["lengths"])["lengths"].tolist()
    assert stored_lengths == sorted(lengths.tolist(), reverse=True)
    narrow, wide_rows = _rows_by_id(store, ids), _rows_by_id(wide, ids)
    inside = np.arange(160)[None, :] < lengths[:, None]
    for name in ("hidden", "layers", "argmax"):
        values = wide_rows[name]
        assert not np.any(values[~inside]), name
        for i, n in enumerate(lengths):
            np.testing.assert_allclose(values[i, :n], narrow[name][i, :n], rtol=1e-5, atol=1e-5, err_msg=name)


def _train_tiny(tiny_model, store, method: str, steps: int, run_dir: Path, online: bool = False):
    from jaxspec.train.head_setup import head_config_for, new_head
    from jaxspec.train.losses import Objective
    from jaxspec.train.trainer import TrainConfig, split_trainable, train

    config = head_config_for(
        method, tiny_model.config, depth=2, draft_vocab_size=128, eagle3_layers=(0, 1, 1)
    )
    head = new_head(config, seed=0, draft_ids=np.arange(0, 256, 2))
    trainable, head_fixed = split_trainable(head.params)
    objective = Objective(head.graphdef, config, tiny_model.graphdef, tiny_model.config,
                          depth=1 if method == "eagle" else 2, num_positions=8)  # fmt: skip
    train_config = TrainConfig(
        steps=steps,
        batch_size=8,
        learning_rate=LEARNING_RATE,
        warmup_steps=5,
        log_every=5,
        checkpoint_every=steps,
    )
    fixed = {"target": tiny_model.params, "head_fixed": head_fixed}
    return train(
        objective, {"head": trainable}, fixed, store, run_dir, train_config, online=online, progress=False
    )


def _first_and_last(metrics: list[dict]) -> tuple[dict, dict]:
    """The first logged entry and the mean of the last three (single steps are noisy)."""
    last = metrics[-3:]
    mean = {
        "loss": float(np.mean([m["loss"] for m in last])),
        "depth_acc": np.mean([m["depth_acc"] for m in last], axis=0).tolist(),
    }
    return metrics[0], mean


def test_medusa_loss_falls_and_accuracy_rises(tiny_model, store, tmp_path):
    result = _train_tiny(tiny_model, store, "medusa", 60, tmp_path / "run")
    first, last = _first_and_last(result.metrics)
    assert last["loss"] < 0.75 * first["loss"]
    assert last["depth_acc"][0] > first["depth_acc"][0] + 0.1
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_attention_heads_learn(tiny_model, store, tmp_path, method):
    result = _train_tiny(tiny_model, store, method, 60, tmp_path / "run")
    first, last = _first_and_last(result.metrics)
    # EAGLE's soft targets keep the loss near the target's entropy: it falls little, accuracy rises.
    assert last["loss"] < first["loss"]
    assert last["depth_acc"][0] > first["depth_acc"][0] + 0.1


@pytest.mark.slow
def test_online_features_give_the_offline_loss(tiny_model, rows, store, tmp_path):
    from jaxspec.train.cli import OnlineSource

    offline = _train_tiny(tiny_model, store, "eagle3", 5, tmp_path / "off")
    online = _train_tiny(tiny_model, OnlineSource(rows, 32), "eagle3", 5, tmp_path / "on", online=True)
    np.testing.assert_allclose(offline.metrics[-1]["loss"], online.metrics[-1]["loss"], rtol=1e-4)


def _eagle3_loss_inputs(tiny_model, store, depth: int, draft_ids: np.ndarray):
    """An EAGLE-3 head of `depth` TTT steps over `draft_ids` on the tiny target: (config, head, trainable,
    fixed, batch of the store's first 8 sequences), what `Objective` needs."""
    import jax.numpy as jnp

    from jaxspec.train.head_setup import head_config_for, new_head
    from jaxspec.train.trainer import split_trainable

    config = head_config_for(
        "eagle3", tiny_model.config, depth=depth, draft_vocab_size=len(draft_ids), eagle3_layers=(0, 1, 1)
    )
    head = new_head(config, seed=0, draft_ids=draft_ids)
    trainable, head_fixed = split_trainable(head.params)
    fixed = {"target": tiny_model.params, "head_fixed": head_fixed}
    batch = {k: jnp.asarray(v) for k, v in store.read(list(range(8))).items()}
    return config, head, trainable, fixed, batch


def test_eagle3_loss_at_sampled_positions_estimates_the_all_position_loss(tiny_model, store):
    """EAGLE-3's loss at num_positions sampled pairs per row: the mean over keys is the all-pairs loss
    (rows of equal length, so each sampled pair is uniform over the same count), and a sample of every
    pair is the all-pairs loss exactly."""
    from jaxspec.train.losses import Objective

    config, head, trainable, fixed, batch = _eagle3_loss_inputs(tiny_model, store, 2, np.arange(0, 256, 2))
    assert (
        len(set(np.asarray(batch["lengths"]).tolist())) == 1
        and len(set(np.asarray(batch["starts"]).tolist())) == 1
    )

    def loss_fn(num_positions):
        objective = Objective(head.graphdef, config, tiny_model.graphdef, tiny_model.config,
                              depth=2, num_positions=num_positions)  # fmt: skip
        return jax.jit(lambda key: objective({"head": trainable}, fixed, batch, key)[1]["depth_loss"])

    all_pairs = np.asarray(loss_fn(32)(jax.random.key(0)))
    np.testing.assert_allclose(np.asarray(loss_fn(32)(jax.random.key(7))), all_pairs, rtol=1e-6)
    sampled_fn = loss_fn(4)
    samples = np.stack([np.asarray(sampled_fn(jax.random.key(i))) for i in range(200)])  # [200, depth]
    assert samples.std(0).min() > 0  # the positions do vary with the key
    error = np.abs(samples.mean(0) - all_pairs)
    assert np.all(error < 4 * samples.std(0) / np.sqrt(len(samples))), (samples.mean(0), all_pairs)


def _cli(workdir: Path, tiny: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "jaxspec.cli", "train", "--method", "medusa", "--model", str(tiny),
        "--workdir", str(workdir), "--stages", "train,export", "--steps", "60", "--batch-size", "8",
        "--checkpoint-every", "4", "--depth", "2", "--num-positions", "8", "--max-len", "32",
        "--save-dtype", "float32", "--no-progress", "--output", str(workdir / "head"), *extra,
    ]  # fmt: skip


def _env() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), XLA_FLAGS=xla_flags())


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(tiny, rows, store, tmp_path):
    import shutil

    from jaxspec.train.export import load_saved_head

    dirs = {}
    for name in ("straight", "killed"):
        d = tmp_path / name
        d.mkdir()
        append_jsonl_rows(d / "distill.jsonl", rows)
        shutil.copytree(store.path, d / "features")
        dirs[name] = d
    subprocess.run(_cli(dirs["straight"], tiny), check=True, env=_env(), cwd=REPO, capture_output=True)

    proc = subprocess.Popen(_cli(dirs["killed"], tiny), env=_env(), cwd=REPO, stderr=subprocess.PIPE)
    checkpoints = dirs["killed"] / "run_medusa" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and not (checkpoints / "12").exists() and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert steps and max(steps) < 60, f"the run was not interrupted mid-training: {steps}"
    assert not (dirs["killed"] / "head").exists()
    # Without --resume the checkpoints are not silently overwritten: a one-line error that says why.
    again = subprocess.run(_cli(dirs["killed"], tiny), env=_env(), cwd=REPO, capture_output=True, text=True)
    assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr
    assert (
        f"{dirs['killed'] / 'run_medusa'} already has checkpoints" in again.stderr
        and "--resume" in again.stderr
    )
    subprocess.run(
        _cli(dirs["killed"], tiny, "--resume"), check=True, env=_env(), cwd=REPO, capture_output=True
    )

    a, b = load_saved_head(dirs["straight"] / "head"), load_saved_head(dirs["killed"] / "head")
    import jax

    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    info = json.loads((dirs["killed"] / "head" / "training.json").read_text())
    assert info["steps"] == 60
    # Every distilled row was featured and none held out (no --val-fraction): training.json says so.
    assert (info["train_sequences"], info["val_sequences"]) == (info["sequences"], 0)
    log_steps = [
        json.loads(line)["step"] for line in (dirs["killed"] / "run_medusa" / "metrics.jsonl").open()
    ]
    assert log_steps == sorted(set(log_steps)) and log_steps[-1] == 60


_WRITER = """
import sys, json, jaxspec
from jaxspec.train.features import write_features
from jaxspec.train.distill import distill
rows = json.loads(open(sys.argv[3]).read())
model = jaxspec.load(sys.argv[2])
if sys.argv[1] == "features":
    write_features(model, rows, sys.argv[4], max_len=32, capture_layers=(0, 1, 1), batch_size=2,
                   progress=False)
else:
    # Pace the appends (a tiny model can finish every request within one poll of the parent, which then
    # kills a finished run): the kill lands mid-run every time.
    import time, jaxspec.decoding.continuous as continuous
    unpaced = continuous.generate_continuous
    def paced(*a, on_finished, **k):
        return unpaced(*a, on_finished=lambda done: (on_finished(done), time.sleep(0.25)), **k)
    continuous.generate_continuous = paced
    distill(model, rows, sys.argv[4], max_new_tokens=8, batch_size=2, progress=False, steps_per_call=2)
"""


def _kill_when(proc, ready, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
def test_kill_during_feature_writing_and_distillation_loses_nothing(tiny, tiny_model, rows, store, tmp_path):
    from jaxspec.decoding.generate import generate, request_id_from_string
    from jaxspec.train.distill import distill
    from jaxspec.train.features import FeatureStore, write_features

    (tmp_path / "rows.json").write_text(json.dumps(rows))
    fs = tmp_path / "fs"

    def committed() -> int:
        try:
            return json.loads((fs / "meta.json").read_text())["num_committed"]
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    cmd = [sys.executable, "-c", _WRITER, "features", str(tiny), str(tmp_path / "rows.json"), str(fs)]
    _kill_when(subprocess.Popen(cmd, env=_env(), cwd=REPO), lambda: committed() >= 4)
    partial = FeatureStore.open(fs)
    n = partial.num_sequences
    assert 4 <= n < 32
    np.testing.assert_array_equal(partial.read(range(n))["hidden"], store.read(range(n))["hidden"])
    resumed = write_features(
        tiny_model, rows, fs, max_len=32, capture_layers=(0, 1, 1), batch_size=2, progress=False
    )
    np.testing.assert_array_equal(resumed.read(range(32))["layers"], store.read(range(32))["layers"])

    out = tmp_path / "distill.jsonl"
    prompts = [{"id": r["id"], "prompt_ids": r["prompt_ids"]} for r in rows[:12]]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    cmd = [sys.executable, "-c", _WRITER, "distill", str(tiny), str(tmp_path / "prompts.json"), str(out)]
    _kill_when(
        subprocess.Popen(cmd, env=_env(), cwd=REPO),
        lambda: out.exists() and out.read_bytes().count(b"\n") >= 4,
    )
    kept = read_jsonl_rows(out)
    assert 4 <= len(kept) < 12
    reference = distill(
        tiny_model, prompts, tmp_path / "reference.jsonl", max_new_tokens=8, batch_size=2, progress=False
    )
    resumed_rows = distill(tiny_model, prompts, out, max_new_tokens=8, batch_size=2, progress=False)
    # Rows land in finishing order: each prompt once, with the same answer as an uninterrupted run and
    # as `jaxspec.generate` gives for the prompt alone.
    assert sorted(r["id"] for r in resumed_rows) == sorted(r["id"] for r in prompts)
    assert resumed_rows[: len(kept)] == kept
    by_id = {r["id"]: r for r in reference}
    assert all(r == by_id[r["id"]] for r in resumed_rows)
    alone = [
        generate(
            tiny_model, [p["prompt_ids"]], max_new_tokens=8, request_ids=[request_id_from_string(p["id"])]
        )[0]
        for p in prompts
    ]
    assert [by_id[p["id"]]["response_ids"] for p in prompts] == [c.token_ids for c in alone]


def test_argmax_from_greedy_data_is_the_targets_argmax_at_every_response_position(
    tiny, tiny_model, rows, store, tmp_path, capsys
):
    """`write_features(argmax_from_data=True)` (`--feature-argmax data`, the default for a greedy data
    set) stores the data's next token as the target's argmax: on greedy self-distilled rows it equals
    the argmax the target's LM head gives at every position whose prediction is a response token, with
    the same features; `--feature-argmax data` on a data set with a sampled run is refused."""
    from jaxspec.cli import main
    from jaxspec.loading.dataset import DistilledDataset
    from jaxspec.train.features import write_features

    fast = write_features(tiny_model, rows, tmp_path / "fast", max_len=32, capture_layers=(0, 1, 1),
                          batch_size=8, progress=False, argmax_from_data=True)  # fmt: skip
    assert fast.meta["ids"] == store.meta["ids"]
    everything = range(store.num_sequences)
    want, got = store.read(everything), fast.read(everything)
    checked = 0
    for i in everything:
        start, length = int(want["starts"][i]), int(want["lengths"][i])
        response = np.arange(start - 1, length - 1)  # positions whose prediction is a response token
        np.testing.assert_array_equal(got["argmax"][i][response], want["argmax"][i][response])
        checked += len(response)
    assert checked > 200
    for name in ("hidden", "layers"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)

    data = DistilledDataset.open_or_create(tmp_path / "data", model="tiny", vocab_size=VOCAB)
    writer = data.writer(prompt_source="test", seed=0, sampling="temperature=0.7")
    writer.append(rows[:4])
    writer.finish()
    capsys.readouterr()
    code = main([
        "train", "--method", "eagle3", "--model", str(tiny), "--workdir", str(tmp_path / "work"),
        "--dataset", str(tmp_path / "data"), "--stages", "features", "--max-len", "32", "--no-progress",
        "--feature-argmax", "data",
    ])  # fmt: skip
    assert code == 2
    assert "--feature-argmax data needs greedy responses" in capsys.readouterr().err
    assert not (tmp_path / "work" / "features").exists()


def test_eagle3_position_mask_drops_exactly_the_targets_outside_the_draft_vocabulary(tiny_model, store):
    """EAGLE-3's loss counts a pair only where the target's full-vocabulary argmax is in the draft
    vocabulary: changing the target distribution at the other positions leaves the loss unchanged, at
    a counted position it changes it; the stored argmax and the LM-head fallback give the same loss."""
    import jax.numpy as jnp

    from jaxspec.train.losses import Objective

    draft_ids = np.arange(0, 256, 4)
    config, head, trainable, fixed, batch = _eagle3_loss_inputs(tiny_model, store, 1, draft_ids)
    objective = Objective(head.graphdef, config, tiny_model.graphdef, tiny_model.config, depth=1,
                          num_positions=64)  # fmt: skip
    loss = jax.jit(lambda batch: objective({"head": trainable}, fixed, batch, jax.random.key(0))[0])
    assert "argmax" in batch
    np.testing.assert_array_equal(  # the stored argmax is the target's own
        np.asarray(batch["argmax"][0, :24]),
        np.argmax(tiny_model.logits(np.asarray(batch["tokens"][0, :24])), -1),
    )
    base = float(loss(batch))
    without_stored = {k: v for k, v in batch.items() if k != "argmax"}
    np.testing.assert_allclose(float(loss(without_stored)), base, rtol=1e-6)

    # Pair i's target is the distribution at position i + 1; counted pairs are response labels.
    argmax = np.asarray(batch["argmax"])
    starts, lengths = np.asarray(batch["starts"]), np.asarray(batch["lengths"])
    in_vocab = np.isin(argmax, draft_ids)
    response = (np.arange(argmax.shape[1])[None] >= starts[:, None] + 1) & (
        np.arange(argmax.shape[1])[None] < lengths[:, None]
    )
    outside = np.argwhere(response & ~in_vocab)
    inside = np.argwhere(response & in_vocab)
    assert len(outside) > 10 and len(inside) > 10  # the batch has both kinds

    def perturbed(positions) -> dict:
        hidden = np.asarray(batch["hidden"]).copy()
        rng = np.random.default_rng(0)
        for b, p in positions:
            hidden[b, p] += rng.normal(0, 3.0, hidden.shape[-1])
        return dict(batch, hidden=jnp.asarray(hidden))  # the stored argmax stays the target's

    np.testing.assert_allclose(float(loss(perturbed(outside))), base, rtol=1e-6)
    assert abs(float(loss(perturbed(inside[:5]))) - base) > 1e-4


def test_eagle3_argmax_weight_mixes_the_soft_loss_with_ce_to_the_targets_argmax(tiny_model, store):
    """argmax_weight = w: each TTT step's loss is (1 - w) x the soft CE + w x the CE to the target's argmax
    over the draft vocabulary. At w = 1 it is the soft loss against a one-hot target: the w = 0 loss of the
    same batch with the target's hidden states scaled by 1e3 (its logits are linear in them: the argmax
    stays, the distribution turns one-hot)."""
    from jaxspec.train.losses import Objective

    config, head, trainable, fixed, batch = _eagle3_loss_inputs(tiny_model, store, 2, np.arange(0, 256, 4))

    def depth_loss(argmax_weight: float, batch: dict) -> np.ndarray:
        objective = Objective(head.graphdef, config, tiny_model.graphdef, tiny_model.config, depth=2,
                              num_positions=64, argmax_weight=argmax_weight)  # fmt: skip
        return np.asarray(objective({"head": trainable}, fixed, batch, jax.random.key(0))[1]["depth_loss"])

    soft, hard = depth_loss(0.0, batch), depth_loss(1.0, batch)
    assert np.all(np.abs(hard - soft) > 1e-3)
    np.testing.assert_allclose(depth_loss(0.25, batch), 0.75 * soft + 0.25 * hard, rtol=1e-5)
    one_hot = dict(batch, hidden=batch["hidden"] * 1e3)
    np.testing.assert_allclose(depth_loss(0.0, one_hot), hard, rtol=1e-3)


def test_train_cli_refuses_an_argmax_weight_outside_eagle3_or_0_to_1(tmp_path, capsys):
    import jaxspec.cli

    argv = ["train", "--method", "mtp", "--workdir", str(tmp_path), "--argmax-weight", "0.5"]
    assert jaxspec.cli.main(argv) == 2
    assert "--argmax-weight 0.5: an EAGLE-3 loss weight, not mtp's" in capsys.readouterr().err
    argv = ["train", "--method", "eagle3", "--workdir", str(tmp_path), "--argmax-weight", "1.5"]
    assert jaxspec.cli.main(argv) == 2
    assert "--argmax-weight 1.5: a weight in [0, 1]" in capsys.readouterr().err


def test_train_cli_distils_into_a_dataset_and_grows_it(tiny, tmp_path):
    from jaxspec.cli import main
    from jaxspec.loading.dataset import DistilledDataset
    from jaxspec.train.distill import append_jsonl_rows
    from jaxspec.train.features import FeatureStore

    rng = np.random.default_rng(3)
    prompts = [{"id": f"p{i}", "prompt": f"prompt {i}", "prompt_ids": rng.integers(1, VOCAB, 5).tolist()}
               for i in range(8)]  # fmt: skip
    append_jsonl_rows(tmp_path / "prompts.jsonl", prompts)

    def cli(num_prompts: int, stages: str, *extra: str) -> int:
        return main([
            "train", "--method", "eagle3", "--model", str(tiny), "--workdir", str(tmp_path / "work"),
            "--dataset", str(tmp_path / "ds"), "--prompts", str(tmp_path / "prompts.jsonl"),
            "--num-prompts", str(num_prompts), "--stages", stages, "--max-new-tokens", "6",
            "--gen-batch", "4", "--max-len", "16", "--feature-batch", "4", "--no-progress", *extra,
        ])  # fmt: skip

    assert cli(6, "distill") == 0
    rows = list(DistilledDataset.open(tmp_path / "ds").rows())
    assert [r["id"] for r in sorted(rows, key=lambda r: r["id"])] == [f"p{i}" for i in range(6)]
    assert all(r["prompt_ids"] == prompts[int(r["id"][1:])]["prompt_ids"] for r in rows)
    assert all(1 <= len(r["response_ids"]) <= 6 for r in rows)
    assert cli(8, "distill,features") == 0  # the same run goes on: two more prompts
    data = DistilledDataset.open(tmp_path / "ds")
    assert data.num_records() == 8 and len(data.manifest["runs"]) == 1
    assert data.manifest["runs"][0]["prompt_source"] == "file"
    assert data.manifest["runs"][0]["prompt_file"] == "prompts.jsonl"
    assert list(data.rows())[:6] == rows
    assert not (tmp_path / "work" / "distill.jsonl").exists()
    assert FeatureStore.open(tmp_path / "work" / "features").num_sequences == 8
    # The file grows; a new run (another seed) counts --num-prompts among the prompts no other run
    # answered, so it takes the new ones instead of skipping the first two, answered already.
    more = [{"id": f"p{i}", "prompt": f"prompt {i}", "prompt_ids": rng.integers(1, VOCAB, 5).tolist()}
            for i in range(8, 11)]  # fmt: skip
    append_jsonl_rows(tmp_path / "prompts.jsonl", more)
    assert cli(2, "distill", "--seed", "1") == 0
    data = DistilledDataset.open(tmp_path / "ds")
    assert len(data.manifest["runs"]) == 2 and data.manifest["runs"][1]["complete"]
    assert sorted(r["id"] for r in data.rows([1])) == ["p8", "p9"]


def test_dataset_runs_train_on_some_runs_with_the_whole_sets_draft_vocabulary(tiny, rows, tmp_path, capsys):
    """`--dataset-runs` trains on the selected runs only, reading their sequences from a feature store of
    the whole data set, while EAGLE-3's draft vocabulary is selected from every run (from the runs of
    `--draft-vocab-runs` when given); a range outside the manifest and a store without the selected runs'
    features are refused before training."""
    import json

    from jaxspec.cli import main
    from jaxspec.loading.dataset import DistilledDataset
    from jaxspec.train.head_setup import draft_vocabulary

    data = DistilledDataset.open_or_create(tmp_path / "data", model="tiny", vocab_size=VOCAB)
    for seed, part in enumerate((rows[:20], rows[20:])):
        writer = data.writer(prompt_source="test", seed=seed, sampling="greedy")
        writer.append(part)
        writer.finish()

    def cli(workdir: str, stages: str, *extra: str) -> int:
        return main([
            "train", "--method", "eagle3", "--model", str(tiny), "--workdir", str(tmp_path / workdir),
            "--dataset", str(tmp_path / "data"), "--stages", stages, "--max-len", "32", "--feature-batch",
            "8", "--steps", "2", "--batch-size", "4", "--depth", "1", "--draft-vocab", "64",
            "--save-dtype", "float32", "--no-progress", *extra,
        ])  # fmt: skip

    assert cli("work", "features") == 0  # features of both runs
    assert cli("work", "train,export", "--dataset-runs", "1") == 0
    info = json.loads((tmp_path / "work" / "head_eagle3" / "training.json").read_text())
    assert (info["sequences"], info["train_sequences"], info["dataset_runs"]) == (12, 12, "1")
    whole, run1 = draft_vocabulary(rows, VOCAB, 64), draft_vocabulary(rows[20:], VOCAB, 64)
    assert not np.array_equal(whole, run1)  # the check below can tell them apart
    np.testing.assert_array_equal(np.load(tmp_path / "work" / "run_eagle3" / "draft_vocab.npy"), whole)
    # --draft-vocab-runs pins the vocabulary to some runs (a recipe that outlives the data set's growth).
    (tmp_path / "voc").mkdir()
    (tmp_path / "voc" / "features").symlink_to(tmp_path / "work" / "features")
    assert cli("voc", "train,export", "--dataset-runs", "1", "--draft-vocab-runs", "1") == 0
    np.testing.assert_array_equal(np.load(tmp_path / "voc" / "run_eagle3" / "draft_vocab.npy"), run1)
    info = json.loads((tmp_path / "voc" / "head_eagle3" / "training.json").read_text())
    assert info["draft_vocab_runs"] == "1"

    capsys.readouterr()
    assert cli("bad", "train,export", "--draft-vocab-runs", "0-5") == 2
    assert "--draft-vocab-runs" in (err := capsys.readouterr().err) and "'0-5' is outside runs 0-1" in err
    assert cli("bad", "train,export", "--dataset-runs", "1-2") == 2
    assert "'1-2' is outside runs 0-1" in capsys.readouterr().err
    assert cli("part", "features", "--dataset-runs", "0") == 0
    assert cli("part", "train,export", "--dataset-runs", "0,1") == 2
    assert "lacks the features of 12 of the 32 sequences" in capsys.readouterr().err
    assert not (tmp_path / "part" / "head_eagle3").exists()


def test_validation_split_holds_out_non_templated_sequences():
    from jaxspec.train.trainer import validation_split

    ids = [f"s{i}" for i in range(400)]
    categories = ["coding" if i % 2 else "magpie_code" for i in range(400)]
    train_idx, val_idx = validation_split(ids, categories, 0.1)
    assert sorted(train_idx + val_idx) == list(range(400)) and not set(train_idx) & set(val_idx)
    assert all(categories[i] == "magpie_code" for i in val_idx) and 8 <= len(val_idx) <= 35
    assert validation_split(ids[::-1], categories[::-1], 0.1)[1] == sorted(399 - i for i in val_idx)
    _, only_templated = validation_split(ids, ["coding"] * 400, 0.1)
    assert only_templated  # no non-templated sequences: held out from all


def test_training_logs_held_out_agreement_and_tau_proxy(tiny_model, store, tmp_path):
    from jaxspec.train.head_setup import head_config_for, new_head
    from jaxspec.train.losses import MEDUSA_CALIBRATION_RANKS as R
    from jaxspec.train.losses import Objective
    from jaxspec.train.trainer import SubsetSource, TrainConfig, split_trainable, tau_proxy, train

    config = head_config_for("medusa", tiny_model.config, depth=2)
    head = new_head(config, seed=0)
    trainable, head_fixed = split_trainable(head.params)
    objective = Objective(
        head.graphdef, config, tiny_model.graphdef, tiny_model.config, depth=2, num_positions=8
    )
    train_config = TrainConfig(steps=40, batch_size=8, learning_rate=LEARNING_RATE, warmup_steps=5,
                               log_every=5, checkpoint_every=40, eval_every=20, eval_batches=1)  # fmt: skip
    result = train(
        objective, {"head": trainable}, {"target": tiny_model.params, "head_fixed": head_fixed},
        SubsetSource(store, tuple(range(24))), tmp_path / "run", train_config, progress=False,
        validation=SubsetSource(store, tuple(range(24, 32))),
    )  # fmt: skip
    validated = [e for e in result.metrics if "val_depth_acc" in e]
    assert [e["step"] for e in validated] == [20, 40]
    assert validated[-1]["val_depth_acc"][0] > validated[0]["val_depth_acc"][0]
    assert validated[-1]["val_tau_proxy"] == pytest.approx(tau_proxy(validated[-1]["val_depth_acc"]))
    assert tau_proxy([0.5, 0.5]) == pytest.approx(1.75)
    # Medusa also logs its heads' rank accuracies (a calibrated tree's input): rank 0 is top-1 agreement.
    rank_acc = np.asarray(validated[-1]["val_rank_acc"])
    assert rank_acc.shape == (2, R) and np.all(rank_acc.sum(1) <= 1 + 1e-6) and rank_acc[:, 1:].sum() > 0
    np.testing.assert_allclose(rank_acc[:, 0], validated[-1]["val_depth_acc"], atol=1e-6)
    # ... and the joint ranks of its heads, row-major with head 1 first and rank R = "R or worse":
    # summed over head 1 it is head 2's rank accuracy (the same positions), and it sums to one.
    joint = np.asarray(validated[-1]["val_path_acc"]).reshape(R + 1, R + 1)
    np.testing.assert_allclose(joint.sum(0)[:R], rank_acc[1], atol=1e-6)
    assert joint.sum() == pytest.approx(1.0, abs=1e-5) and joint[:R, :R].sum() > 0
    assert not any("path_acc" in e for e in result.metrics)  # the table stays out of training lines


def test_label_rank_counts_the_tokens_that_score_above_the_label():
    import jax.numpy as jnp

    from jaxspec.train.losses import label_rank

    logits = np.random.default_rng(0).normal(size=(3, 5, 40)).astype(np.float32)
    labels = np.random.default_rng(1).integers(0, 40, (3, 5))
    order = np.argsort(-logits, -1)  # no ties in normal draws
    expected = np.argmax(order == labels[..., None], -1)
    np.testing.assert_array_equal(np.asarray(label_rank(jnp.asarray(logits), jnp.asarray(labels))), expected)


def test_a_medusa_head_exports_its_rank_accuracies_and_drafts_the_tree_they_calibrate(
    tiny, tiny_model, rows, tmp_path
):
    """`jaxspec train --method medusa --val-fraction F`: the exported head carries tree_calibration.json
    (its last validation's rank accuracies), and SpecConfig(topk > 1) without choices drafts the tree
    `calibrated_tree_choices` builds from it; a head without one is refused with a message naming the
    file, a corrupt one with the file's path."""
    from jaxspec.cli import main
    from jaxspec.config import SpecConfig
    from jaxspec.drafters.heads import registry
    from jaxspec.drafters.tree_build import (
        CALIBRATION_FILE,
        calibrated_tree_choices,
        static_tree_from_choices,
    )
    from jaxspec.errors import InputError
    from jaxspec.train.losses import MEDUSA_CALIBRATION_RANKS

    work = tmp_path / "work"
    work.mkdir()
    append_jsonl_rows(work / "distill.jsonl", rows)
    assert main([
        "train", "--method", "medusa", "--model", str(tiny), "--workdir", str(work), "--stages",
        "train,export", "--feature-mode", "online", "--steps", "2", "--max-len", "32", "--depth", "2",
        "--num-positions", "8", "--batch-size", "4", "--save-dtype", "float32", "--no-progress",
        "--val-fraction", "0.3", "--eval-every", "1", "--eval-batches", "2", "--output", str(work / "head"),
    ]) == 0  # fmt: skip
    calibration = json.loads((work / "head" / CALIBRATION_FILE).read_text())
    metrics = [json.loads(line) for line in (work / "run_medusa" / "metrics.jsonl").open()]
    last = [e for e in metrics if "val_rank_acc" in e][-1]
    np.testing.assert_allclose(calibration["rank_accuracy"], last["val_rank_acc"], atol=1e-6)
    assert calibration["step"] == 2 and "8 of" in calibration["measured_on"]

    spec = SpecConfig(method="medusa", head=str(work / "head"), num_speculative_tokens=2, topk=3,
                      num_draft_tokens=5)  # fmt: skip
    drafter, _ = registry.make_head_drafter(tiny_model, spec)
    accuracy = np.asarray(calibration["rank_accuracy"])[:, :3]
    joint = np.asarray(calibration["joint"])
    assert joint.shape == (MEDUSA_CALIBRATION_RANKS + 1,) * 2
    np.testing.assert_allclose(joint, np.asarray(last["val_path_acc"]), atol=1e-6)
    assert drafter.static_tree == static_tree_from_choices(calibrated_tree_choices(accuracy, 5, joint))
    assert drafter.num_nodes == 6

    (work / "head" / CALIBRATION_FILE).write_text('{"rank_accuracy": [[0.5, 2.0]]}')
    with pytest.raises(InputError, match=str(work / "head" / CALIBRATION_FILE)):
        registry.make_head_drafter(tiny_model, spec)
    (work / "head" / CALIBRATION_FILE).unlink()
    with pytest.raises(InputError, match=CALIBRATION_FILE):
        registry.make_head_drafter(tiny_model, spec)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_heads_started_from_the_target_compute_its_last_layer(tiny_model, method):
    """init_from_target: the head's decoder layer reproduces the target's last layer on its hidden
    input (EAGLE-3's embedding half zeroed for the check), EAGLE-3's draft LM head gives the target's
    logits on the draft vocabulary."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxspec.drafters.heads.layers import causal_visible, empty_cache_inputs, rope_for
    from jaxspec.drafters.heads.mtp.module import module_params
    from jaxspec.model.forward import lm_logits
    from jaxspec.train.features import target_features
    from jaxspec.train.head_setup import head_config_for, init_from_target, new_head

    config = head_config_for(method, tiny_model.config, depth=2, draft_vocab_size=64, eagle3_layers=(0, 1, 1))
    head = init_from_target(new_head(config, seed=0, draft_ids=np.arange(0, 256, 4)), tiny_model.graphdef,
                            tiny_model.params)  # fmt: skip
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, VOCAB, (2, 12)), jnp.int32)
    hidden, layers = target_features(tiny_model.graphdef, tiny_model.params, tokens, config=tiny_model.config,
                                     capture_layers=(0, 1))  # fmt: skip
    d = tiny_model.config.hidden_size
    x_in, x_out = layers[..., :d], layers[..., d:]
    module = nnx.merge(head.graphdef, module_params(head.params, 0) if method == "mtp" else head.params)
    layer = module.block if method == "mtp" else module.layer
    c = config.layer
    inputs = empty_cache_inputs(2, c.num_kv_heads, c.head_dim, causal_visible(12), x_in.dtype)
    cos, sin = rope_for(c, jnp.broadcast_to(jnp.arange(12), (2, 12)))
    if method == "eagle3":
        for name in ("q_proj", "k_proj", "v_proj"):
            proj = getattr(layer.self_attn, name)
            proj.kernel[...] = proj.kernel[...].at[:d].set(0.0)
        out, _, _ = layer(x_in, cos, sin, inputs, embeddings=jnp.ones_like(x_in))
        target_rows = lm_logits(tiny_model.graphdef, tiny_model.params, hidden)[..., np.arange(0, 256, 4)]
        # draft_logits norms its input: feed it the pre-norm output of the last layer.
        np.testing.assert_allclose(np.asarray(module.draft_logits(x_out)), np.asarray(target_rows), atol=1e-4)
    else:
        out, _, _ = layer(x_in, cos, sin, inputs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x_out), atol=1e-4)


def test_eagle1_refuses_to_start_from_the_target(tiny_model, monkeypatch, capsys, tmp_path):
    """EAGLE-1 regresses post-norm features through the target's LM head; started from the target's last
    layer it did not learn (measured), so init_from_target refuses it, and `jaxspec train` says so before
    it loads a model."""
    import jaxspec
    import jaxspec.cli
    from jaxspec.train.head_setup import EAGLE1_FROM_TARGET, head_config_for, init_from_target, new_head

    head = new_head(head_config_for("eagle", tiny_model.config, depth=1), seed=0)
    with pytest.raises(ValueError, match="EAGLE-1 cannot start from the target"):
        init_from_target(head, tiny_model.graphdef, tiny_model.params, layers=False)

    def no_load(*args, **kwargs):
        pytest.fail("jaxspec train loaded a model before refusing --init-from-target for EAGLE-1")

    monkeypatch.setattr(jaxspec, "load", no_load)
    for mode in ("lm-head", "all"):
        argv = ["train", "--method", "eagle", "--workdir", str(tmp_path), "--init-from-target", mode]
        assert jaxspec.cli.main(argv) == 2
        assert f"--init-from-target {mode}: {EAGLE1_FROM_TARGET}" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["medusa", "mtp"])
def test_soft_targets_are_the_targets_own_distribution_at_the_label_position(tiny_model, store, method):
    """soft_weight = 1: the depth-1 loss is the soft CE to softmax(target logits) at the position whose
    next token is the label; soft_weight = w mixes the hard and soft losses linearly."""
    import jax.numpy as jnp

    from jaxspec.model.forward import lm_logits
    from jaxspec.train.head_setup import head_config_for, new_head
    from jaxspec.train.losses import Objective, label_mask, masked_mean, soft_ce
    from jaxspec.train.trainer import split_trainable

    config = head_config_for(method, tiny_model.config, depth=1)
    head = new_head(config, seed=0)
    trainable, head_fixed = split_trainable(head.params)
    fixed = {"target": tiny_model.params, "head_fixed": head_fixed}
    batch = {k: jnp.asarray(v) for k, v in store.read(list(range(8))).items()}

    def depth_loss(soft_weight: float) -> float:
        objective = Objective(head.graphdef, config, tiny_model.graphdef, tiny_model.config, depth=1,
                              num_positions=64, soft_weight=soft_weight)  # fmt: skip
        return float(objective({"head": trainable}, fixed, batch, jax.random.key(0))[1]["depth_loss"][0])

    hard, soft = depth_loss(0.0), depth_loss(1.0)
    assert depth_loss(0.25) == pytest.approx(0.75 * hard + 0.25 * soft, rel=1e-5)
    # Hand-built: the head's depth-1 logits at every pair i, against the target at i + 1.
    hidden, tokens = batch["hidden"], batch["tokens"]
    n = tokens.shape[1]
    target = jax.nn.softmax(lm_logits(tiny_model.graphdef, tiny_model.params, hidden), -1)
    target_next = jnp.concatenate([target[:, 1:], jnp.zeros_like(target[:, :1])], axis=1)
    if method == "medusa":
        from jaxspec.drafters.heads.medusa.module import medusa_logits

        target_lm = lambda x: lm_logits(tiny_model.graphdef, tiny_model.params, x)  # noqa: E731
        logits = medusa_logits(head.graphdef, head.params, hidden, target_lm)[:, :, 0]
    else:
        from jaxspec.drafters.heads.mtp.module import mtp_sequence_forward
        from jaxspec.model.forward import embed_tokens

        next_tokens = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], 1)
        embeddings = embed_tokens(tiny_model.graphdef, tiny_model.params, next_tokens)
        _, normed = mtp_sequence_forward(head.graphdef, head.params, 0, embeddings, hidden)
        logits = lm_logits(tiny_model.graphdef, tiny_model.params, normed)
    expected = masked_mean(soft_ce(logits, target_next), label_mask(batch, 2, n).astype(jnp.float32))
    assert soft == pytest.approx(float(expected), rel=1e-4)
    assert soft != pytest.approx(hard, rel=1e-3)


def test_init_from_head_starts_from_the_exported_head_and_its_vocabulary(
    tiny, tiny_model, rows, tmp_path, capsys
):
    """`--init-from-head DIR`: the run's step-0 head (exported at 0 steps) is DIR's, parameters and EAGLE-3
    draft vocabulary alike (a fresh head has other weights and the data's vocabulary); a head of another
    method is refused with a message naming DIR."""
    from jaxspec.cli import main
    from jaxspec.drafters.heads.configs import default_eagle3_layers
    from jaxspec.train.export import load_saved_head, save_head
    from jaxspec.train.head_setup import draft_ids_of, draft_vocabulary, head_config_for, new_head

    layers = default_eagle3_layers(tiny_model.config.num_layers)
    config = head_config_for("eagle3", tiny_model.config, depth=2, draft_vocab_size=128, eagle3_layers=layers)
    vocab = np.sort(np.random.default_rng(5).choice(VOCAB, 128, replace=False))
    assert not np.array_equal(vocab, draft_vocabulary(rows, VOCAB, 128))  # the flag must be what sets it
    source = new_head(config, seed=7, draft_ids=vocab)
    save_head(tmp_path / "src", config, source.graphdef, source.params, dtype="float32")
    medusa = new_head(head_config_for("medusa", tiny_model.config, depth=2), seed=1)
    save_head(tmp_path / "medusa", medusa.config, medusa.graphdef, medusa.params, dtype="float32")
    work = tmp_path / "work"
    work.mkdir()
    append_jsonl_rows(work / "distill.jsonl", rows)

    def cli(head: Path, out: str) -> int:
        return main([
            "train", "--method", "eagle3", "--model", str(tiny), "--workdir", str(work), "--stages",
            "train,export", "--feature-mode", "online", "--steps", "0", "--max-len", "32", "--depth", "2",
            "--num-positions", "8", "--batch-size", "8", "--save-dtype", "float32", "--no-progress",
            "--output", str(work / out), "--init-from-head", str(head),
        ])  # fmt: skip

    assert cli(tmp_path / "src", "head") == 0
    started = load_saved_head(work / "head")
    assert started.config == config
    np.testing.assert_array_equal(draft_ids_of(started), vocab)
    np.testing.assert_array_equal(np.load(work / "run_eagle3" / "draft_vocab.npy"), vocab)
    expected = load_saved_head(tmp_path / "src")
    for x, y in zip(jax.tree.leaves(expected.params), jax.tree.leaves(started.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    info = json.loads((work / "head" / "training.json").read_text())
    assert info["init_from_head"] == str(tmp_path / "src")

    capsys.readouterr()
    assert cli(tmp_path / "medusa", "head2") == 2
    assert f"{tmp_path / 'medusa'}: holds a medusa head, not eagle3" in capsys.readouterr().err


def grow_head_cli(tiny, rows, work: Path, head: Path, out: str, method: str, flag: str, layers: int) -> int:
    """`jaxspec train --init-from-head HEAD FLAG LAYERS --steps 0` on `rows` in `work` (created on first use):
    exports the grown step-0 head to work/out; returns the exit status."""
    from jaxspec.cli import main

    if not work.exists():
        work.mkdir()
        append_jsonl_rows(work / "distill.jsonl", rows)
    return main([
        "train", "--method", method, "--model", str(tiny), "--workdir", str(work), "--stages",
        "train,export", "--feature-mode", "online", "--steps", "0", "--max-len", "32", "--depth", "2",
        "--num-positions", "8", "--batch-size", "8", "--save-dtype", "float32", "--no-progress",
        "--output", str(work / out), "--init-from-head", str(head), flag, str(layers),
    ])  # fmt: skip


def test_head_layers_grows_an_eagle3_head_that_starts_as_the_head_it_grows(
    tiny, tiny_model, rows, tmp_path, capsys
):
    """`--init-from-head DIR --head-layers 2`: the step-0 head has two decoder layers, DIR's weights
    everywhere DIR has them and an added layer whose residual branches are zero, so its teacher-forced
    features and draft logits equal DIR's exactly (and stop doing so once that layer moves); fewer
    layers than DIR has, or the flag on another method, is refused before any work."""
    from flax import nnx

    from jaxspec.drafters.heads.configs import default_eagle3_layers
    from jaxspec.drafters.heads.eagle.eagle import eagle_sequence_forward
    from jaxspec.train.export import load_saved_head, save_head
    from jaxspec.train.head_setup import draft_ids_of, head_config_for, init_from_target, new_head

    layers = default_eagle3_layers(tiny_model.config.num_layers)
    config = head_config_for("eagle3", tiny_model.config, depth=2, draft_vocab_size=128, eagle3_layers=layers)
    vocab = np.sort(np.random.default_rng(5).choice(VOCAB, 128, replace=False))
    source = new_head(config, seed=7, draft_ids=vocab)
    save_head(tmp_path / "src", config, source.graphdef, source.params, dtype="float32")
    work = tmp_path / "work"

    def cli(head: Path, out: str, head_layers: int, method: str = "eagle3") -> int:
        return grow_head_cli(tiny, rows, work, head, out, method, "--head-layers", head_layers)

    assert cli(tmp_path / "src", "head", 2) == 0
    grown = load_saved_head(work / "head")
    assert grown.config.layer.num_layers == 2 and grown.config.draft_vocab_size == 128
    old, new = nnx.merge(source.graphdef, source.params), nnx.merge(grown.graphdef, grown.params)
    np.testing.assert_array_equal(draft_ids_of(grown), vocab)
    for name in ("fc", "layer", "norm", "lm_head"):
        for x, y in zip(jax.tree.leaves(nnx.state(getattr(old, name))),
                        jax.tree.leaves(nnx.state(getattr(new, name))), strict=True):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    added = new.later_layers[0]
    assert not np.any(np.asarray(added.self_attn.o_proj.kernel[...]))
    assert not np.any(np.asarray(added.mlp.down_proj.kernel[...]))
    assert np.any(np.asarray(added.self_attn.q_proj.kernel[...]))  # seeded, not zero: it can learn

    rng = np.random.default_rng(0)
    d = tiny_model.config.hidden_size
    embeddings = jnp.asarray(rng.normal(size=(2, 9, d)), jnp.float32)
    features = jnp.asarray(rng.normal(size=(2, 9, 3 * d)), jnp.float32)

    def drafts(head):
        out = eagle_sequence_forward(head.graphdef, head.params, embeddings, features)
        return np.asarray(out), np.asarray(nnx.merge(head.graphdef, head.params).draft_logits(out))

    for x, y in zip(drafts(source), drafts(grown), strict=True):
        np.testing.assert_array_equal(x, y)
    before = drafts(grown)[1]
    moved = nnx.merge(grown.graphdef, jax.tree.map(jnp.copy, grown.params))
    moved.later_layers[0].mlp.down_proj.kernel[...] += 0.05
    _, params = nnx.split(moved)
    assert not np.allclose(before, drafts(dataclasses.replace(grown, params=params))[1])

    # From the target: the later layer starts as the identity too, i.e. as the one-layer head from it.
    one = init_from_target(source, tiny_model.graphdef, tiny_model.params)
    two_config = dataclasses.replace(config, layer=config.layer.replace(num_layers=2))
    fresh = new_head(two_config, seed=7, draft_ids=vocab)
    two = init_from_target(fresh, tiny_model.graphdef, tiny_model.params)
    np.testing.assert_array_equal(drafts(one)[1], drafts(two)[1])

    capsys.readouterr()
    assert cli(work / "head", "head1", 1) == 2
    assert "cannot shrink to 1" in capsys.readouterr().err
    assert cli(tmp_path / "src", "head_m", 2, method="medusa") == 2
    assert "--head-layers 2" in capsys.readouterr().err and not (work / "head_m").exists()


def test_init_from_head_with_draft_vocab_reselects_the_vocabulary_and_keeps_trained_columns(
    tiny, tiny_model, rows, tmp_path, capsys
):
    """`--init-from-head DIR --draft-vocab N`: the step-0 head drafts the data's N most frequent tokens;
    its decoder layer, fusion and norm are DIR's; the LM-head column of a token DIR already drafted is
    DIR's column for it, a new token's is its target LM-head row through the least-squares map from the
    kept tokens' target rows to their columns (the target row itself when fewer than d tokens are
    kept). A resume keeps the first run's vocabulary after the data grew; another --draft-vocab in the
    same directory is refused."""
    from flax import nnx

    from jaxspec.cli import main
    from jaxspec.drafters.heads.configs import default_eagle3_layers
    from jaxspec.train.export import load_saved_head, save_head
    from jaxspec.train.head_setup import draft_ids_of, draft_vocabulary, head_config_for, new_head

    layers = default_eagle3_layers(tiny_model.config.num_layers)
    config = head_config_for("eagle3", tiny_model.config, depth=2, draft_vocab_size=256, eagle3_layers=layers)
    old_ids = np.sort(np.random.default_rng(5).choice(VOCAB, 256, replace=False))
    source = new_head(config, seed=7, draft_ids=old_ids)
    save_head(tmp_path / "src", config, source.graphdef, source.params, dtype="float32")
    target_rows = np.asarray(nnx.merge(tiny_model.graphdef, tiny_model.params).lm_head_rows(), np.float64)
    old = nnx.merge(source.graphdef, source.params)
    old_kernel = np.asarray(old.lm_head.kernel[...])

    def cli(work: Path, out: str, size: int) -> int:
        return main([
            "train", "--method", "eagle3", "--model", str(tiny), "--workdir", str(work), "--stages",
            "train,export", "--feature-mode", "online", "--steps", "0", "--max-len", "32", "--depth", "2",
            "--num-positions", "8", "--batch-size", "8", "--save-dtype", "float32", "--no-progress",
            "--output", str(work / out), "--init-from-head", str(tmp_path / "src"),
            "--draft-vocab", str(size),
        ])  # fmt: skip

    for size in (128, 40):  # about 100 kept tokens (>= d = 64: mapped), then about 30 (target rows)
        work = tmp_path / f"work{size}"
        work.mkdir()
        append_jsonl_rows(work / "distill.jsonl", rows)
        assert cli(work, "head", size) == 0
        started = load_saved_head(work / "head")
        new_ids = draft_vocabulary(rows, VOCAB, size)
        np.testing.assert_array_equal(draft_ids_of(started), new_ids)
        np.testing.assert_array_equal(np.load(work / "run_eagle3" / "draft_vocab.npy"), new_ids)
        assert started.config.draft_vocab_size == size
        new = nnx.merge(started.graphdef, started.params)
        for name in ("fc", "layer", "norm"):
            for x, y in zip(jax.tree.leaves(nnx.state(getattr(old, name))),
                            jax.tree.leaves(nnx.state(getattr(new, name))), strict=True):  # fmt: skip
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        kept = np.isin(new_ids, old_ids)
        assert 0 < kept.sum() < size and (kept.sum() >= 64) == (size == 128)
        new_kernel = np.asarray(new.lm_head.kernel[...])
        kept_columns = old_kernel[:, np.searchsorted(old_ids, new_ids[kept])]
        np.testing.assert_array_equal(new_kernel[:, kept], kept_columns)
        expected = target_rows[new_ids[~kept]]
        if size == 128:
            x, y = target_rows[new_ids[kept]], kept_columns.T.astype(np.float64)
            expected = expected @ np.linalg.lstsq(x, y, rcond=None)[0]
        np.testing.assert_allclose(new_kernel[:, ~kept], expected.T, rtol=1e-4, atol=1e-6)

    # More data whose most frequent tokens are outside the first vocabulary: a resume keeps it.
    work, new_ids = tmp_path / "work128", draft_vocabulary(rows, VOCAB, 128)
    outside = [t for t in range(VOCAB) if t not in set(new_ids.tolist())][:8]
    more = [{**rows[0], "id": f"more{i}", "response_ids": outside * 20} for i in range(4)]
    append_jsonl_rows(work / "distill.jsonl", more)
    assert not np.array_equal(draft_vocabulary(rows + more, VOCAB, 128), new_ids)
    assert cli(work, "head2", 128) == 0
    np.testing.assert_array_equal(draft_ids_of(load_saved_head(work / "head2")), new_ids)
    capsys.readouterr()
    assert cli(work, "head3", 64) == 2
    assert "draft_vocab.npy holds a draft vocabulary of 128, not --draft-vocab 64" in capsys.readouterr().err


def test_medusa_layers_grows_a_medusa_head_that_starts_as_the_head_it_grows(
    tiny, tiny_model, rows, tmp_path, capsys
):
    """`--init-from-head DIR --medusa-layers 2`: every head of the step-0 Medusa head has two residual
    blocks, DIR's first and an added one with zero kernel and bias, so its logits equal DIR's exactly
    (and stop doing so once that block moves); fewer blocks than DIR has, or the flag on another
    method, is refused before any work."""
    from jaxspec.drafters.heads.medusa.module import medusa_logits
    from jaxspec.model.forward import lm_logits
    from jaxspec.train.export import load_saved_head, save_head
    from jaxspec.train.head_setup import head_config_for, new_head

    config = head_config_for("medusa", tiny_model.config, depth=2)
    source = new_head(config, seed=3)
    save_head(tmp_path / "src", config, source.graphdef, source.params, dtype="float32")
    work = tmp_path / "work"

    def cli(head: Path, out: str, layers: int, method: str = "medusa") -> int:
        return grow_head_cli(tiny, rows, work, head, out, method, "--medusa-layers", layers)

    assert cli(tmp_path / "src", "head", 2) == 0
    grown = load_saved_head(work / "head")
    assert grown.config.num_layers == 2 and grown.config.num_heads == 2
    kernel = np.asarray(grown.params["res_kernel"].get_value())
    np.testing.assert_array_equal(kernel[:, 0], np.asarray(source.params["res_kernel"].get_value())[:, 0])
    assert not np.any(kernel[:, 1]) and not np.any(np.asarray(grown.params["res_bias"].get_value())[:, 1])

    hidden = jnp.asarray(
        np.random.default_rng(0).normal(size=(2, 5, tiny_model.config.hidden_size)), jnp.float32
    )

    def logits(head, params=None):
        target_lm = lambda x: lm_logits(tiny_model.graphdef, tiny_model.params, x)  # noqa: E731
        return np.asarray(medusa_logits(head.graphdef, params or head.params, hidden, target_lm))

    np.testing.assert_array_equal(logits(source), logits(grown))
    moved = jax.tree.map(jnp.copy, grown.params)
    moved["res_kernel"].set_value(moved["res_kernel"].get_value().at[:, 1].add(0.05))
    assert not np.allclose(logits(grown), logits(grown, moved))

    capsys.readouterr()
    assert cli(work / "head", "head1", 1) == 2
    assert "cannot shrink to 1" in capsys.readouterr().err and not (work / "head1").exists()
    assert cli(tmp_path / "src", "head_e", 2, method="eagle3") == 2
    assert "--medusa-layers 2" in capsys.readouterr().err and not (work / "head_e").exists()


def test_eagle1_training_time_test_step_feeds_the_heads_own_prediction_as_a_draft_chain_does(
    tiny_model, store
):
    """EAGLE-1 with depth 2: step 1 of pair i reads the head's own step-0 prediction and t_(i+2) at
    position i + 1, attending to step 0's pairs 0..i, which is exactly a draft chain's second step: a
    causal sequence forward over pairs 0..i followed by (predicted f_(i+1), t_(i+2)). Its loss is that
    prediction's soft CE to the target at i + 2, and differs from the teacher-forced one (target f_(i+1))."""
    from jaxspec.drafters.heads.eagle.eagle import eagle_sequence_forward
    from jaxspec.model.forward import embed_tokens, lm_logits
    from jaxspec.train.head_setup import head_config_for, new_head
    from jaxspec.train.losses import Objective, soft_ce
    from jaxspec.train.trainer import split_trainable

    config = head_config_for("eagle", tiny_model.config, depth=2)
    head = new_head(config, seed=0)
    trainable, head_fixed = split_trainable(head.params)
    fixed = {"target": tiny_model.params, "head_fixed": head_fixed}
    batch = {k: jnp.asarray(v) for k, v in store.read(list(range(8))).items()}
    tokens, hidden = batch["tokens"], batch["hidden"]
    objective = Objective(head.graphdef, config, tiny_model.graphdef, tiny_model.config, depth=2,
                          num_positions=64, noise=0.0)  # fmt: skip

    def target_embed(t):
        return embed_tokens(tiny_model.graphdef, tiny_model.params, t)

    def target_lm(x):
        return lm_logits(tiny_model.graphdef, tiny_model.params, x)

    for i in (3, 11):
        # Only pair i has a step-1 label (t_(i+3)): starts = i + 3, lengths = i + 4.
        one = dict(batch, starts=jnp.full_like(batch["starts"], i + 3),
                   lengths=jnp.full_like(batch["lengths"], i + 4))  # fmt: skip
        loss = float(objective({"head": trainable}, fixed, one, jax.random.key(0))[1]["depth_loss"][1])
        embeddings = target_embed(tokens[:, 1 : i + 2])  # t_1 .. t_(i+1)
        # the head's step 0 over pairs 0..i: predicted f_1 .. f_(i+1)
        step0 = eagle_sequence_forward(head.graphdef, head.params, embeddings, hidden[:, : i + 1])
        target = jax.nn.softmax(target_lm(hidden[:, i + 2]), -1)
        expected = {}
        for name, fed in (("own", step0[:, i]), ("teacher", hidden[:, i + 1])):
            chain = eagle_sequence_forward(
                head.graphdef, head.params, target_embed(tokens[:, 1 : i + 3]),
                jnp.concatenate([hidden[:, : i + 1], fed[:, None]], axis=1), project=False,
            )  # fmt: skip
            logits = target_lm(chain[:, -1])  # EAGLE-1's logits: the target's LM head
            expected[name] = float(soft_ce(logits, target).mean())
        np.testing.assert_allclose(loss, expected["own"], rtol=2e-5)
        assert abs(expected["teacher"] - expected["own"]) > 1e-3 * abs(expected["own"]), expected
