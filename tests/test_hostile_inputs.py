"""Hostile and careless input (issue 23): each probe must end in a clear jaxspec error, fast, with the
process alive and nothing lost. Chat templates, the batch job's files, request parameters, model files."""

from __future__ import annotations

import threading
import time

import pytest

from jaxspec.errors import TemplateError
from jaxspec.loading.chat_template import TemplateLimits, render_chat_template

# ---------------------------------------------------------------------------------------------------
# Chat templates: time and size limits, every failure a TemplateError naming the source
# ---------------------------------------------------------------------------------------------------

NESTED_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE_TEMPLATES = [
    (NESTED_LOOP, "time limit"),
    ("{{ '{:>2000000000}'.format('x') }}", "format width"),
    ("{{ '{:>{}}'.format('x', 2000000000) }}", "format width"),
    ("{{ 'x'|center(2000000000) }}", "center width"),
    ("{{ 'x'.ljust(2000000000) }}", "str.ljust width"),
    ("{{ 'abc'.zfill(2000000000) }}", "str.zfill width"),
    ("{{ '%.2000000000f' % 1.0 }}", "format width"),
    ("{{ '%*d' % (2000000000, 1) }}", "format width"),
    ("{{ '%.2000000000f'|format(1.0) }}", "format width"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    ("{% for i in range(10**9) %}{% endfor %}", "Range too big"),
    ("{{ 10**1000000 }}", "bits"),
    ("{% set s = 'x' * 3000000 %}{% set s = s ~ s %}{{ s|length }}", "built with `~`"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "+"),
    ("{{ ('x' * 1000000)|replace('x', 'x' * 1000) }}", "replace result"),
    ("{{ (['x' * 1000000] * 1000)|join }}", "join result"),
    ("{{ '-'.join(['x' * 1000000] * 1000) }}", "str.join result"),
    ("{{ messages|tojson(indent=2000000000) }}", "indent"),
    ("{{ 'x'|indent(2000000000) }}", "indent width"),
    ("{{ 'x\\t'.expandtabs(2000000000) }}", "expandtabs"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "output of"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ 2.0 ** 100000 }}", "OverflowError"),
    ("{{ messages[5] }}{{ messages.x.y }}", "UndefinedError"),
]
MESSAGE = [{"role": "user", "content": "hi"}]
LIMITS = TemplateLimits(time_s=0.5)


def _render(template: str, limits: TemplateLimits = LIMITS) -> str:
    return render_chat_template(
        template, MESSAGE, add_generation_prompt=True, bos_token="", eos_token="", source="m.gguf",
        limits=limits,
    )  # fmt: skip


@pytest.mark.parametrize("template,fragment", HOSTILE_TEMPLATES)
def test_hostile_template_is_a_template_error_within_the_limit(template, fragment):
    start = time.monotonic()
    with pytest.raises(TemplateError, match=r"^m\.gguf: chat template") as caught:
        _render(template)
    assert fragment in str(caught.value)
    assert time.monotonic() - start < LIMITS.time_s + 1.0


def test_time_limit_holds_outside_the_main_thread():
    outcome: list = []

    def render() -> None:
        try:
            _render(NESTED_LOOP)
        except TemplateError as error:
            outcome.append(str(error))

    start = time.monotonic()
    thread = threading.Thread(target=render)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and "time limit" in outcome[0]
    assert time.monotonic() - start < LIMITS.time_s + 1.0


def test_limits_are_overridable_and_normal_templates_render(monkeypatch):
    template = (
        "{% for m in messages %}{{ m.role }}{% endfor %}{{ '-'.join(['a','b']) }}{{ '{:>3}'.format(1) }}"
    )
    assert _render(template) == "usera-b  1"
    with pytest.raises(TemplateError, match="of 6 is over the limit of 5"):
        _render("{{ 'x' * 6 }}", TemplateLimits(max_chars=5))
    monkeypatch.setenv("JAXSPEC_TEMPLATE_MAX_CHARS", "5")
    with pytest.raises(TemplateError, match="JAXSPEC_TEMPLATE_MAX_CHARS"):
        render_chat_template("{{ 'x' * 6 }}", MESSAGE, add_generation_prompt=True, bos_token="", eos_token="")
    monkeypatch.setenv("JAXSPEC_TEMPLATE_TIME_S", "0.2")
    start = time.monotonic()
    with pytest.raises(TemplateError, match="0.2 s"):
        render_chat_template(NESTED_LOOP, MESSAGE, add_generation_prompt=True, bos_token="", eos_token="")
    assert time.monotonic() - start < 1.0
