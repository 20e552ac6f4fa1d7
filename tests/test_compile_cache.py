"""The command line's persistent compilation cache (`jaxspec.compile_cache`): where it goes, that it can
be turned off, and that a second process loads what the first compiled instead of compiling again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxspec.compile_cache import ENV_VAR, default_cache_dir, enable_compile_cache, resolve_cache_dir

REPO = Path(__file__).resolve().parents[1]

# Run in a fresh process (jax reads the cache directory once, at its first compile): enable the cache at
# argv[1], compile one program and print how many compiles the cache answered.
ROUND_TRIP = """
import json, sys
import jax, jax.numpy as jnp
from jax._src import monitoring
from jaxspec.compile_cache import enable_compile_cache
hits = []
monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
)
path = enable_compile_cache(sys.argv[1], min_compile_seconds=0.0)
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0) * 3.0)
f(jnp.ones((64, 64))).block_until_ready()
print(json.dumps({"path": str(path), "hits": len(hits)}))
"""


def _run(code: str, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}  # conftest's "off" stays with the tests
    env.update(PYTHONPATH=str(REPO), **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)


def test_a_second_process_loads_the_compiled_program_from_the_cache(tmp_path):
    cache = tmp_path / "xla"
    first = _run(ROUND_TRIP, str(cache))
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout.splitlines()[-1]) == {"path": str(cache), "hits": 0}
    entries = [p for p in cache.rglob("*") if p.is_file()]
    assert entries, "the first process wrote nothing to the cache"
    second = _run(ROUND_TRIP, str(cache))
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout.splitlines()[-1])["hits"] >= 1


def test_off_leaves_jax_uncached(tmp_path):
    off = _run(ROUND_TRIP, "off")
    assert off.returncode == 0, off.stderr
    assert json.loads(off.stdout.splitlines()[-1]) == {"path": "None", "hits": 0}


def test_the_directory_comes_from_the_argument_then_the_environment_then_jax_then_the_default(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_cache_dir() == tmp_path / "env"
    for off in ("off", "OFF", "", "none"):
        monkeypatch.setenv(ENV_VAR, off)
        assert resolve_cache_dir() is None
    assert resolve_cache_dir("off") is None
    monkeypatch.delenv(ENV_VAR)
    before = jax.config.jax_compilation_cache_dir
    try:  # a directory given to jax itself (JAX_COMPILATION_CACHE_DIR) is kept
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
        assert resolve_cache_dir() == tmp_path / "jax"
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert resolve_cache_dir() == default_cache_dir() == tmp_path / "xdg" / "jaxspec" / "xla"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_a_directory_that_cannot_be_created_turns_the_cache_off_with_a_message(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    before = jax.config.jax_compilation_cache_dir
    assert enable_compile_cache(blocker / "xla") is None
    assert "compilation cache off" in capsys.readouterr().err
    assert jax.config.jax_compilation_cache_dir == before


@pytest.mark.parametrize("setting", ["dir", "off"])
def test_every_command_line_run_sets_the_cache_up_first(tmp_path, setting):
    # `train` with a missing prompts file fails (rc 2) before any model loads, after the cache is set up.
    code = (
        "import jax, jaxspec.cli\n"
        "rc = jaxspec.cli.main(['train', '--method', 'eagle3', '--workdir', 'unused', '--stages', 'distill',"
        " '--prompts', 'no-such-prompts.jsonl'])\n"
        "print(rc, jax.config.jax_compilation_cache_dir)\n"
    )
    value = str(tmp_path / "cli") if setting == "dir" else "off"
    run = _run(code, env_extra={ENV_VAR: value, "JAX_PLATFORMS": "cpu"})
    printed = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr
    assert printed == f"2 {value if setting == 'dir' else None}", run.stderr
