"""KV-cache bytes per token of a DeepSeek-V3-family config: MLA's latent + rope key vs full K/V.

    python scripts/mla_cache_bytes.py [configs/deepseek_v3_config.json] [--bytes 2]

Reads the config.json with jaxspec's own reader (`jaxspec.model.deepseek_v3.config`) and prints the
bytes per token summed over the decoder layers (the MTP layer's own cache is one more layer).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxspec.model.deepseek_v3.config import kv_cache_bytes_per_token, read_deepseek_config

DEFAULT = Path(__file__).resolve().parents[1] / "configs" / "deepseek_v3_config.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(DEFAULT), help="a config.json or its directory")
    parser.add_argument("--bytes", type=int, default=2, help="bytes per cached element (2: bfloat16)")
    args = parser.parse_args()
    config = read_deepseek_config(Path(args.config))
    sizes = kv_cache_bytes_per_token(config, args.bytes)
    per_layer_mla = config.kv_lora_rank + config.qk_rope_head_dim
    per_layer_full = config.num_heads * (config.qk_head_dim + config.v_head_dim)
    print(f"{args.config}: {config.num_layers} layers, {args.bytes} bytes per element")
    mla, full = sizes["mla"], sizes["full_kv"]
    print(f"  MLA cache (latent {config.kv_lora_rank} + rope key {config.qk_rope_head_dim} per layer):")
    print(f"    {per_layer_mla} elements/layer, {mla:,} bytes/token ({mla / 1024:.1f} KiB)")
    print(f"  full K/V ({config.num_heads} heads x (K {config.qk_head_dim} + V {config.v_head_dim})):")
    print(f"    {per_layer_full} elements/layer, {full:,} bytes/token ({full / 2**20:.2f} MiB)")
    print(f"  ratio: {full / mla:.1f}x")


if __name__ == "__main__":
    main()
