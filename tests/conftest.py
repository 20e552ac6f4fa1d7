"""Test setup: 8 host CPU devices (real meshes like (2, 4)) before jax starts; shared fixtures."""

import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One on-disk compilation cache for the run, shared by both xdist workers and the CLI subprocesses the
# tests start (they inherit the variable): a program that an earlier module, the other worker or a previous
# run already compiled is read back instead of compiled again (in-process caches are dropped after each
# module, below). Keyed by the program, jax/XLA version and flags, so it cannot serve a stale program.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax-cc")
)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop jax's compiled-program caches after each test module (keeps a long run's memory flat)."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (float32), loaded once per test session."""
    import jaxspec

    return jaxspec.load("smollm2-135m")
