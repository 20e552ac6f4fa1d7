"""The target model: what one forward of the target computes, and the state it keeps.

config          ModelConfig (frozen, hashable: a static argument of every compiled step)
llama           the Llama-family decoder as Flax NNX modules: RMSNorm, Projection, Attention, MLP and
                DecoderLayer (the target's and every draft head's: layout "fused" or "split"), LlamaModel
rope            rotary embedding (Llama-3 scaling)
kv_cache        KVCache (pytree: per-layer buffers + committed lengths, `commit_path` of the accepted
                path) and HeadCache (a draft head's committed keys/values)
forward         pure forward functions over (graphdef, params): model_forward, lm_logits, masks, the
                attention implementation (jnp reference or Pallas kernel, per shard on a mesh)
live_attention  decode and verify attention reading only the live part of a padded cache (CPU reference)
buckets         batch / length buckets: similar calls reuse one compiled program
target          Model: graphdef + params + tokenizer + config, what `jaxspec.load` returns
deepseek_v3/    DeepSeek-V3-family targets (MLA + mixture of experts)

Imports point down only: model/ imports nothing above it (sharding.py for per-shard attention).
"""
