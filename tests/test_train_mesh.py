"""Head training on 8 CPU devices (tests/conftest.py): meshes 4x2, 8x1 and 2x4 against one device.

The global batch is the same on every mesh, so the losses of a mesh run are those of the one-device run
up to the order of the reductions; the compiled step averages the head's gradients with an all-reduce
over "data" and never gathers the sharded target's weights; checkpoints move between mesh shapes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxspec.sharding import make_mesh
from jaxspec.train import trainer
from tests import test_train as one_device_tests
from tests.test_sharding import collective_ops, collective_shapes
from tests.test_train import REPO, _env
from tests.xla_flags import xla_flags

# The tiny target (4 query heads, 2 kv heads: attention sharded on model=2), its self-distilled rows and
# their feature store: the one-device training tests' fixtures.
tiny, tiny_model, rows, store = (
    one_device_tests.tiny,
    one_device_tests.tiny_model,
    one_device_tests.rows,
    one_device_tests.store,
)

STEPS = 20
RTOL = 1e-5


@pytest.fixture
def step_args(monkeypatch):
    """Records the train step `train` compiles and the arguments of its first call (to lower it again)."""
    real = trainer.make_train_step
    recorded: dict = {}

    def spy(*args, **kwargs):
        step = real(*args, **kwargs)
        recorded.clear()  # the latest `train` call's step only
        recorded["step"] = step

        def call(*step_args):
            recorded.setdefault("args", step_args)
            return step(*step_args)

        return call

    monkeypatch.setattr(trainer, "make_train_step", spy)
    return recorded


def run(tiny_model, store, method, shape, run_dir, *, stop_after=None, resume=False, online=False):
    from jaxspec.train.head_setup import head_config_for, new_head
    from jaxspec.train.losses import Objective
    from jaxspec.train.trainer import TrainConfig, split_trainable, train

    config = head_config_for(
        method, tiny_model.config, depth=2, draft_vocab_size=128, eagle3_layers=(0, 1, 1)
    )
    head = new_head(config, seed=0, draft_ids=np.arange(0, 256, 2))
    trainable, head_fixed = split_trainable(head.params)
    objective = Objective(head.graphdef, config, tiny_model.graphdef, tiny_model.config, depth=2,
                          num_positions=8)  # fmt: skip
    train_config = TrainConfig(steps=STEPS, batch_size=8, learning_rate=2e-2, warmup_steps=5, log_every=1,
                               checkpoint_every=10)  # fmt: skip
    return train(
        objective, {"head": trainable}, {"target": tiny_model.params, "head_fixed": head_fixed}, store,
        run_dir, train_config, progress=False, mesh=None if shape is None else make_mesh(*shape),
        stop_after=stop_after, resume=resume, online=online,
    )  # fmt: skip


@pytest.fixture(scope="module")
def one_device(tiny_model, store, tmp_path_factory):
    """The one-device reference losses per method, computed once."""
    cache: dict[str, list[float]] = {}

    def get(method: str) -> list[float]:
        if method not in cache:
            result = run(tiny_model, store, method, None, tmp_path_factory.mktemp(f"one_{method}"))
            cache[method] = [e["loss"] for e in result.metrics]
        return cache[method]

    return get


# ----------------------------------------------------------------------------------------------------
# The collective checker on replica groups
# ----------------------------------------------------------------------------------------------------

_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:, device_ids=\(\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?\))? \{(?P<reduced>[^}]*)\}"
)
_LIST_GROUPS = re.compile(r"replica_groups=\{(?P<groups>\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_IOTA_GROUPS = re.compile(
    r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def replica_groups(rest: str) -> set[frozenset[int]] | None:
    """The device groups of one collective's HLO text (explicit, iota or named-mesh form), else None."""
    if m := _LIST_GROUPS.search(rest):
        return {frozenset(_ints(g)) for g in re.findall(r"\{([\d,]*)\}", m.group("groups"))}
    if m := _IOTA_GROUPS.search(rest):
        ids = np.arange(np.prod(_ints(m.group("dims")))).reshape(_ints(m.group("dims")))
        if m.group("perm"):
            ids = ids.transpose(_ints(m.group("perm")))
        return {frozenset(g.tolist()) for g in ids.reshape(_ints(m.group("shape")))}
    if m := _MESH_GROUPS.search(rest):
        names = re.findall(r"'(\w+)'=(\d+)", m.group("axes"))
        sizes = [int(n) for _, n in names]
        ids = np.arange(np.prod(sizes))
        if m.group("dims"):
            ids = ids.reshape(_ints(m.group("dims")))
            if m.group("perm"):
                ids = ids.transpose(_ints(m.group("perm")))
        ids = ids.reshape(sizes)
        reduced = [i for i, (name, _) in enumerate(names) if f"'{name}'" in m.group("reduced")]
        kept = [i for i in range(len(names)) if i not in reduced]
        groups = ids.transpose(kept + reduced).reshape(-1, int(np.prod([sizes[i] for i in reduced])))
        return {frozenset(g.tolist()) for g in groups}
    return None


