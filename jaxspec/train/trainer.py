"""The head trainer: a jitted Optax step, deterministic data order and PRNG stream, Orbax checkpoints.

Determinism: step s reads the batch `batch_indices(seed, s, ...)` (a per-epoch permutation) and uses
the key fold_in(fold_in(key(seed), s), PURPOSE_STEP); the optimizer state and parameters are restored
bit for bit from the latest Orbax checkpoint, so `resume=True` after a kill continues exactly where an
uninterrupted run would be. Metrics are appended to `metrics.jsonl` (lines past the restored step are
dropped on resume) and drawn to `curves.png`.
"""

from __future__ import annotations

import dataclasses
import json
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh
from tqdm import tqdm

from jaxspec.errors import InputError
from jaxspec.train.losses import Objective

PURPOSE_STEP = 1
PURPOSE_EVAL = 2
# Metrics too large for every log line (Medusa's joint rank table): kept for validation entries only.
VALIDATION_ONLY_METRICS = ("path_acc",)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and bookkeeping settings (AdamW, linear warmup then cosine decay, global-norm clip)."""

    steps: int = 1000
    batch_size: int = 8
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    end_learning_rate_ratio: float = 0.05
    weight_decay: float = 0.01
    clip_norm: float = 0.5
    seed: int = 0
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    window: int | None = None  # crop each sequence to a window of this many tokens (offline features)
    eval_every: int = 0  # validate every N steps (and at the end) when a validation source is given
    eval_batches: int = 4  # validation batches of batch_size sequences (the first ones of the source)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=max(1, config.warmup_steps),
        decay_steps=max(config.steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.end_learning_rate_ratio,
    )  # fmt: skip
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(schedule, weight_decay=config.weight_decay),
    )


def batch_indices(seed: int, step: int, batch_size: int, num_sequences: int) -> np.ndarray:
    """Sequence indices of step `step`: epoch e = a fixed permutation seeded by (seed, e), drop-last."""
    if num_sequences < batch_size:
        raise ValueError(f"trainer: {num_sequences} sequences < batch size {batch_size}")
    per_epoch = num_sequences // batch_size
    epoch, offset = divmod(step, per_epoch)
    order = np.random.default_rng((seed, epoch)).permutation(num_sequences)
    return np.sort(order[offset * batch_size : (offset + 1) * batch_size])


def crop_windows(
    batch: dict[str, np.ndarray], window: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Crop every row to `window` tokens starting at a random offset that keeps response tokens in view:
    token-axis arrays -> [B, window, ...]; lengths/starts made relative; "offset" [B] added."""
    lengths, starts = batch["lengths"], batch["starts"]
    low = np.maximum(0, np.minimum(starts - 2, lengths - window))
    high = np.maximum(low, lengths - window)
    offset = (low + rng.integers(0, 1 << 30, size=low.shape) % (high - low + 1)).astype(np.int32)
    idx = offset[:, None] + np.arange(window)[None, :]
    out = {"lengths": lengths - offset, "starts": starts - offset, "offset": offset}
    for name, value in batch.items():
        if name not in out:
            idx_nd = idx.reshape(idx.shape + (1,) * (value.ndim - 2))
            out[name] = np.take_along_axis(value, np.minimum(idx_nd, value.shape[1] - 1), axis=1)
    return out


def step_key(seed: int, step: int) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), PURPOSE_STEP)


def _with_features(objective: Objective, trainable, fixed, batch, online: bool) -> dict:
    """The batch with the target's features added when they are computed online."""
    if online and "backbone" not in trainable:
        from jaxspec.train.features import target_features

        hidden, layers = target_features(
            objective.target_graphdef, fixed["target"], batch["tokens"], config=objective.target_config,
            capture_layers=objective.capture_layers, cache=fixed.get("empty_cache"),
        )  # fmt: skip
        batch = dict(batch, hidden=hidden, **({"layers": layers} if layers is not None else {}))
    return batch


def make_eval_step(objective: Objective, online: bool) -> Callable:
    """jit((trainable, fixed, batch, key) -> metrics): the objective's loss and per-depth agreement on a
    held-out batch, no update."""

    def eval_step(trainable, fixed, batch, key):
        loss, metrics = objective(
            trainable, fixed, _with_features(objective, trainable, fixed, batch, online), key
        )
        return dict(metrics, loss=loss)

    return jax.jit(eval_step)


def tau_proxy(depth_acc: list[float]) -> float:
    """Expected tokens per round of a chain whose depth-j draft is accepted with probability acc_j given
    the earlier ones: 1 + acc_1 + acc_1 acc_2 + ... (teacher-forced agreement as the acceptance rate)."""
    return float(1.0 + np.cumprod(np.asarray(depth_acc, np.float64)).sum())


