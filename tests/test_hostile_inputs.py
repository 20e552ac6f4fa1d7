"""Hostile and careless input (issue 23): each probe must end in a clear jaxspec error, fast, with the
process alive and nothing lost. Chat templates, the batch job's files, request parameters, model files."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxspec.batch.job import main
from jaxspec.batch.output_file import OutputFileError, claim_output
from jaxspec.batch.results import is_result_record, open_results
from jaxspec.config import SamplingParams
from jaxspec.errors import InputError, ModelLoadError, TemplateError
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


# ---------------------------------------------------------------------------------------------------
# The batch job's files: it never truncates or rewrites a byte it did not write
# ---------------------------------------------------------------------------------------------------

HANG = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
TEMPLATE = (
    "{% for m in messages %}{% if m.content == 'hang' %}" + HANG + "{% endif %}{{ m.content }}{% endfor %}"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """Tiny random llama (vocabulary 320) with a 32-word tokenizer: most generated ids cannot be
    decoded, and its chat template hangs on the message "hang"."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from tests.tiny_models import save_tiny

    directory = tmp_path_factory.mktemp("tiny_hostile")
    save_tiny("llama", directory)
    words = ["<unk>", "<eos>", *(chr(c) for c in range(ord("a"), ord("z") + 1)), "hang", "hi"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<eos>", "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _write(path: Path, lines: list) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))
    return path


def _job(*args: str | Path) -> list[str]:
    return [str(a) for a in args]


def test_output_holding_a_users_file_is_refused_untouched(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1]}])
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my notes, no newline")
    assert main(_job("--input", src, "--output", notes, "--model", tmp_path / "none")) == 2
    assert "a jaxspec batch job did not write" in capsys.readouterr().err
    assert notes.read_bytes() == b"my notes, no newline"


@pytest.mark.parametrize("link", ["same path", "hard link", "symlink"])
@pytest.mark.parametrize("role", ["--output", "--errors"])
def test_output_or_errors_file_that_is_the_input_is_refused(tmp_path, capsys, role, link):
    src = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1]}, {"id": 2, "prompt_ids": [2]}])
    before = src.read_bytes()
    other = src if link == "same path" else tmp_path / "other.jsonl"
    if link == "hard link":
        os.link(src, other)
    elif link == "symlink":
        other.symlink_to(src)
    out = tmp_path / "out.jsonl" if role == "--errors" else other
    args = ["--input", src, "--output", out, "--model", tmp_path / "none", "--skip-invalid"]
    if role == "--errors":
        args += ["--errors", other]
    assert main(_job(*args)) == 2
    assert f"{role} must not be the --input file" in capsys.readouterr().err
    assert src.read_bytes() == before


def test_errors_file_that_is_the_output_is_refused(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1]}])
    out = tmp_path / "out.jsonl"
    args = ["--input", src, "--output", out, "--errors", out, "--skip-invalid", "--model", tmp_path / "x"]
    assert main(_job(*args)) == 2
    assert "--errors must not be the --output file" in capsys.readouterr().err


def test_errors_file_that_is_not_a_jaxspec_errors_file_is_refused_untouched(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1]}])
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"my notes\n")
    args = ["--input", src, "--output", tmp_path / "o.jsonl", "--errors", notes, "--skip-invalid"]
    assert main(_job(*args, "--model", tmp_path / "none")) == 2
    assert "is not an errors file of a jaxspec batch job" in capsys.readouterr().err
    assert notes.read_bytes() == b"my notes\n"


def test_a_second_job_on_a_locked_output_stops_with_a_clear_message(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1]}])
    out = tmp_path / "out.jsonl"
    writer, _, _ = open_results(out)  # the first job, still running
    with writer:
        assert main(_job("--input", src, "--output", out, "--model", tmp_path / "none")) == 2
        assert "another jaxspec job is writing this output" in capsys.readouterr().err
        # and the lock is taken again at the claim itself (two jobs passing the early check together)
        with pytest.raises(OutputFileError, match="another jaxspec job"):
            claim_output(out)