def collectives(hlo_text: str) -> list[tuple[str, tuple[int, ...], set[frozenset[int]] | None]]:
    """(op, result shape, device groups) of every all-reduce / all-gather (tuple results give several)."""
    return [
        (op, shape, replica_groups(rest))
        for op, shapes, rest in collective_ops(hlo_text)
        if op in ("all-reduce", "all-gather")
        for shape in shapes
    ]


def dims_key(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape up to the order of its dimensions and its unit dimensions (XLA may reduce a kernel's
    gradient transposed, and drops the size-1 module axis of a stacked MTP head)."""
    return tuple(sorted(d for d in shape if d != 1))


def data_axis_groups(shape: tuple[int, int]) -> set[frozenset[int]]:
    """Device groups along "data" of a (data, model) mesh: devices of one model index."""
    ids = np.arange(shape[0] * shape[1]).reshape(shape)
    return {frozenset(ids[:, j].tolist()) for j in range(shape[1])}


def test_replica_group_parser_reads_every_form():
    assert replica_groups("x, replica_groups={{0,1},{2,3}}, y") == {frozenset({0, 1}), frozenset({2, 3})}
    assert replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), d") == data_axis_groups((4, 2))
    named = "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}, use"
    assert replica_groups(named) == data_axis_groups((4, 2))
    assert replica_groups(named.replace("{'axis_0'}", "{'axis_2'}")) == {
        frozenset({2 * i, 2 * i + 1}) for i in range(4)
    }
    permuted = "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_0'}"
    # Device ids arange(8) as [4, 2] transposed = [0, 2, 4, 6, 1, 3, 5, 7], seen as [2, 1, 4]: axis 0 pairs
    # ids k and k + 4 of that list, i.e. the "model" groups of a 4x2 mesh.
    assert replica_groups(permuted) == {frozenset({2 * i, 2 * i + 1}) for i in range(4)}


def weight_gathers(hlo_text: str, target_params) -> list[tuple[str, tuple[int, ...]]]:
    """All-gathers whose result has the full shape of one of the target's sharded weights."""
    import jax

    sharded = {
        tuple(x.shape)
        for x in jax.tree.leaves(target_params)
        if any(axis is not None for axis in x.sharding.spec)
    }
    return [(op, s) for op, s, _ in collectives(hlo_text) if op == "all-gather" and s in sharded]


def test_weight_gather_checker_sees_a_gathered_target_weight(tiny_model):
    """The check below must be able to fail: a step that replicates a sharded weight is caught."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxspec.train.mesh import TrainMesh

    placement = TrainMesh(make_mesh(4, 2))
    target = placement.place_fixed({"target": tiny_model.params}, tiny_model.config)["target"]
    gather = jax.jit(lambda p: jax.tree.map(lambda x: x * 2.0, p),
                     out_shardings=NamedSharding(placement.mesh, PartitionSpec()))  # fmt: skip
    text = gather.lower(target).compile().as_text()
    assert weight_gathers(text, target)


# ----------------------------------------------------------------------------------------------------
# Data parallel training == one device
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
@pytest.mark.parametrize("shape", [(4, 2), (8, 1)])
def test_mesh_losses_match_one_device(tiny_model, store, one_device, step_args, tmp_path, method, shape):
    import jax
    from jax.sharding import PartitionSpec as P

    expected = one_device(method)
    result = run(tiny_model, store, method, shape, tmp_path / "run")
    losses = [e["loss"] for e in result.metrics]
    assert len(losses) == len(expected) == STEPS
    np.testing.assert_allclose(losses, expected, rtol=RTOL)
    assert losses[-1] < losses[0]  # it trains

    trainable, opt_state, fixed, batch, _ = step_args["args"]
    # The target placed by the inference rules table: vocabulary over "model" (of size 1 on 8x1).
    assert fixed["target"]["embed_tokens"]["embedding"][...].sharding.spec[0] == "model"
    # The head replicated, but for EAGLE-3's draft LM head [d, V_draft]: vocabulary over "model" by the
    # same rules table (where "model" has more than one device), its optimizer moments alike.
    head = trainable["head"]
    sharded = [x for x in jax.tree.leaves(head) if not x.sharding.is_fully_replicated]
    if method == "eagle3" and shape[1] > 1:
        kernel = head["lm_head"]["kernel"][...]
        assert kernel.sharding.spec == P(None, "model") and sharded == [kernel]
        moments = [x for x in jax.tree.leaves(opt_state) if not x.sharding.is_fully_replicated]
        assert [(x.shape, x.sharding.spec) for x in moments] == [(kernel.shape, P(None, "model"))] * 2
    else:
        assert sharded == []
    assert batch["tokens"].sharding.spec[0] == "data"
    hlo = step_args["step"].lower(*step_args["args"]).compile().as_text()
    # The head's gradients are averaged inside the step: every head parameter's per-device shape
    # (`dims_key`) is among the results of the all-reduces over the data axis (batched into tuple
    # all-reduces).
    over_data = {
        s for op, s, groups in collectives(hlo) if op == "all-reduce" and groups == data_axis_groups(shape)
    }
    head_shapes = {dims_key(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(head) if x.ndim}
    assert head_shapes <= over_data, head_shapes - over_data
    # No all-gather of a sharded target weight, nor of the vocabulary-sharded draft LM head.
    assert weight_gathers(hlo, fixed["target"]) == []
    assert weight_gathers(hlo, head) == []
    assert collective_shapes(hlo)  # the shared checker sees the step's collectives too

    entry = result.metrics[-1]
    assert entry["devices"] == 8
    np.testing.assert_allclose(entry["tokens_per_s_per_device"] * 8, entry["tokens_per_s"], rtol=1e-9)
    assert entry["step_s"] > 0 and result.throughput["mesh"] == f"{shape[0]}x{shape[1]}"


@pytest.mark.slow
def test_online_features_on_the_mesh_give_the_offline_one_device_loss(tiny_model, rows, one_device, step_args,
                                                                      tmp_path):  # fmt: skip
    """--feature-mode online on a 4x2 mesh: the sharded target runs inside the step, without gathering
    its weights; the losses are the offline one-device run's (its features come from the same target)."""
    from jaxspec.train.cli import OnlineSource

    expected = one_device("eagle3")[:5]  # before the mesh run: `step_args` records the latest step
    result = run(tiny_model, OnlineSource(rows, 32), "eagle3", (4, 2), tmp_path / "run", stop_after=5,
                 online=True)  # fmt: skip
    np.testing.assert_allclose([e["loss"] for e in result.metrics], expected, rtol=1e-4)
    trainable, opt_state, fixed, batch, _ = step_args["args"]
    assert "hidden" not in batch and fixed["empty_cache"].keys[0].sharding.spec[0] == "data"
    hlo = step_args["step"].lower(*step_args["args"]).compile().as_text()
    assert weight_gathers(hlo, fixed["target"]) == [] and weight_gathers(hlo, trainable["head"]) == []


def test_batch_not_divisible_by_the_data_axis_is_a_clear_error(tiny_model, store, tmp_path):
    from jaxspec.train.head_setup import head_config_for, new_head
    from jaxspec.train.losses import Objective
    from jaxspec.train.trainer import TrainConfig, split_trainable, train

    config = head_config_for("mtp", tiny_model.config, depth=1)
    head = new_head(config, seed=0)
    trainable, head_fixed = split_trainable(head.params)
    objective = Objective(head.graphdef, config, tiny_model.graphdef, tiny_model.config, depth=1)
    with pytest.raises(ValueError, match=r"batch size 6 \(--batch-size\).*data axis 4 \(--mesh 4x2\)"):
        train(objective, {"head": trainable}, {"target": tiny_model.params, "head_fixed": head_fixed}, store,
              tmp_path, TrainConfig(steps=2, batch_size=6), progress=False, mesh=make_mesh(4, 2))  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# Feature extraction over the mesh
# ----------------------------------------------------------------------------------------------------


def test_features_split_over_the_data_axis_and_each_device_row_block_written_once(
    tiny, rows, store, tmp_path
):
    """On a 4x2 mesh each feature batch of 8 is cut into 4 row blocks over "data" (one per data index,
    taken from one replica of the 2 over "model"); the store equals the one-device extraction."""
    import jax
    import tensorstore as ts

    import jaxspec
    from jaxspec.train.features import write_features

    model = jaxspec.load(str(tiny), mesh=make_mesh(4, 2))
    meshed = write_features(model, rows, tmp_path / "fs", max_len=32, capture_layers=(0, 1, 1), batch_size=8,
                            progress=False)  # fmt: skip
    assert meshed.written == [(lo, lo + 2) for lo in range(0, 32, 2)]
    got, want = meshed.read(range(32)), store.read(range(32))
    for name in ("tokens", "lengths", "starts", "argmax"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name in ("hidden", "layers"):  # the sharded target: equal up to the reduction order
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-5, err_msg=name)
    assert jax.process_count() == 1 and meshed.meta["ids"] == store.meta["ids"]

    with pytest.raises(ValueError, match=r"batch size 6 \(--feature-batch\).*data axis 4"):
        write_features(model, rows, tmp_path / "bad", max_len=32, batch_size=6, progress=False)

    # A store whose chunks hold 3 rows: row blocks of 2 would share chunks between writers.
    meshed.arrays["lengths"] = ts.open(
        {"driver": "zarr3", "kvstore": "memory://", "metadata": {"shape": [32], "data_type": "int32",
         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [3]}}}}, create=True,
    ).result()  # fmt: skip
    with pytest.raises(ValueError, match=r"lengths has chunks of 3 rows; rows \[0, 2\) of process 0"):
        meshed.check_own_chunks(0, 2, 32)
    meshed.check_own_chunks(3, 9, 32)
    meshed.check_own_chunks(30, 32, 32)  # the session's last rows end its last chunk


