"""Render a model's Jinja chat template in a sandbox, the way Hugging Face transformers renders it.

Chat templates come with downloaded models and are untrusted code. They run in jinja2's
ImmutableSandboxedEnvironment, tightened further: any access to an unsafe attribute (``__class__``,
``__globals__``, ...) fails at once instead of rendering as an empty string, namespaces refuse
underscore names, and ``*`` cannot build huge strings or lists.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxspec.errors import InputError, TemplateError

MAX_REPEAT_LENGTH = 1_000_000  # longest string / list a template may build with `*`


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    **extra: Any,
) -> str:
    """Render `messages` (list of {"role": str, "content": str, ...}) with a chat template.

    Raises InputError for malformed messages (naming the index and field) and TemplateError for a
    template that does not compile, calls raise_exception, or tries to leave the sandbox.
    """
    validate_messages(messages)
    if not isinstance(template, str):
        raise TemplateError(f"chat template must be a string, got {type(template).__name__}")
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=[dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except SecurityError as error:
        raise TemplateError(f"chat template tried to escape its sandbox: {error}") from None
    except _TemplateRaised as error:
        raise TemplateError(f"chat template raised an exception: {error}") from None
    except jinja2.TemplateError as error:
        raise TemplateError(f"chat template failed to render: {type(error).__name__}: {error}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as error:
        raise TemplateError(f"chat template failed to render: {type(error).__name__}: {error}") from None


def validate_messages(messages: Any) -> None:
    """Messages must be a list of dicts, each with string 'role' and 'content'."""
    if not isinstance(messages, (list, tuple)):
        raise InputError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InputError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        for field in ("role", "content"):
            if field not in message:
                raise InputError(f"messages[{index}] lacks the field {field!r}")
            if not isinstance(message[field], str):
                kind = type(message[field]).__name__
                raise InputError(f"messages[{index}][{field!r}] must be a string, got {kind}")


class _TemplateRaised(Exception):
    """A template called raise_exception(message)."""


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, failing loudly on unsafe attributes and bounding `*`."""

    intercepted_binops = frozenset(["*"])

    def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                repeats = isinstance(sequence, (str, list, tuple)) and isinstance(count, int)
                if repeats and len(sequence) * count > MAX_REPEAT_LENGTH:
                    raise SecurityError(f"template tried to build a sequence over {MAX_REPEAT_LENGTH} long")
        return super().call_binop(context, operator, left, right)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text in transformers): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja2's `namespace()` that refuses attribute names starting with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja2's own signature trick)
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, **options: Any) -> str:
    """jinja's tojson without HTML escaping (as transformers does); passes separators / sort_keys on."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **options)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _make_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return dict(*args, **kwargs)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    environment = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _make_dict
    environment.globals["namespace"] = _SafeNamespace
    try:
        return environment.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise TemplateError(f"chat template syntax error at line {error.lineno}: {error.message}") from None
