"""CLI spec resolution: head methods find the shipped head, the demo drafts with the best one."""

import argparse

import pytest

from jaxspec.cli import _demo_default_spec, _spec_from_args
from jaxspec.errors import InputError


def _args(**overrides) -> argparse.Namespace:
    values = {"model": "smollm2-135m", "spec": None, "head": None, "num_speculative_tokens": 3, "topk": 1}
    return argparse.Namespace(**{**values, **overrides})


def test_head_methods_default_to_the_shipped_head():
    spec = _spec_from_args(_args(spec="eagle3"))
    assert spec.method == "eagle3" and spec.head == "configs/heads/smollm2-135m/eagle3"
    assert spec.num_speculative_tokens == 3
    assert _spec_from_args(_args(spec="medusa", head="/some/head")).head == "/some/head"
    assert _spec_from_args(_args(spec="ngram")).head is None


def test_a_head_method_without_any_head_is_an_error_naming_the_path():
    expected = r"no trained head for model 'tiny.gguf' in configs/heads/tiny.gguf/eagle"
    with pytest.raises(InputError, match=expected):
        _spec_from_args(_args(model="tiny.gguf", spec="eagle"))


def test_none_means_autoregressive():
    for text in (None, "none", "off", "AR"):
        assert _spec_from_args(_args(spec=text)) is None


def test_demo_drafts_with_the_shipped_eagle3_head_and_falls_back_to_autoregressive():
    assert _demo_default_spec("smollm2-135m") == "eagle3"
    assert _demo_default_spec("some/other-model") is None
