"""Draft heads shipped with jaxspec: configs/heads/MODEL/METHOD (see its README for how each was
trained), found from the package (`jaxspec.resources.configs_dir`), not the current folder.

The rule for a head method without a head, shared by the Python API and the CLI: use the head shipped
for that model when there is one, otherwise fail with an error naming the missing `head=` (a random
head accepts almost nothing). `head="random"` (RANDOM_HEAD) asks for a seeded random head on purpose
(correctness tests, cost measurements).
"""

from __future__ import annotations

from pathlib import Path

from jaxspec.config import HEAD_METHODS
from jaxspec.errors import InputError, ModelLoadError
from jaxspec.resources import configs_dir

RANDOM_HEAD = "random"
SHIPPED_TOKEN_MAP = "shipped"
SHIPPED_DATASTORE = "shipped"
TOKEN_MAP_FILE = "token_map.npy"


def shipped_heads_dir() -> Path:
    """configs/heads of the installed package."""
    return configs_dir() / "heads"


def shipped_head(model: str, method: str) -> str | None:
    """The shipped head directory for (model name, head method), or None when there is none."""
    path = shipped_heads_dir() / model / method
    return str(path) if method in HEAD_METHODS and (path / "jaxspec_head.json").is_file() else None


def shipped_model_dir(source: str) -> Path | None:
    """configs/heads/NAME for a loaded model, given its resolved file or folder (`Model.source`), or None.

    Heads are shipped under model names (configs/heads/NAME); a name matches when it resolves to the
    same file (`jaxspec.loading.registry.resolve_model_path`), or when `source` is the name itself."""
    from jaxspec.loading.registry import resolve_model_path

    heads = shipped_heads_dir()
    if not heads.is_dir():
        return None
    for name_dir in sorted(p for p in heads.iterdir() if p.is_dir()):
        if name_dir.name == source:
            return name_dir
        try:
            same = resolve_model_path(name_dir.name).resolve() == Path(source).resolve()
        except ModelLoadError:
            continue
        if same:
            return name_dir
    return None


def shipped_head_for_source(source: str, method: str) -> str | None:
    """The shipped head for a loaded model (`shipped_model_dir`), or None."""
    name_dir = shipped_model_dir(source)
    return shipped_head(name_dir.name, method) if name_dir is not None else None


def resolve_token_map(source: str, token_map: str) -> str:
    """SpecConfig.token_map as a file: the path itself, or for "shipped" (SHIPPED_TOKEN_MAP) the model's
    configs/heads/NAME/token_map.npy. Raises InputError when nothing is shipped for that model."""
    if token_map != SHIPPED_TOKEN_MAP:
        return token_map
    name_dir = shipped_model_dir(source)
    path = name_dir / TOKEN_MAP_FILE if name_dir is not None else None
    if path is None or not path.is_file():
        raise InputError(
            f"SpecConfig(token_map={SHIPPED_TOKEN_MAP!r}): no token map is shipped for model {source!r} in "
            f"{shipped_heads_dir()}; pass token_map=FILE (a .npy of token ids)"
        )
    return str(path)


def resolve_head(source: str, method: str, head: str | None) -> str:
    """spec.head for a head method: `head` itself, else the head shipped for the model at `source`.

    Raises InputError naming the missing `head=` when nothing is shipped for that model."""
    if head is not None:
        return head
    shipped = shipped_head_for_source(source, method)
    if shipped is None:
        raise InputError(
            f"SpecConfig(method={method!r}) needs a trained draft head: no head is shipped for model "
            f"{source!r} in {shipped_heads_dir()}; pass head=DIR (a checkpoint, see `jaxspec train`), "
            f"or head={RANDOM_HEAD!r} for a seeded random head (accepts almost nothing)"
        )
    return shipped


def resolve_datastore(source: str, datastore: str) -> str:
    """SpecConfig.datastore as a directory: the path itself, or for "shipped" (SHIPPED_DATASTORE) the
    model's distilled data set, configs/distilled/NAME. Raises InputError when none is shipped."""
    if datastore != SHIPPED_DATASTORE:
        return datastore
    name_dir = shipped_model_dir(source)
    path = configs_dir() / "distilled" / name_dir.name if name_dir is not None else None
    if path is None or not (path / "manifest.json").is_file():
        raise InputError(
            f"SpecConfig(datastore={SHIPPED_DATASTORE!r}): no distilled data set is shipped for model "
            f"{source!r} in {configs_dir() / 'distilled'}; pass datastore=DIR (a data set written by "
            f"jaxspec train --stages distill)"
        )
    return str(path)