def test_an_incomplete_record_in_the_output_is_not_a_done_result(tmp_path, tiny_dir, capsys):
    src = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1], "max_new_tokens": 1}])
    out = tmp_path / "out.jsonl"
    writer, _, _ = open_results(out)
    with writer:
        line = b'{"id": 1}\n'
        writer.owned.begin_append(len(line))
        writer.write_raw(line)
        writer.owned.end_append(len(line))
    assert main(_job("--input", src, "--output", out, "--model", tiny_dir, "--no-progress")) == 2
    assert f"{out}:1: not a complete result record" in capsys.readouterr().err
    assert out.read_bytes() == b'{"id": 1}\n'


def test_bytes_appended_by_someone_else_are_refused_untouched(tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1]}])
    out = tmp_path / "out.jsonl"
    writer, _, _ = open_results(out)
    writer.close()
    with open(out, "ab") as f:
        f.write(b"someone else's partial line")
    assert main(_job("--input", src, "--output", out, "--model", tmp_path / "none")) == 2
    assert "changed outside jaxspec" in capsys.readouterr().err
    assert out.read_bytes() == b"someone else's partial line"


@pytest.mark.parametrize("case", ["folder", "parent is a file", "read-only folder"])
def test_unusable_output_paths_are_clear_errors(tmp_path, capsys, case):
    src = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [1]}])
    if case == "folder":
        out, message = tmp_path, "is a folder, not a file"
    elif case == "parent is a file":
        out, message = src / "out.jsonl", "is not a folder"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        out, message = locked / "out.jsonl", "permission denied"
    assert main(_job("--input", src, "--output", out, "--model", tmp_path / "none")) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------
# Bad lines, bad parameters, hostile templates, undecodable output: named, skipped, the rest finishes
# ---------------------------------------------------------------------------------------------------

