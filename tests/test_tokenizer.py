"""Tokenizer and chat template: parity with transformers on the same files, sandbox, input checks."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from jaxspec.errors import InputError, JaxspecError, TemplateError
from jaxspec.loading import Tokenizer, read_gguf_metadata, render_chat_template, resolve_model_path

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "   three leading spaces and trailing   ",
    "tabs\there\t\tand\tthere",
    "line one\nline two\n\n\nline five\n",
    "Windows\r\nline\r\nendings",
    "digits 1234567890, 3.14159 and 2024-06-01; x12y 007",
    "Émigré café naïve façade über straße",
    "日本語のテキストです。中文测试，한국어 텍스트",
    "emoji 😀👍🏽🇫🇷👨‍👩‍👧 mixed",
    "def f(x):\n    return {'a': x ** 2}  # comment\n",
    '<html><body class="x">&amp; &lt;tag&gt;</body></html>',
    "I'm sure they'll say we've done it, WE'VE DONE IT",
    "Καλημέρα κόσμε — Привет, мир! مرحبا",
    "a",
    " ",
    "\n",
    "                                                  many spaces",
    "<|im_start|>user\nspecial tokens inline<|im_end|><|endoftext|>",
    "null\u0000byte and \u200bzero width",
]

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Write a haiku about JAX.\nMake it 🌸 pretty."}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?  "},
    ],
]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="module")
def ours(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf_metadata(smollm2_path), source=str(smollm2_path))


@pytest.fixture(scope="module")
def theirs(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


def _ids(encoding) -> list[int]:
    return list(encoding["input_ids"] if not isinstance(encoding, list) else encoding)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs(text)["input_ids"]
    assert ids == theirs.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)


def test_special_tokens_and_sizes(ours, theirs):
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    assert ours.encode("<|im_end|>") == [2]  # whole, not cut into pieces
    ids = ours.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert ours.decode(ids) == "assistant\nHi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi<|im_end|>"
    assert ours.encode("Hello")[0] != ours.bos_token_id  # SmolLM2 adds no BOS


def test_numbers_split_one_character_at_a_time_like_llama_cpp(ours, theirs):
    """SmolLM2 (tokenizer.ggml.pre = "smollm") isolates every numeric character before BPE, as
    llama.cpp and the original tokenizer.json do. transformers' GGUF conversion skips that split;
    the two only disagree on numerals outside 0-9 that would otherwise merge with a space."""
    text = "about ½ or ² or ① items"
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    pieces = ["about ", "½", " or ", "²", " or ", "①", " items"]
    assert ids == [i for piece in pieces for i in theirs.encode(piece)]
    assert ours.encode(" 123") == theirs.encode(" 123") == theirs.encode(" ") + [33, 34, 35]


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_ids_match_transformers(ours, theirs, conversation):
    messages = CONVERSATIONS[conversation]
    ids = ours.apply_chat_template(messages, add_generation_prompt=True)
    reference = _ids(theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert ids == reference
    assert ours.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    without_prompt = ours.apply_chat_template(messages, add_generation_prompt=False)
    assert without_prompt == _ids(
        theirs.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    )
    assert ids[: len(without_prompt)] == without_prompt and len(ids) > len(without_prompt)


def test_from_dir_matches_transformers_saved_tokenizer(tmp_path, theirs):
    theirs.save_pretrained(tmp_path)
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.chat_template is not None and "<|im_start|>" in loaded.chat_template
    assert loaded.eos_token_ids == (2,)
    for text in [*TEXTS, "about ½ or ² or ① items"]:
        assert loaded.encode(text) == theirs.encode(text), text
        assert loaded.decode(loaded.encode(text)) == theirs.decode(
            theirs.encode(text), skip_special_tokens=True
        )
    for messages in CONVERSATIONS:
        expected = _ids(theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        assert loaded.apply_chat_template(messages) == expected


def write_sentencepiece_gguf(path: Path) -> None:
    """A tiny llama.cpp "llama" (SentencePiece) vocabulary: scores, byte-fallback tokens, no merges."""
    pieces = ["▁", "e", "l", "o", "h", "w", "r", "d", "a", "t", "n", "▁t", "he", "▁the", "ll", "llo", "▁h"]
    pieces += ["▁he", "▁hello", "or", "▁w", "▁wor", "ld", "▁world", "an", "▁an", "▁and", "▁▁", "in", "▁in"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + pieces
    token_types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(rank) for rank in range(len(pieces))]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    write_sentencepiece_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_gguf(read_gguf_metadata(tmp_path / "spm.gguf"))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
    for text in ["hello world", "the and in", "  hello  world ", "héllo wörld", "xyz\n", "", "<s>hi</s>"]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ids[0] == 1  # SentencePiece Llama files add BOS
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode("hello world") == [1, 277, 282]  # "▁hello", "▁world" merged whole
    assert ours.decode(ours.encode("héllo")) == "héllo"  # é through byte fallback


# --- chat template sandbox and message validation ------------------------------------------------

MALICIOUS_TEMPLATES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{% set ns = namespace(_secret=1) %}{{ ns._secret }}",
    "{{ 'x' * 100000000 }}",
    "{% for m in messages %}{{ m.items.__self__.__class__ }}{% endfor %}",
]


@pytest.mark.parametrize("template", MALICIOUS_TEMPLATES)
def test_template_escaping_the_sandbox_is_a_template_error(template):
    with pytest.raises(TemplateError, match="sandbox|unsafe|underscore|longer|over"):
        render_chat_template(
            template,
            [{"role": "user", "content": "hi"}],
            add_generation_prompt=True,
            bos_token="",
            eos_token="",
        )


def test_template_errors_name_the_problem():
    message = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError, match="roles must alternate"):
        render_chat_template(
            "{{ raise_exception('roles must alternate') }}",
            message,
            add_generation_prompt=True,
            bos_token="",
            eos_token="",
        )
    with pytest.raises(TemplateError, match="syntax error at line 2"):
        render_chat_template("ok\n{% for %}", message, add_generation_prompt=True, bos_token="", eos_token="")


def test_template_features_transformers_templates_use():
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.role }}:{{ m.content | tojson }}{% endgeneration %}\n"
        "{% endfor %}{{ ns.n }}{{ extra_flag }}{% if add_generation_prompt %}>{% endif %}{{ eos_token }}"
    )
    messages = [{"role": "user", "content": 'é"x'}, {"role": "skip", "content": ""}]
    text = render_chat_template(
        template, messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>", extra_flag="!"
    )
    assert text == '<s>user:"é\\"x"2!></s>'  # trim_blocks ate the newline after endgeneration


@pytest.mark.parametrize(
    "messages,fragment",
    [
        ("hello", "list"),
        ([{"role": "user", "content": "ok"}, "oops"], r"messages\[1\]"),
        ([{"content": "no role"}], r"messages\[0\].*'role'"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\['content'\].*int"),
        ([{"role": None, "content": "x"}], r"messages\[0\]\['role'\]"),
    ],
)
def test_bad_messages_are_input_errors(ours, messages, fragment):
    with pytest.raises(InputError, match=fragment):
        ours.apply_chat_template(messages)


def test_tokenizer_input_errors(ours):
    with pytest.raises(InputError, match="str"):
        ours.encode(b"bytes")
    with pytest.raises(InputError, match="position 1"):
        ours.decode([5, 49152])
    with pytest.raises(InputError, match="position 0"):
        ours.decode([-1])
    no_template = Tokenizer(ours.backend, bos_token=None, eos_tokens=[], chat_template=None, source="t")
    with pytest.raises(TemplateError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])
    assert issubclass(InputError, JaxspecError) and issubclass(TemplateError, JaxspecError)
