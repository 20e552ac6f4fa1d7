"""The target model: config, Llama decoder, rope, KV cache, forward pass, DeepSeek-V3."""