HOSTILE_LINES = [
    ({"id": "ok", "prompt": "hi a b", "max_new_tokens": 2}, None),
    ({"id": "hang", "prompt": "hang"}, "time limit"),
    (b'{"id": "deep", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "JSON nested too deeply"),
    (b'{"id": 1' + b"0" * 5000 + b', "prompt_ids": [1]}', "unreadable JSON value"),
    (b'{"id": "bin", "prompt": "\xff"}', "not valid UTF-8 (byte 0xff at column 26)"),
    ({"id": "ids", "prompt_ids": [1, 2, 3], "max_new_tokens": 2}, None),
    ({"id": "seed", "prompt_ids": [1], "seed": 2**40}, "'seed' must be <= 2147483647, got 1099511627776"),
    ({"id": "tk", "prompt_ids": [1], "top_k": 2**40}, "'top_k' must be <= 2147483647, got 1099511627776"),
    ({"id": "mnt", "prompt_ids": [1], "max_new_tokens": 2.7}, "'max_new_tokens' must be an integer, got 2.7"),
]


def test_hostile_lines_are_named_by_line_and_skipped_the_rest_finishes(
    tmp_path, tiny_dir, capsys, monkeypatch
):
    monkeypatch.setenv("JAXSPEC_TEMPLATE_TIME_S", "0.3")
    src = _write(tmp_path / "in.jsonl", [line for line, _ in HOSTILE_LINES])
    out = tmp_path / "new" / "folder" / "out.jsonl"  # missing folders are created
    base = ["--input", src, "--output", out, "--model", tiny_dir, "--no-progress"]
    assert main(_job(*base)) == 2  # line checks stop the job before the model loads
    err = capsys.readouterr().err
    line_errors = [(n, m) for n, (_, m) in enumerate(HOSTILE_LINES, 1) if m and n != 2]
    lines = err.splitlines()
    assert len(lines) == len(line_errors)
    for text, (number, message) in zip(lines, line_errors, strict=True):
        assert text.startswith(f"{src}:{number}: ") and message in text
    assert not out.exists()

    start = time.monotonic()
    assert main(_job(*base, "--skip-invalid")) == 0
    assert time.monotonic() - start < 60
    err = capsys.readouterr().err
    errors = [json.loads(x) for x in Path(f"{out}.errors.jsonl").read_text().splitlines()]
    expected = [(n, m) for n, (_, m) in enumerate(HOSTILE_LINES, 1) if m]
    assert [e["line"] for e in errors] == [n for n, _ in expected]
    for error, (_, message) in zip(errors, expected, strict=True):
        assert message in error["error"]
    assert errors[0]["id"] == "hang" and str(tiny_dir) in errors[0]["error"]  # names the model
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(results) == {"ok", "ids"} and all(is_result_record(r) for r in results.values())
    undecodable = [r for r in results.values() if r["text"] is None]
    assert undecodable, "the 32-word tokenizer should fail on some of the tiny model's ids"
    for record in undecodable:  # tokens kept, the request named, the batch written
        assert "cannot decode the generated tokens" in record["error"] and record["token_ids"]
        assert f'request "{record["id"]}": cannot decode' in err
    before = out.read_bytes()
    assert main(_job(*base, "--skip-invalid")) == 0  # a rerun finds both done, writes nothing
    assert out.read_bytes() == before


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    import jaxspec

    return jaxspec.load(tiny_dir)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"seed": 2**31}, "seed for prompt 0 must be <= 2147483647, got 2147483648"),
        ({"seed": 2**40}, "seed for prompt 0 must be <= 2147483647, got 1099511627776"),
        ({"seed": -1}, "seed for prompt 0 must be >= 0, got -1"),
        ({"seed": [0, 1.5]}, "seed for prompt 1 must be an integer, got 1.5"),
        ({"max_new_tokens": 2.7}, "max_new_tokens for prompt 0 must be an integer, got 2.7"),
        ({"max_new_tokens": True}, "max_new_tokens for prompt 0 must be an integer, got True"),
        ({"request_ids": [1, 2**40]}, "request_ids for prompt 1 must be <= 2147483647"),
    ],
)
def test_generate_parameters_out_of_range_name_the_parameter(tiny_model, kwargs, message):
    import jaxspec

    with pytest.raises(InputError, match=re.escape(f"generate: {message}")):
        jaxspec.generate(tiny_model, [[1, 2], [3]], **kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"top_k": 2**40}, "SamplingParams.top_k must be an integer in [0, 2147483647], got 1099511627776"),
        ({"top_k": 2.5}, "SamplingParams.top_k must be an integer in [0, 2147483647], got 2.5"),
        ({"temperature": float("inf")}, "SamplingParams.temperature must be a finite number >= 0, got inf"),
        ({"top_p": float("nan")}, "SamplingParams.top_p must be in (0, 1], got nan"),
    ],
)
def test_sampling_parameters_out_of_range_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_cli_seed_and_top_k_out_of_range_are_clear_errors(tiny_dir, capsys):
    from jaxspec.cli import main as cli_main

    base = ["generate", "--prompt", "a b", "--model", str(tiny_dir), "--max-new-tokens", "1", "--no-chat"]
    assert cli_main([*base, "--top-k", str(2**40)]) == 2
    assert "SamplingParams.top_k must be an integer in [0, 2147483647]" in capsys.readouterr().err
    assert cli_main([*base, "--seed", str(2**40)]) == 2
    assert "seed for prompt 0 must be <= 2147483647, got 1099511627776" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# Model files: config.json range/type checks naming the file, NaN/Inf weights, tensors of extra layers
# ---------------------------------------------------------------------------------------------------


