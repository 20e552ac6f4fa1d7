"""Batch job input: read a JSONL file of requests and validate every line before anything runs.

One request per line (blank lines are skipped):

  id              string or integer, required, unique in the file ("1" and 1 count as the same id:
                  both seed the request's random stream from the text "1")
  prompt          text; rendered with the model's chat template as one user message unless the job
                  runs with --no-chat (or the model has no chat template)
  messages        chat: [{"role": "...", "content": "..."}, ...], rendered with the chat template
  prompt_ids      pre-tokenized prompt, a list of token ids, used as is (no template); works with models
                  that ship no tokenizer
  max_new_tokens  integer >= 1            (default: the job's --max-new-tokens)
  temperature     number >= 0, 0 = greedy (default: --temperature)
  top_k           integer in [0, 2**31), 0 = off (default: --top-k)
  top_p           number in (0, 1]        (default: --top-p)
  seed            integer in [0, 2**31)   (default: --seed)
  metadata        any JSON value, copied unchanged to the output line

Exactly one of prompt / messages / prompt_ids. Any other key is an error (a misspelt parameter would
otherwise be silently ignored). Problems are reported as `InputIssue`s: `file:line: what is wrong`.
Checks that need the model (tokenizer present, token ids in the vocabulary, prompt + max_new_tokens
within the context) run in `tokenize_requests`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxspec.config import INT32_MAX, SamplingParams
from jaxspec.errors import InputError, JaxspecError

PROMPT_FIELDS = ("prompt", "messages", "prompt_ids")
PARAMETER_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
KNOWN_FIELDS = ("id", *PROMPT_FIELDS, *PARAMETER_FIELDS, "metadata")
MAX_SEED = INT32_MAX


@dataclasses.dataclass(frozen=True)
class InputIssue:
    """One invalid input line. `request_id` is the line's id when it could be read."""

    path: str
    line: int
    message: str
    request_id: str | int | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {"file": self.path, "line": self.line, "id": self.request_id, "error": self.message}


@dataclasses.dataclass(frozen=True)
class RequestDefaults:
    """Job-wide values for the parameters a request leaves out."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class BatchRequest:
    """One valid input line. Exactly one of prompt / messages / prompt_ids is set."""

    id: str | int
    line: int
    prompt: str | None
    messages: tuple[dict[str, str], ...] | None
    prompt_ids: tuple[int, ...] | None
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    metadata: Any = None

    @property
    def key(self) -> str:
        """The id as text: what resume and duplicate checks compare."""
        return str(self.id)


@dataclasses.dataclass(frozen=True)
class TokenizedRequest:
    """A request with its final prompt token ids (template applied)."""

    request: BatchRequest
    prompt_ids: tuple[int, ...]


class _Invalid(Exception):
    """A line-level validation failure (internal: becomes an InputIssue)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _int_field(record: dict, name: str, default: int, minimum: int, maximum: int | None = None) -> int:
    value = record.get(name, default)
    if not _is_int(value):
        raise _Invalid(f"'{name}' must be an integer, got {json.dumps(value)}")
    if value < minimum:
        raise _Invalid(f"'{name}' must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise _Invalid(f"'{name}' must be <= {maximum}, got {value}")
    return value


def _parse_id(record: dict) -> str | int:
    if "id" not in record:
        raise _Invalid("missing 'id'")
    value = record["id"]
    if not (_is_int(value) or isinstance(value, str)):
        raise _Invalid(f"'id' must be a string or an integer, got {json.dumps(value)}")
    if isinstance(value, str) and not value.strip():
        raise _Invalid("'id' is an empty string")
    return value


def _parse_sampling(record: dict, defaults: RequestDefaults) -> SamplingParams:
    temperature = record.get("temperature", defaults.temperature)
    if not _is_number(temperature) or temperature < 0:
        raise _Invalid(f"'temperature' must be a number >= 0, got {json.dumps(temperature)}")
    top_p = record.get("top_p", defaults.top_p)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise _Invalid(f"'top_p' must be a number in (0, 1], got {json.dumps(top_p)}")
    top_k = _int_field(record, "top_k", defaults.top_k, 0, INT32_MAX)
    return SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p))


