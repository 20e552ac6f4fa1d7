"""Test setup: 8 host CPU devices (real meshes like (2, 4)) before jax starts; shared fixtures."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent XLA compilation cache per test run, shared by the xdist workers and by every subprocess a
# test starts (CLI runs, batch jobs killed and resumed, multi-process training): a program that another
# process of the run already compiled is read back instead of compiled again (the cache key covers the
# program, the compile options and XLA_FLAGS). The first process that imports this file makes it and
# removes it at exit: pytest's main process, which starts the workers with it in their environment.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _compilation_cache = tempfile.mkdtemp(prefix="jaxspec-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _compilation_cache
    atexit.register(shutil.rmtree, _compilation_cache, ignore_errors=True)

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