def _model_copy(tiny_dir: Path, directory: Path, **config_changes) -> Path:
    directory.mkdir()
    config = json.loads((tiny_dir / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **config_changes}))
    (directory / "model.safetensors").symlink_to(tiny_dir / "model.safetensors")
    return directory


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"num_hidden_layers": -1}, "num_hidden_layers must be an integer >= 1, got -1"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1, got 0"),
        ({"num_hidden_layers": 1.5}, "field 'num_hidden_layers' must be an integer, got 1.5"),
        ({"num_hidden_layers": 1}, "belongs to layer 1 but config.json's num_hidden_layers is 1"),
        ({"max_position_embeddings": -1}, "max_position_embeddings must be an integer >= 1, got -1"),
        ({"hidden_size": "abc"}, "field 'hidden_size' must be an integer, got \"abc\""),
        ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
        ({"rms_norm_eps": "x"}, "field 'rms_norm_eps' must be a number, got \"x\""),
        ({"rope_theta": -1}, "rope_theta must be a finite number > 0, got -1.0"),
    ],
)
def test_bad_config_fields_are_load_errors_naming_the_file(tmp_path, tiny_dir, changes, message):
    import jaxspec

    directory = _model_copy(tiny_dir, tmp_path / "model", **changes)
    with pytest.raises(ModelLoadError, match=re.escape(message)) as caught:
        jaxspec.load(directory)
    assert str(directory) in str(caught.value)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_safetensors_weight_is_refused_by_name(tmp_path, tiny_dir, bad):
    from safetensors.numpy import load_file, save_file

    import jaxspec

    tensors = {name: array.copy() for name, array in load_file(tiny_dir / "model.safetensors").items()}
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text((tiny_dir / "config.json").read_text())
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' has 1 NaN/Inf"
    ):
        jaxspec.load(directory)


def test_garbage_inside_gguf_tensor_data_is_refused_by_name(tmp_path, tiny_dir):
    import gguf
    import jax.numpy as jnp

    from jaxspec.loading.gguf_reader import read_gguf
    from jaxspec.loading.hf_dir import read_hf_dir
    from jaxspec.loading.weights import state_from_hf_tensors
    from tests.test_loading import write_gguf

    path = tmp_path / "tiny.gguf"
    config, tensors = read_hf_dir(tiny_dir)
    write_gguf(path, "llama", config, tensors)
    target = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    with open(path, "r+b") as f:  # garbage bytes over the tensor's data (0xFF.. is a float32 NaN)
        f.seek(int(target.data_offset))
        f.write(b"\xff" * int(target.n_bytes))
    config, tensors, _ = read_gguf(path)
    with pytest.raises(ModelLoadError, match=rf"{path}: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has"):
        state_from_hf_tensors(config, tensors, jnp.float32, source=str(path))


# ---------------------------------------------------------------------------------------------------
# Head checkpoints: short clear errors, not library internals
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content,message",
    [
        (b"garbage", "Unsupported operand"),
        ("list", "not a PyTorch state dict of tensors (got list)"),
        ("ints", "not a PyTorch state dict of tensors (got dict)"),
    ],
)
def test_malformed_torch_checkpoint_is_a_short_load_error(tmp_path, content, message):
    import torch

    from jaxspec.loading.checkpoint_io import read_tensors

    file = tmp_path / "pytorch_model.bin"
    if isinstance(content, bytes):
        file.write_bytes(content)
    else:
        torch.save([torch.zeros(2)] if content == "list" else {"w": 3}, file)
    with pytest.raises(ModelLoadError, match=re.escape(message)) as caught:
        read_tensors([file])
    assert "weights_only" not in str(caught.value) and len(str(caught.value)) < 500


def test_head_checkpoint_with_a_deleted_chunk_is_a_short_load_error(tmp_path):
    import shutil

    from jaxspec.drafters.heads.orbax_io import load_own_head

    head = tmp_path / "medusa"
    shutil.copytree(Path(__file__).parent.parent / "configs/heads/smollm2-135m/medusa", head)
    chunks = sorted((head / "params").rglob("d/*"), key=lambda p: p.stat().st_size)
    chunks[-1].unlink()
    with pytest.raises(ModelLoadError, match="cannot restore head parameters") as caught:
        load_own_head(head)
    assert "incomplete or corrupt" in str(caught.value) and len(str(caught.value)) < 500
