"""Tokenizer: a `tokenizers` backend plus the model's special tokens and chat template.

Built either from a GGUF file's metadata (`Tokenizer.from_gguf`, mirroring how llama.cpp and
transformers read `tokenizer.ggml.*`) or from a Hugging Face directory (`Tokenizer.from_dir`:
tokenizer.json + tokenizer_config.json). `encode` matches transformers' `tokenizer(text)["input_ids"]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from jaxspec.errors import InputError, ModelLoadError, TemplateError
from jaxspec.loading.chat_template import render_chat_template
from jaxspec.loading.hf_dir import read_json_object

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

# How llama.cpp splits text before byte-level BPE, per `tokenizer.ggml.pre`. Unlisted values use
# GPT-2's split, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3 vocabularies: a word found whole in the vocabulary wins over merges, and BOS is added
# unless the file says otherwise (as llama.cpp does).
_LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe"})
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


class Tokenizer:
    """Text <-> token ids for one model, with its chat template.

    encode(text) adds exactly the special tokens the model's tokenizer config asks for (BOS for
    SentencePiece Llama files, nothing for SmolLM2); apply_chat_template adds none beyond the
    template's own.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None,
        eos_tokens: Sequence[str],
        chat_template: str | None,
        source: str,
    ) -> None:
        self.backend = backend
        self.source = source
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.bos_token_id = None if bos_token is None else self._token_id(bos_token)
        self.eos_tokens = tuple(eos_tokens)
        self.eos_token_ids = tuple(dict.fromkeys(self._token_id(token) for token in self.eos_tokens))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str | None:
        return self.eos_tokens[0] if self.eos_tokens else None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer config adds (as transformers)."""
        if not isinstance(text, str):
            raise InputError(f"text to encode must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; ids outside [0, vocab_size) raise InputError naming the position."""
        id_list = [int(i) for i in ids]
        for position, token_id in enumerate(id_list):
            if not 0 <= token_id < self.vocab_size:
                raise InputError(
                    f"token id {token_id} at position {position} is outside [0, {self.vocab_size})"
                )
        return self.backend.decode(id_list, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages`, as text."""
        if self.chat_template is None:
            raise TemplateError(f"{self.source}: this tokenizer has no chat template")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            source=self.source,
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat (no special tokens added beyond the template's)."""
        text = self.render_chat(messages, add_generation_prompt)
        return self.backend.encode(text, add_special_tokens=False).ids

    def _token_id(self, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"{self.source}: special token {token!r} is not in the vocabulary")
        return token_id

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], source: str = "<gguf metadata>") -> Tokenizer:
        """Build from GGUF metadata (the third value `read_gguf` returns)."""

        def key(name: str, default: Any = None) -> Any:
            value = metadata.get(f"tokenizer.ggml.{name}", default)
            if value is None:
                raise ModelLoadError(f"{source}: metadata field 'tokenizer.ggml.{name}' is missing")
            return value

        kind = key("model")
        tokens: list[str] = key("tokens")
        token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            backend = _byte_level_backend(tokens, key("merges"), metadata.get("tokenizer.ggml.pre"))
            add_bos_default = metadata.get("tokenizer.ggml.pre") in _LLAMA3_PRE
        elif kind == "llama":
            backend = _sentencepiece_backend(metadata, tokens, source)
            add_bos_default = True
        else:
            raise ModelLoadError(
                f"{source}: tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', 'llama')"
            )
        _add_special_tokens(backend, tokens, token_types, byte_level=kind == "gpt2")

        def token_at(name: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{name}")
            if index is None:
                return None
            if not 0 <= index < len(tokens):
                raise ModelLoadError(f"{source}: tokenizer.ggml.{name} = {index} is outside the vocabulary")
            return tokens[index]

        bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _special_tokens_template(
            backend, bos if add_bos else None, eos if add_eos else None
        )
        eos_tokens = [token for token in (eos, token_at("eot_token_id")) if token is not None]
        return cls(
            backend,
            bos_token=bos,
            eos_tokens=eos_tokens,
            chat_template=metadata.get("tokenizer.chat_template"),
            source=source,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face directory: tokenizer.json, tokenizer_config.json (optional),
        chat_template.jinja (optional) and generation_config.json's eos ids (optional)."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{tokenizer_file}: file not found")
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{tokenizer_file}: cannot parse ({error})") from None
        config_file = directory / "tokenizer_config.json"
        config = read_json_object(config_file) if config_file.is_file() else {}
        bos, eos = _token_content(config.get("bos_token")), _token_content(config.get("eos_token"))
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            # transformers rebuilds the post-processor from these flags when the config sets them
            add_bos, add_eos = bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
            backend.post_processor = _special_tokens_template(
                backend, bos if add_bos else None, eos if add_eos else None
            )
        eos_tokens = [eos] if eos is not None else []
        generation_file = directory / "generation_config.json"
        if generation_file.is_file():
            ids = read_json_object(generation_file).get("eos_token_id")
            ids = [ids] if isinstance(ids, int) else list(ids or [])
            eos_tokens += [
                backend.id_to_token(int(i)) for i in ids if backend.id_to_token(int(i)) is not None
            ]
        return cls(
            backend,
            bos_token=bos,
            eos_tokens=eos_tokens,
            chat_template=_chat_template_of(directory, config),
            source=str(directory),
        )


def _byte_level_backend(tokens: list[str], merges: list[str], pre: str | None) -> Backend:
    """GPT-2 style byte-level BPE. Tokens written outside the byte alphabet are respelled in it."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    byte_to_char = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet else "".join(byte_to_char[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    model = BPE(vocab, pairs, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE)
    backend = Backend(model)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM / SmolLM2 (and llama.cpp's "smollm" pre-type) split digits one by one first.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _PRE_TOKENIZER_SPLITS:
        split = pre_tokenizers.Split(Regex(_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(metadata: dict[str, Any], tokens: list[str], source: str) -> Backend:
    """SentencePiece-style BPE with byte fallback (llama.cpp's "llama" vocabulary)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            raise ModelLoadError(f"{source}: a 'llama' tokenizer needs tokenizer.ggml.merges or .scores")
        pairs = _merges_from_scores(tokens, scores, vocab)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    backend = Backend(BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(
    tokens: list[str], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Merges implied by a scored vocabulary (SentencePiece files carry scores, not merges).

    Every split of a token into two known tokens is a merge, ranked by the merged token's score,
    highest first; ties go to the longer left piece, then the longer right piece, then vocabulary
    order (the order transformers uses, so both build the same tokenizer).
    """
    candidates: list[tuple[float, int, int, int, int, str, str]] = []
    for index, (token, score) in enumerate(zip(tokens, scores, strict=True)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                candidates.append((-score, -len(left), -len(right), index, vocab[left], left, right))
    candidates.sort(key=lambda c: c[:5])
    return [(left, right) for *_, left, right in candidates]


def _add_special_tokens(
    backend: Backend, tokens: list[str], token_types: list[int], byte_level: bool
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens, so both are
    matched whole in text. A byte-level "control" token spelled outside the byte alphabet is a
    llama.cpp mislabel and is skipped (adding it would grow the vocabulary)."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    control, user_defined = [], []
    for token, token_type in zip(tokens, token_types, strict=True):
        if token_type == _CONTROL and (alphabet is None or set(token) <= alphabet):
            control.append(AddedToken(token, special=True, normalized=False))
        elif token_type == _USER_DEFINED and backend.token_to_id(token) is not None:
            user_defined.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)


def _special_tokens_template(
    backend: Backend, bos: str | None, eos: str | None
) -> processors.TemplateProcessing:
    """Post-processor adding BOS before and / or EOS after the text."""

    def sequence(text: str, type_id: int) -> str:
        parts = (
            ([f"{bos}:{type_id}"] if bos else [])
            + [f"{text}:{type_id}"]
            + ([f"{eos}:{type_id}"] if eos else [])
        )
        return " ".join(parts)

    single = sequence("$A", 0)
    pair = f"{single} {sequence('$B', 1)}"
    specials = [(token, backend.token_to_id(token)) for token in (bos, eos) if token]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(specials))
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_of(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None
