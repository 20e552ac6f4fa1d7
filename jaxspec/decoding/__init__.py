"""Decoding: from tokenized requests to output tokens, each loop one compiled program.

generate        the public `jaxspec.generate`: validate, tokenize, bucket, dispatch, build Completions
prefill         the prompts through the target as a causal chain (chunked for Pallas), first token
autoregressive  plain decoding: one token per step in one `lax.while_loop`
speculative     draft -> one verify forward -> accept -> commit, repeated in one `lax.while_loop`
continuous      continuous batching: slots refilled from an on-device request bank
output_buffer   per-row output tokens (EOS / budget stops) and streaming of row 0

Decoding uses model/ (forward, KV cache), sampling/ (processors, keys, verification) and drafters/
(`make_drafter`); nothing below imports it.
"""
