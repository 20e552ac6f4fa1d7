"""JAX's persistent compilation cache, on by default for the `jaxspec` command line.

Every `jaxspec demo | generate | bench | train` run compiles the same programs again: the 30-layer
SmolLM2 decode, verify and prefill loops take 20-30 s each on a 2-core CPU, and a heads benchmark spends
about 9 of its 20 minutes compiling. JAX can keep compiled executables on disk, keyed by the program's
HLO, the compile options, the backend and the jax/jaxlib versions, so a rerun with the same shapes loads
them instead (a changed program, shape, flag or jax version is a different key, never a stale hit).
MaxText and tpu-inference set a cache directory the same way.

The directory is, in order: the `directory` argument (`jaxspec bench --compile-cache DIR`), the
environment variable `JAXSPEC_COMPILE_CACHE`, a directory the user already gave jax
(`JAX_COMPILATION_CACHE_DIR`), else `$XDG_CACHE_HOME/jaxspec/xla` (`~/.cache/jaxspec/xla`). `off` (or an
empty value) turns it off. The cache is bounded (`DEFAULT_MAX_BYTES`, least recently used entries go
first) and only programs that took at least `MIN_COMPILE_SECONDS` to compile are written. A directory that
cannot be created is reported on stderr and the command runs uncached: a cache never fails a command.
The Python API leaves jax's configuration to the caller (`enable_compile_cache()` is one call).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV_VAR = "JAXSPEC_COMPILE_CACHE"
OFF_VALUES = ("", "off", "none", "0", "false")
DEFAULT_MAX_BYTES = 4 * 1024**3
MIN_COMPILE_SECONDS = 1.0


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/jaxspec/xla, or ~/.cache/jaxspec/xla when XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxspec" / "xla"


def resolve_cache_dir(directory: str | os.PathLike | None = None) -> Path | None:
    """The directory the cache would use (module docstring for the order); None when turned off."""
    import jax

    if directory is None:
        directory = os.environ.get(ENV_VAR)
    if directory is None:
        directory = jax.config.jax_compilation_cache_dir or default_cache_dir()
    if str(directory).strip().lower() in OFF_VALUES:
        return None
    return Path(directory).expanduser()


def enable_compile_cache(
    directory: str | os.PathLike | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    min_compile_seconds: float = MIN_COMPILE_SECONDS,
) -> Path | None:
    """Point jax's persistent compilation cache at `directory` (see `resolve_cache_dir`) and return it;
    None (jax's configuration untouched) when it is turned off or the directory cannot be created."""
    import jax

    path = resolve_cache_dir(directory)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"jaxspec: compilation cache off ({path}: {exc.strerror or exc})", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_compilation_cache_max_size", int(max_bytes))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    return path
