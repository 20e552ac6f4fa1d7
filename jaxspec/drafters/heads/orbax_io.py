"""jaxspec's own head checkpoints: a directory with jaxspec_head.json (method + config) and the
parameters saved by Orbax (`params/`). Trainers call `save_head`; SpecConfig(head=directory) loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxspec.drafters.heads.configs import config_from_json, config_to_json
from jaxspec.drafters.heads.head import DraftHead, abstract_head
from jaxspec.errors import ModelLoadError

OWN_FORMAT_FILE = "jaxspec_head.json"
FORMAT_VERSION = 1


def save_head(head: DraftHead, directory: str | Path) -> Path:
    """Write `head` to `directory` (created; must not hold a head already). Returns the directory.

    Host-local parameters, written by the calling process alone (in a multi-process run, one process
    saves and the others wait: the checkpointer does not wait for them).
    """
    directory = Path(directory).resolve()
    if (directory / OWN_FORMAT_FILE).exists():
        raise FileExistsError(f"{directory}: already holds a draft head")
    directory.mkdir(parents=True, exist_ok=True)
    me = jax.process_index()
    checkpointer = ocp.StandardCheckpointer(
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    )
    checkpointer.save(directory / "params", head.params)
    checkpointer.wait_until_finished()
    meta = {"format_version": FORMAT_VERSION, **config_to_json(head.config)}
    (directory / OWN_FORMAT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return directory


def load_own_head(directory: str | Path, dtype: jnp.dtype | None = None) -> DraftHead:
    """Read a head written by `save_head`; floating parameters cast to `dtype` when given."""
    directory = Path(directory).resolve()
    meta_path = directory / OWN_FORMAT_FILE
    try:
        meta = json.loads(meta_path.read_text())
        config = config_from_json(meta)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{meta_path}: not a valid jaxspec head description: {err}") from err
    if meta.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(
            f"{meta_path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    stored = abstract_head(config, jnp.float32)
    try:
        params = ocp.StandardCheckpointer().restore(directory / "params", target=stored.params)
    except Exception as err:  # noqa: BLE001 (Orbax raises many kinds)
        # The first line names what is missing or corrupt; the rest is TensorStore's internals.
        reason = str(err).strip().splitlines()[0].split(" See full TensorStore details")[0][:300]
        raise ModelLoadError(
            f"{directory / 'params'}: cannot restore head parameters ({type(err).__name__}: {reason}); "
            "the checkpoint is incomplete or corrupt"
        ) from None
    if dtype is not None:
        params = jax.tree.map(
            lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
        )
    return DraftHead(config=config, graphdef=stored.graphdef, params=params, source=str(directory))
