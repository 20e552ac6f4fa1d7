"""Decoding loops: generate, prefill, autoregressive and speculative loops, output buffer."""
