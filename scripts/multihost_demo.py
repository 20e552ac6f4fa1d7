"""Sharded (and multi-host) speculative generation: the same script on one machine or on a pod.

Every process runs this script with the same arguments (only its process id differs). It joins the
job (`jax.distributed.initialize`), builds one global (data x model) mesh over all devices of all
processes, loads the model directly as sharded arrays, generates, and (process 0, or every process
with --output) writes the tokens. "model" should fit inside one host (tensor parallelism over the
fast interconnect); "data" spans hosts.

One machine, 8 devices, no distribution:
    python scripts/multihost_demo.py --mesh 2x4 --spec ngram

Two processes on one CPU machine (what tests/test_multihost.py runs), 4 CPU devices each:
    python scripts/multihost_demo.py --cpu-devices 4 --coordinator-address 127.0.0.1:12345 \
        --num-processes 2 --process-id 0 --mesh 2x4 &
    python scripts/multihost_demo.py --cpu-devices 4 --coordinator-address 127.0.0.1:12345 \
        --num-processes 2 --process-id 1 --mesh 2x4

Cloud TPU pod slice (e.g. v5e-32: 8 hosts x 4 chips). JAX finds the coordinator itself (--auto):
    gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all \
        --command "cd jaxspec && python scripts/multihost_demo.py --auto --mesh 8x4 --spec ngram"

Multi-node GPU (e.g. 2 nodes x 8 GPUs). Under SLURM, `srun` sets everything (--auto):
    srun --nodes 2 --ntasks-per-node 1 --gpus-per-node 8 \
        python scripts/multihost_demo.py --auto --mesh 2x8 --spec ngram
Without a cluster manager, give every node the coordinator (node 0) and its own id, by flags or by
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID:
    JAX_COORDINATOR_ADDRESS=10.0.0.1:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=$NODE_RANK \
        python scripts/multihost_demo.py --mesh 2x8 --spec ngram
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxspec.distributed import add_distributed_flags, initialize_from_args  # noqa: E402

DEFAULT_PROMPTS = (
    "List three prime numbers and explain why each is prime.",
    "Write a haiku about the sea.",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model name, .gguf file or HF directory")
    p.add_argument("--mesh", default=None, help="DATAxMODEL, e.g. 2x4 (default: 1 x all devices)")
    p.add_argument("--spec", default="ngram", help="speculative method, or 'none' for autoregressive")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-num-layers", type=int, default=None, help="draft_model: layers kept")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts-json", default=None, help="JSON list of prompts (strings or token-id lists)")
    p.add_argument("--output", default=None, help="write {'tokens': ..., ...} JSON here (every process)")
    p.add_argument("--cpu-devices", type=int, default=None, help="CPU only: host devices per process")
    p.add_argument("--auto", action="store_true", help="let JAX detect the cluster (TPU pod, SLURM...)")
    add_distributed_flags(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Before any other JAX work: join the job (and set CPU device count / collectives).
    initialize_from_args(args, cpu_devices_per_process=args.cpu_devices, auto=args.auto)

    import jax

    import jaxspec
    from jaxspec.sharding import make_mesh, parse_mesh_shape

    data, model_axis = parse_mesh_shape(args.mesh) if args.mesh else (1, jax.device_count())
    mesh = make_mesh(data, model_axis)
    model = jaxspec.load(args.model, mesh=mesh)
    prompts = json.loads(Path(args.prompts_json).read_text()) if args.prompts_json else list(DEFAULT_PROMPTS)
    spec = None
    if args.spec != "none":
        spec = jaxspec.SpecConfig(
            method=args.spec,
            num_speculative_tokens=args.num_speculative_tokens,
            draft_num_layers=args.draft_num_layers,
        )
    completions = jaxspec.generate(
        model,
        prompts,
        max_new_tokens=args.max_new_tokens,
        sampling=jaxspec.SamplingParams(temperature=args.temperature),
        seed=args.seed,
        spec=spec,
    )
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "mesh": dict(mesh.shape),
        "tokens": [c.token_ids for c in completions],
    }
    if args.output:
        Path(args.output).write_text(json.dumps(result))
    if jax.process_index() == 0:
        for c in completions:
            print(json.dumps({"text": c.text, "token_ids": c.token_ids, "stats": c.stats}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