@dataclasses.dataclass(frozen=True)
class SubsetSource:
    """Sequences `indices` of another source (a validation split, or the training rest)."""

    source: Any
    indices: tuple[int, ...]

    @property
    def num_sequences(self) -> int:
        return len(self.indices)

    def read(self, indices, names=None) -> dict[str, np.ndarray]:
        return self.source.read([self.indices[i] for i in indices], names)


TEMPLATED_CATEGORIES = ("coding", "knowledge", "writing", "extraction", "chat", "reasoning")


def validation_split(ids: list[str], categories: list[str], fraction: float) -> tuple[list[int], list[int]]:
    """(train indices, validation indices) of sequences `ids`: a stable `fraction` of the sequences chosen
    by a hash of their id, among the non-templated ones (Magpie, derived) when there are any, since
    templated prompts say little about real prompts."""
    pool = [i for i, c in enumerate(categories) if c not in TEMPLATED_CATEGORIES] or list(range(len(ids)))
    held = {i for i in pool if zlib.crc32(ids[i].encode()) % 10_000 < fraction * 10_000}
    return [i for i in range(len(ids)) if i not in held], sorted(held)


def make_train_step(
    objective: Objective, optimizer: optax.GradientTransformation, online: bool, out_shardings: Any = None
) -> Callable:
    """jit((trainable, opt_state, fixed, batch, key) -> (trainable, opt_state, metrics)).

    online: the batch holds tokens/lengths/starts only; the target's features are computed in the step.
    out_shardings: on a mesh, (trainable's, opt_state's, metrics') shardings, so the updated parameters
      stay where they were placed (`jaxspec.train.mesh`); the inputs' shardings come from the arrays.
    """

    def train_step(trainable, opt_state, fixed, batch, key):
        batch = _with_features(objective, trainable, fixed, batch, online)
        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(trainable, fixed, batch, key)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        return trainable, opt_state, dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))

    return jax.jit(train_step, out_shardings=out_shardings)


