"""Test setup: 8 host CPU devices (real meshes like (2, 4)) before jax starts; shared fixtures."""

import os

from tests.xla_flags import FAST_COMPILE, xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags(devices=8))
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:  # tests/xla_flags.py says why
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The command line caches compiled programs on disk by default (`jaxspec.compile_cache`); tests that call it
# in-process stay hermetic (tests/test_compile_cache.py turns it on where it is the subject).
os.environ.setdefault("JAXSPEC_COMPILE_CACHE", "off")

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
