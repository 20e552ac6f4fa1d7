"""A real two-process run: two Python processes on localhost, 4 CPU devices each, joined by
`jax.distributed.initialize` over a loopback coordinator into one 8-device (2 x 4) mesh, generate the
same tokens as one process on one device."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import save_tiny
from tests.xla_flags import xla_flags

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "scripts" / "multihost_demo.py"
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 40, 41, 42, 40, 41], [9, 200, 31, 9, 200, 31, 9]]
MAX_NEW = 10


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_processes(tmp_path: Path, model_dir: Path, spec: str, extra: list[str]) -> list[dict]:
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    port = free_port()
    env = dict(os.environ, XLA_FLAGS=xla_flags())  # not the parent's 8 fake devices
    env["JAX_PLATFORMS"] = "cpu"
    procs, outputs = [], []
    for i in range(2):
        out = tmp_path / f"{spec}_{i}.json"
        outputs.append(out)
        cmd = [
            sys.executable, str(DEMO), "--model", str(model_dir), "--mesh", "2x4", "--cpu-devices", "4",
            "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
            "--spec", spec, "--max-new-tokens", str(MAX_NEW), "--prompts-json", str(prompts_file),
            "--output", str(out), *extra,
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=900)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][-4000:]}"
    return [json.loads(out.read_text()) for out in outputs]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    import jaxspec

    model_dir = tmp_path / "tiny"
    save_tiny("llama", model_dir, num_attention_heads=8, num_key_value_heads=8)
    results = run_two_processes(tmp_path, model_dir, "ngram", ["--num-speculative-tokens", "3"])

    single = jaxspec.load(str(model_dir))  # one process, one device, no mesh
    spec = jaxspec.SpecConfig(method="ngram", num_speculative_tokens=3)
    expected = [c.token_ids for c in jaxspec.generate(single, PROMPTS, max_new_tokens=MAX_NEW, spec=spec)]

    assert [r["process_index"] for r in results] == [0, 1]
    for r in results:
        assert r["process_count"] == 2
        assert r["device_count"] == 8 and r["local_device_count"] == 4
        assert r["mesh"] == {"data": 2, "model": 4}
        assert r["tokens"] == expected
    assert all(len(t) == MAX_NEW for t in expected)