# ----------------------------------------------------------------------------------------------------
# Checkpoints move between meshes
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoint_from_4x2_resumes_on_2x4_and_one_device(tiny_model, store, tmp_path):
    method = "mtp"
    straight = [e["loss"] for e in run(tiny_model, store, method, (4, 2), tmp_path / "straight").metrics]
    half = tmp_path / "half"
    run(tiny_model, store, method, (4, 2), half, stop_after=10)
    resumed = {}
    for name, shape in {"4x2": (4, 2), "2x4": (2, 4), "one": None}.items():
        shutil.copytree(half, tmp_path / name)
        result = run(tiny_model, store, method, shape, tmp_path / name, resume=True)
        assert [e["step"] for e in result.metrics] == list(range(1, STEPS + 1))
        resumed[name] = [e["loss"] for e in result.metrics]
    # Same mesh: the same program on the restored bits, the losses are bit-identical.
    assert resumed["4x2"] == straight
    # Another mesh or one device: the reductions run in another order, equal to rounding.
    for name in ("2x4", "one"):
        assert resumed[name][:10] == straight[:10]  # the log before the checkpoint is kept as written
        np.testing.assert_allclose(resumed[name][10:], straight[10:], rtol=RTOL)


@pytest.mark.slow
def test_cli_mesh_trains_exports_and_reports_throughput(tiny, rows, store, tmp_path):
    from jaxspec.train.distill import append_jsonl_rows
    from jaxspec.train.export import load_saved_head

    append_jsonl_rows(tmp_path / "distill.jsonl", rows)
    shutil.copytree(store.path, tmp_path / "features")
    command = [
        sys.executable, "-m", "jaxspec.cli", "train", "--method", "mtp", "--model", str(tiny),
        "--workdir", str(tmp_path), "--stages", "train,export", "--steps", "6", "--batch-size", "8",
        "--depth", "2", "--num-positions", "8", "--max-len", "32", "--log-every", "3", "--mesh", "4x2",
        "--save-dtype", "float32", "--no-progress", "--output", str(tmp_path / "head"),
    ]  # fmt: skip
    env = dict(_env(), XLA_FLAGS=xla_flags(8))
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads((tmp_path / "head" / "training.json").read_text())
    assert info["mesh"] == "4x2" and info["steps"] == 6
    assert info["throughput"]["devices"] == 8 and info["throughput"]["tokens_per_s_per_device"] > 0
    logged = [json.loads(line) for line in (tmp_path / "run_mtp" / "metrics.jsonl").open()]
    assert [e["step"] for e in logged] == [3, 6] and all(e["step_s"] > 0 for e in logged)
    head = load_saved_head(tmp_path / "head")  # one device: the exported head is plain host arrays
    assert head.config.num_modules == 1

    bad = subprocess.run(command[:-2] + ["--mesh", "3x4"], env=env, cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "--mesh 3x4" in bad.stderr and "Traceback" not in bad.stderr


def start_two_processes(command: list[str], **popen) -> list[subprocess.Popen]:
    """`command` as processes 0 and 1 of one jax.distributed run over loopback, 4 CPU devices each."""
    from tests.test_multihost import free_port

    env = dict(_env(), JAX_NUM_CPU_DEVICES="4", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
               XLA_FLAGS=xla_flags(4))  # fmt: skip
    flags = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    return [
        subprocess.Popen(command + flags + ["--process-id", str(i)], env=env, cwd=REPO, **popen)
        for i in range(2)
    ]


@pytest.mark.slow
def test_two_processes_extract_train_and_export_on_one_global_mesh(tiny, rows, store, tmp_path):
    """Two processes x 4 CPU devices (jax.distributed over loopback) run features, train and export on one
    2x4 mesh, against one process on 8 devices doing the same: every process writes the feature rows its
    own devices computed (no chunk written by both), the store is complete and identical, the losses
    match, and process 0 alone writes the head while process 1 waits for it."""
    from jaxspec.train.distill import append_jsonl_rows
    from jaxspec.train.export import load_saved_head
    from jaxspec.train.features import FeatureStore

    def workdir(name):
        d = tmp_path / name
        d.mkdir()
        append_jsonl_rows(d / "distill.jsonl", rows)
        return d

    def command(d):
        return [
            sys.executable, "-m", "jaxspec.cli", "train", "--method", "mtp", "--model", str(tiny),
            "--workdir", str(d), "--steps", "10", "--batch-size", "8", "--depth", "2", "--num-positions", "8",
            "--max-len", "32", "--log-every", "1", "--save-dtype", "float32", "--no-progress",
            "--stages", "features,train,export", "--mesh", "2x4", "--feature-batch", "8",
            "--output", str(d / "head"),
        ]  # fmt: skip

    single, pair = workdir("single"), workdir("pair")
    env = dict(_env(), XLA_FLAGS=xla_flags(8))
    done = subprocess.run(command(single), env=env, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]

    procs = start_two_processes(command(pair), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]

    # Feature rows: on a 2x4 mesh process 0 holds the data shard of rows 0-3 of every batch of 8, process
    # 1 rows 4-7; each wrote exactly those (tokens and all) and the store's chunks are one row each, so
    # no chunk had two writers.
    written = {}
    for log in logs:
        line = next(line for line in log.splitlines() if line.startswith('{"features_written"'))
        entry = json.loads(line)["features_written"]
        written[entry["process"]] = [tuple(r) for r in entry["rows"]]
    assert written == {p: [(b + 4 * p, b + 4 * p + 4) for b in range(0, 32, 8)] for p in (0, 1)}
    features = FeatureStore.open(pair / "features")
    assert {a.chunk_layout.write_chunk.shape[0] for a in features.arrays.values()} == {1}
    reference = FeatureStore.open(single / "features")
    assert features.num_sequences == reference.num_sequences == len(rows)
    assert features.meta["ids"] == reference.meta["ids"]
    got, want = features.read(range(len(rows))), reference.read(range(len(rows)))
    assert set(got) == set(want) == {"tokens", "lengths", "starts", "hidden", "layers", "argmax"}
    # Token ids, lengths and the target's argmax are identical. The features are the same program's on the
    # same mesh up to the reduction order of the model-axis all-reduces (gloo across two processes, XLA's
    # in-process collectives in one): measured max |difference| 1e-6 (a few float32 ulps).
    for name in ("tokens", "lengths", "starts", "argmax"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name in ("hidden", "layers"):
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-5, err_msg=name)
    # And the one-device store of the same rows (captured layers differ there: (0, 1, 1) vs the CLI's).
    one = store.read(range(len(rows)))
    for name in ("tokens", "lengths", "starts", "argmax"):
        np.testing.assert_array_equal(got[name], one[name], err_msg=name)
    np.testing.assert_allclose(got["hidden"], one["hidden"], rtol=0, atol=1e-5)

    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "run_mtp" / "metrics.jsonl").open()]

    assert len(losses(pair)) == 10  # one process wrote the log
    np.testing.assert_allclose(losses(pair), losses(single), rtol=RTOL)
    # The head: written by process 0 only, complete before process 1 returned, loads on one device.
    assert [("saved mtp head" in log) for log in logs] == [True, False]
    info = json.loads((pair / "head" / "training.json").read_text())
    assert info["steps"] == 10 and info["mesh"] == "2x4"
    assert info["throughput"]["devices"] == 8 and info["throughput"]["tokens_per_s_per_device"] > 0
    exported, expected = load_saved_head(pair / "head"), load_saved_head(single / "head")
    import jax

    for x, y in zip(jax.tree.leaves(exported.params), jax.tree.leaves(expected.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_sigkill_of_one_process_then_rerun_of_both_loses_nothing(tiny, rows, store, tmp_path):
    """Two processes on one 2x4 mesh; process 1 is SIGKILLed after a checkpoint, process 0 is killed too
    (its collectives cannot finish), both rerun with --resume: every step is logged once and the losses
    are a one-process run's on 8 devices."""
    import os
    import signal
    import time

    from jaxspec.train.distill import append_jsonl_rows

    dirs = {}
    for name in ("single", "pair"):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        append_jsonl_rows(dirs[name] / "distill.jsonl", rows)
        shutil.copytree(store.path, dirs[name] / "features")
    args = [
        sys.executable, "-m", "jaxspec.cli", "train", "--method", "mtp", "--model", str(tiny),
        "--steps", "30", "--batch-size", "8", "--depth", "2", "--num-positions", "8", "--max-len", "32",
        "--log-every", "1", "--checkpoint-every", "5", "--mesh", "2x4", "--no-progress", "--stages", "train",
    ]  # fmt: skip
    env = dict(_env(), XLA_FLAGS=xla_flags(8))
    single = subprocess.Popen(args + ["--workdir", str(dirs["single"])], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

    def pair(*extra):
        command = args + ["--workdir", str(dirs["pair"]), *extra]
        return start_two_processes(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    first = pair()
    checkpoints = dirs["pair"] / "run_mtp" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and not (checkpoints / "10").exists() and first[1].poll() is None:
        time.sleep(0.05)
    for p in reversed(first):
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
    steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert steps and max(steps) < 30, f"the run was not interrupted mid-training: {steps}"
    second = pair("--resume")
    for p in second + [single]:
        assert p.wait(timeout=600) == 0

    def log(d):
        return [json.loads(line) for line in (d / "run_mtp" / "metrics.jsonl").open()]

    resumed, straight = log(dirs["pair"]), log(dirs["single"])
    assert [e["step"] for e in resumed] == list(range(1, 31))
    np.testing.assert_allclose([e["loss"] for e in resumed], [e["loss"] for e in straight], rtol=RTOL)