class MetricsLog:
    """metrics.jsonl in the run directory; `truncate(step)` drops entries after a restored step."""

    def __init__(self, path: Path):
        self.path = path

    def truncate(self, step: int) -> None:
        if self.path.exists():
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line and json.loads(line)["step"] <= step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))

    def append(self, entry: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def entries(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]


def _to_host(metrics: dict[str, jax.Array]) -> dict[str, Any]:
    out = {}
    from jaxspec.distributed import to_host

    for name, value in to_host(metrics).items():
        value = np.asarray(value)
        out[name] = value.tolist() if value.ndim else float(value)
    return out


def plot_curves(entries: list[dict], path: Path, title: str = "") -> None:
    """PNG of total loss and per-depth top-1 accuracy against the step (validation points dashed, and the
    validation τ-proxy on the accuracy panel's right axis when logged)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not entries:
        return
    steps = [e["step"] for e in entries]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(steps, [e["loss"] for e in entries], label="loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    depth = len(entries[0]["depth_acc"])
    validated = [e for e in entries if "val_depth_acc" in e]
    for j in range(depth):
        line = ax_acc.plot(steps, [e["depth_acc"][j] for e in entries], label=f"depth {j + 1}")[0]
        if validated:
            ax_acc.plot([e["step"] for e in validated], [e["val_depth_acc"][j] for e in validated], "o--",
                        color=line.get_color(), label=f"depth {j + 1} validation")  # fmt: skip
    if validated:
        ax_loss.plot(
            [e["step"] for e in validated], [e["val_loss"] for e in validated], "o--", label="validation"
        )
        ax_loss.legend()
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("top-1 accuracy")
    ax_acc.legend()
    if any("val_tau_proxy" in e for e in validated):  # right axis: the chain a draft of this depth gives
        taus = [e for e in validated if "val_tau_proxy" in e]
        ax_tau = ax_acc.twinx()
        ax_tau.plot([e["step"] for e in taus], [e["val_tau_proxy"] for e in taus], "s:", color="black",
                    label="validation τ-proxy")  # fmt: skip
        ax_tau.set_ylabel("validation τ-proxy")
        ax_tau.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def throughput(seconds: float, steps: int, sequences: int, tokens: int, devices: int) -> dict[str, float]:
    """Per-step and per-device rates over `steps` steps that took `seconds` of wall time.

    tokens: the real (unpadded) tokens of those steps' batches; `tokens_per_s_per_device` divides the
    global rate by the devices of the mesh (1 without one)."""
    seconds = max(seconds, 1e-9)
    return {
        "step_s": seconds / steps, "sequences_per_s": sequences / seconds, "tokens_per_s": tokens / seconds,
        "tokens_per_s_per_device": tokens / seconds / devices, "devices": devices,
    }  # fmt: skip


@dataclasses.dataclass
class TrainResult:
    """trainable: the final parameters; metrics: the log's entries; throughput: `throughput(...)` over
    this call's steps after its first (which compiles), empty when it ran fewer than two."""

    trainable: dict[str, Any]
    step: int
    metrics: list[dict]
    seconds: float
    throughput: dict[str, float] = dataclasses.field(default_factory=dict)


def train(
    objective: Objective,
    trainable: dict[str, Any],
    fixed: dict[str, Any],
    source: Any,
    run_dir: str | Path,
    config: TrainConfig,
    *,
    online: bool = False,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    validation: Any = None,
    mesh: Mesh | None = None,
) -> TrainResult:
    """Train `trainable` ({"head": nnx.State of Params}, optionally "backbone") for config.steps steps.

    source: `read(indices) -> dict of numpy arrays` and `num_sequences` (a FeatureStore, or an online
      source of tokens/lengths/starts when `online`).
    run_dir: checkpoints (Orbax, keep N, async), metrics.jsonl, curves.png.
    resume: continue from the latest checkpoint in run_dir (else a non-empty run_dir is an error). The
      checkpoint restores onto this call's placement, whatever mesh (or none) wrote it.
    stop_after: end after this step (tests; a real run uses config.steps).
    validation: a held-out source (same kind as `source`); every `config.eval_every` steps and at the end
      the log entry gets val_loss, val_depth_acc (teacher-forced agreement by depth) and val_tau_proxy.
    mesh: a (data, model) mesh (`jaxspec.sharding.make_mesh`): the target sharded by the rules table, the
      head replicated, each batch split over "data" (see `jaxspec.train.mesh`); the global batch is
      config.batch_size rows, so the losses are those of a one-device run up to the reduction order.
    Log entries carry step_s, sequences_per_s, tokens_per_s and tokens_per_s_per_device over the steps
    since the previous entry (the call's first step, which compiles, is left out).
    """
    from jaxspec.train.mesh import TrainMesh, shardings_of

    run_dir = Path(run_dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    placement = TrainMesh(mesh) if mesh is not None else None
    devices = placement.num_devices if placement is not None else 1
    if placement is not None:
        placement.check_batch_size(config.batch_size)
        trainable = placement.place_trainable(trainable, objective.target_config)
    optimizer = make_optimizer(config)
    opt_state = optimizer.init(trainable)
    if placement is not None:
        opt_state = placement.place_opt_state(optimizer, opt_state, trainable)
    manager = ocp.CheckpointManager(
        run_dir / "checkpoints",
        options=ocp.CheckpointManagerOptions(
            max_to_keep=config.keep_checkpoints, enable_async_checkpointing=True
        ),
    )
    log = MetricsLog(run_dir / "metrics.jsonl")
    writer = jax.process_index() == 0  # one process writes the log and the curves
    start = 0
    latest = manager.latest_step()
    if latest is not None:
        if not resume:
            raise InputError(
                f"{run_dir} already has checkpoints (last step {latest}): pass --resume (resume=True) to "
                "continue them, or use another work directory"
            )
        # The restore target's arrays carry this run's shardings: a checkpoint moves between meshes.
        state = manager.restore(
            latest, args=ocp.args.StandardRestore({"trainable": trainable, "opt_state": opt_state})
        )
        trainable, opt_state, start = state["trainable"], state["opt_state"], latest
    if writer:
        log.truncate(start)
    out_shardings = None
    if placement is not None:
        out_shardings = (shardings_of(trainable), shardings_of(opt_state), placement.replicated)
    step_fn = make_train_step(objective, optimizer, online, out_shardings)
    if online:  # the target forward's empty KV cache, as an argument (a constant costs minutes to fold)
        from jaxspec.model.kv_cache import KVCache

        max_len = source.read([0], ["tokens"])["tokens"].shape[1]
        dtype = jax.tree.leaves(fixed["target"])[0].dtype
        empty = KVCache.zeros(objective.target_config, config.batch_size, max_len, dtype)
        fixed = dict(fixed, empty_cache=empty)
    if placement is not None:
        fixed = placement.place_fixed(fixed, objective.target_config)

    def to_device(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        if placement is not None:
            return placement.place_batch(batch)
        return {k: jnp.asarray(v) for k, v in batch.items()}

    names = ["tokens", "lengths", "starts"] if online else None
    evaluate = None
    if validation is not None and config.eval_every > 0:
        eval_step = make_eval_step(objective, online)
        count = min(config.eval_batches, validation.num_sequences // config.batch_size)
        size = config.batch_size
        eval_batches = [
            to_device(validation.read(range(i * size, (i + 1) * size), names)) for i in range(count)
        ]
        eval_key = jax.random.fold_in(jax.random.key(config.seed), PURPOSE_EVAL)

        def evaluate(trainable) -> dict[str, Any]:
            runs = [_to_host(eval_step(trainable, fixed, b, eval_key)) for b in eval_batches]
            acc = np.mean([r["depth_acc"] for r in runs], axis=0).tolist()
            loss = float(np.mean([r["loss"] for r in runs]))
            out = {"val_loss": loss, "val_depth_acc": acc, "val_tau_proxy": tau_proxy(acc)}
            if "rank_acc" in runs[0]:  # Medusa: the rank statistics a calibrated tree is built from
                out["val_rank_acc"] = np.mean([r["rank_acc"] for r in runs], axis=0).tolist()
                out["val_path_acc"] = np.mean([r["path_acc"] for r in runs], axis=0).tolist()
            return out

    end = max(start, min(config.steps, stop_after if stop_after is not None else config.steps))
    began = time.perf_counter()
    # Throughput bookkeeping: since the last log entry, and over the whole call (both after step one).
    interval = {"t": 0.0, "steps": 0, "tokens": 0}
    total = {"t": 0.0, "steps": 0, "tokens": 0}
    bar = tqdm(total=config.steps, initial=start, desc=f"train {objective.method}", disable=not progress)
    for step in range(start, end):
        idx = batch_indices(config.seed, step, config.batch_size, source.num_sequences)
        batch = source.read(idx, names)
        if config.window is not None and not online and config.window < batch["tokens"].shape[1]:
            batch = crop_windows(
                batch, config.window, np.random.default_rng((config.seed, step, PURPOSE_STEP))
            )
        tokens = int(np.clip(batch["lengths"], 0, batch["tokens"].shape[1]).sum())
        trainable, opt_state, metrics = step_fn(
            trainable, opt_state, fixed, to_device(batch), step_key(config.seed, step)
        )
        done = step + 1
        if step == start:  # the first step compiles: the rates start after it
            jax.block_until_ready(metrics)
            interval["t"] = total["t"] = time.perf_counter()
        else:
            for counter in (interval, total):
                counter["steps"] += 1
                counter["tokens"] += tokens
        validate = evaluate is not None and (done % config.eval_every == 0 or done == end)
        if done % config.log_every == 0 or done == end or validate:
            logged = {k: v for k, v in _to_host(metrics).items() if k not in VALIDATION_ONLY_METRICS}
            entry = {"step": done, **logged, "time_s": time.perf_counter() - began}
            if interval["steps"]:
                now = time.perf_counter()
                entry.update(
                    throughput(now - interval["t"], interval["steps"], interval["steps"] * config.batch_size,
                               interval["tokens"], devices)
                )  # fmt: skip
                interval = {"t": now, "steps": 0, "tokens": 0}
            if validate:
                entry.update(evaluate(trainable))
                interval["t"] = time.perf_counter()
            if writer:
                log.append(entry)
            bar.set_postfix(loss=f"{entry['loss']:.3f}", acc=",".join(f"{a:.2f}" for a in entry["depth_acc"]))
        if done % config.checkpoint_every == 0 or done == end:
            manager.save(done, args=ocp.args.StandardSave({"trainable": trainable, "opt_state": opt_state}))
        bar.update(1)
    bar.close()
    jax.block_until_ready(trainable)
    rates = {}
    if total["steps"]:
        seconds = time.perf_counter() - total["t"]
        rates = throughput(
            seconds, total["steps"], total["steps"] * config.batch_size, total["tokens"], devices
        )
        rates["mesh"] = placement.describe() if placement is not None else "1x1"
    manager.wait_until_finished()
    manager.close()
    entries = log.entries()
    if writer:
        plot_curves(entries, run_dir / "curves.png", title=objective.method)
    return TrainResult(
        trainable=trainable, step=end, metrics=entries, seconds=time.perf_counter() - began, throughput=rates
    )


def split_trainable(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """A head's state -> (trainable Params, fixed rest such as EAGLE-3's vocabulary maps)."""
    return nnx.split_state(params, nnx.Param, ...)