def _parse_prompt(record: dict) -> tuple[str | None, tuple | None, tuple[int, ...] | None]:
    given = [name for name in PROMPT_FIELDS if name in record]
    if not given:
        raise _Invalid("needs one of 'prompt', 'messages' or 'prompt_ids'")
    if len(given) > 1:
        raise _Invalid(f"give only one of 'prompt', 'messages', 'prompt_ids' (got {', '.join(given)})")
    value = record[given[0]]
    if given[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise _Invalid(f"'prompt' must be a non-empty string, got {json.dumps(value)[:60]}")
        return value, None, None
    if given[0] == "messages":
        if not isinstance(value, list) or not value:
            raise _Invalid('\'messages\' must be a non-empty list of {"role": ..., "content": ...}')
        for i, message in enumerate(value):
            ok = isinstance(message, dict) and set(message) == {"role", "content"}
            if not ok or not all(isinstance(message[k], str) for k in ("role", "content")):
                raise _Invalid(f'\'messages\'[{i}] must be {{"role": string, "content": string}}')
        return None, tuple(dict(m) for m in value), None
    if not isinstance(value, list) or not value or not all(_is_int(t) and t >= 0 for t in value):
        raise _Invalid("'prompt_ids' must be a non-empty list of token ids (integers >= 0)")
    return None, None, tuple(value)


def _load_json(text: str) -> Any:
    """json.loads with every failure as _Invalid: malformed JSON, nesting too deep, a number with too
    many digits."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Invalid(f"malformed JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        raise _Invalid("JSON nested too deeply") from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise _Invalid(f"unreadable JSON value: {str(exc).split(':')[0]}") from None


def parse_request(text: str, line: int, defaults: RequestDefaults) -> BatchRequest:
    """One JSONL line -> BatchRequest; raises _Invalid with the reason."""
    record = _load_json(text)
    if not isinstance(record, dict):
        raise _Invalid(f"a request must be a JSON object, got {type(record).__name__}")
    request_id = _parse_id(record)
    unknown = [key for key in record if key not in KNOWN_FIELDS]
    if unknown:
        raise _Invalid(f"unknown field {unknown[0]!r} (known: {', '.join(KNOWN_FIELDS)})")
    prompt, messages, prompt_ids = _parse_prompt(record)
    return BatchRequest(
        id=request_id,
        line=line,
        prompt=prompt,
        messages=messages,
        prompt_ids=prompt_ids,
        max_new_tokens=_int_field(record, "max_new_tokens", defaults.max_new_tokens, 1),
        sampling=_parse_sampling(record, defaults),
        seed=_int_field(record, "seed", defaults.seed, 0, MAX_SEED),
        metadata=record.get("metadata"),
    )


def check_defaults(defaults: RequestDefaults) -> None:
    """The job-wide defaults obey the same rules as a request's own parameters (InputError if not)."""
    record = {"id": 0, "prompt_ids": [0], **dataclasses.asdict(defaults)}
    try:
        parse_request(json.dumps(record), 0, defaults)
    except _Invalid as exc:
        raise InputError(f"command-line default: {exc}") from None


def _readable_id(text: str) -> str | int | None:
    try:
        value = _load_json(text).get("id")
    except (_Invalid, AttributeError):
        return None
    return value if _is_int(value) or isinstance(value, str) else None


def _decode_line(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Invalid(f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})") from None


def read_requests(path: str | Path, defaults: RequestDefaults) -> tuple[list[BatchRequest], list[InputIssue]]:
    """Read and check every line of `path` (no model needed). Returns (valid requests, issues).

    A repeated id is an issue on its later lines; its first line stays valid.
    """
    path = str(path)
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().split(b"\n")  # not splitlines(): JSON strings may hold raw U+2028 etc.
    except OSError as exc:
        raise JaxspecError(f"{path}: cannot read the input: {exc.strerror or exc}") from None
    requests: list[BatchRequest] = []
    issues: list[InputIssue] = []
    first_line_of: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            text = _decode_line(raw)
            request = parse_request(text, number, defaults)
        except _Invalid as exc:
            readable = _readable_id(raw.decode("utf-8", errors="replace"))
            issues.append(InputIssue(path, number, str(exc), readable))
            continue
        if request.key in first_line_of:
            message = f"duplicate id {json.dumps(request.id)} (first on line {first_line_of[request.key]})"
            issues.append(InputIssue(path, number, message, request.id))
            continue
        first_line_of[request.key] = number
        requests.append(request)
    return requests, issues


def _prompt_tokens(request: BatchRequest, model: Any, chat: bool) -> list[int]:
    if request.prompt_ids is not None:
        return list(request.prompt_ids)
    tokenizer = model.tokenizer
    field = "prompt" if request.prompt is not None else "messages"
    if tokenizer is None:
        raise _Invalid(f"'{field}' needs a tokenizer but the model has none: give 'prompt_ids' instead")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if request.messages is not None and not has_template:
        raise _Invalid("'messages' needs a chat template but the model's tokenizer has none")
    messages = request.messages
    if request.prompt is not None:
        if not (chat and has_template):
            return list(tokenizer.encode(request.prompt))
        messages = ({"role": "user", "content": request.prompt},)
    try:
        return list(model.chat_prompt([dict(m) for m in messages]))
    except JaxspecError as exc:
        raise _Invalid(f"chat template failed: {exc}") from None


def tokenize_requests(
    requests: Sequence[BatchRequest], model: Any, path: str | Path, chat: bool = True
) -> tuple[list[TokenizedRequest], list[InputIssue]]:
    """Encode each request's prompt (chat template for `messages`, and for `prompt` when `chat`) and
    check it against the model: tokenizer present, ids inside the vocabulary, prompt length +
    max_new_tokens within the model's context. Returns (ready requests, issues)."""
    vocab = model.config.vocab_size
    context = model.config.max_position_embeddings
    ready: list[TokenizedRequest] = []
    issues: list[InputIssue] = []
    for request in requests:
        try:
            ids = _prompt_tokens(request, model, chat)
            if not ids:
                raise _Invalid("the prompt encodes to zero tokens")
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise _Invalid(f"'prompt_ids' has token id {bad}, outside the vocabulary [0, {vocab})")
            if len(ids) + request.max_new_tokens > context:
                raise _Invalid(
                    f"prompt of {len(ids)} tokens + max_new_tokens {request.max_new_tokens} = "
                    f"{len(ids) + request.max_new_tokens} exceeds the model's context of {context}"
                )
        except _Invalid as exc:
            issues.append(InputIssue(str(path), request.line, str(exc), request.id))
            continue
        ready.append(TokenizedRequest(request=request, prompt_ids=tuple(ids)))
    return ready, issues
