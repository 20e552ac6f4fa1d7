"""CLI spec resolution: head methods find the shipped head, the demo drafts with the best one."""

import argparse

import pytest

from jaxspec.cli import _demo_default_spec, _spec_from_args
from jaxspec.drafters.heads.shipped import shipped_heads_dir
from jaxspec.errors import InputError


def _args(**overrides) -> argparse.Namespace:
    values = {
        "model": "smollm2-135m",
        "spec": None,
        "head": None,
        "num_speculative_tokens": 3,
        "topk": 1,
        "lookup_min_match": 0,
        "token_map": None,
    }
    return argparse.Namespace(**{**values, **overrides})


def test_head_methods_default_to_the_shipped_head():
    spec = _spec_from_args(_args(spec="eagle3"))
    assert spec.method == "eagle3" and spec.head == str(shipped_heads_dir() / "smollm2-135m" / "eagle3")
    assert spec.num_speculative_tokens == 3 and spec.lookup_min_match == 0
    assert _spec_from_args(_args(spec="eagle3", lookup_min_match=3)).lookup_min_match == 3
    assert _spec_from_args(_args(spec="ngram", lookup_min_match=3)).lookup_min_match == 0  # heads only
    tree = _spec_from_args(_args(spec="eagle3", topk=4, lookup_min_match=3))  # beside an EAGLE tree
    assert tree.topk == 4 and tree.lookup_min_match == 3
    medusa = _spec_from_args(_args(spec="medusa", head="/some/head", topk=4, lookup_min_match=3))
    assert medusa.lookup_min_match == 0  # a Medusa tree is static: lookup only in front of its chain
    assert _spec_from_args(_args(spec="medusa", head="/some/head")).head == "/some/head"
    assert _spec_from_args(_args(spec="eagle", token_map="shipped")).token_map == "shipped"
    with pytest.raises(ValueError, match="token_map restricts the drafts of heads"):
        _spec_from_args(_args(spec="eagle3", token_map="shipped"))
    assert _spec_from_args(_args(spec="ngram")).head is None


def test_a_head_method_without_any_head_is_an_error_naming_the_path():
    expected = r"no trained head for model 'tiny.gguf' in \S*configs/heads/tiny.gguf/eagle"
    with pytest.raises(InputError, match=expected):
        _spec_from_args(_args(model="tiny.gguf", spec="eagle"))


def test_none_means_autoregressive():
    for text in (None, "none", "off", "AR"):
        assert _spec_from_args(_args(spec=text)) is None


def test_demo_drafts_with_the_shipped_eagle3_head_and_falls_back_to_autoregressive():
    assert _demo_default_spec("smollm2-135m") == "eagle3"
    assert _demo_default_spec("some/other-model") is None


def test_the_api_resolves_a_missing_head_to_the_one_shipped_for_the_loaded_model():
    """SpecConfig(method=...) without head= on SmolLM2: the head shipped for it (the CLI's rule), looked
    up from the model's resolved file as `jaxspec.load` records it in Model.source."""
    from jaxspec.drafters.heads.shipped import resolve_head
    from jaxspec.loading.registry import resolve_model_path

    source = str(resolve_model_path("smollm2-135m"))
    for method in ("medusa", "eagle", "eagle3", "mtp"):
        assert resolve_head(source, method, None) == str(shipped_heads_dir() / "smollm2-135m" / method)
    assert resolve_head(source, "eagle3", "/my/head") == "/my/head"
    with pytest.raises(InputError, match=r"no head is shipped for model '/elsewhere/x.gguf'.*head="):
        resolve_head("/elsewhere/x.gguf", "eagle3", None)


def test_help_lists_the_batch_options_without_importing_jax():
    """`jaxspec generate --help` lists every batch-job option and answers without importing jax (what
    made every --help take ~4 s); timed in a fresh interpreter."""
    import subprocess
    import sys
    import time

    from jaxspec.batch.job import build_parser

    code = (
        "import sys, jaxspec.cli\n"
        "try:\n    jaxspec.cli.main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('JAX_IMPORTED' if 'jax' in sys.modules else 'NO_JAX')\n"
    )
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    seconds = time.perf_counter() - start
    assert out.strip().endswith("NO_JAX")
    assert seconds < 3.0  # ~0.5 s here; generous for a loaded machine (with jax: ~5 s)
    batch_options = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    missing = [o for o in sorted(batch_options) if o not in out]
    assert not missing, missing


def test_ctrl_c_during_train_is_a_message_and_exit_130_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C in `jaxspec train` (here raised from the stage runner) ends with exit status 130 and says
    what is kept and how to continue, instead of a KeyboardInterrupt traceback."""
    import jaxspec.cli
    import jaxspec.train.cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(jaxspec.train.cli, "run", interrupted)
    try:
        status = jaxspec.cli.main(["train", "--method", "eagle3", "--workdir", "unused"])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped jaxspec.cli.main")
    assert status == 130
    err = capsys.readouterr().err
    assert "jaxspec train: interrupted" in err
    assert "rerun the same command to continue, with --resume" in err
