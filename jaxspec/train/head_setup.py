"""Fresh heads to train: configs for a target, EAGLE-3's draft vocabulary from the training data."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.models.heads.configs import (
    Eagle3Config,
    EagleConfig,
    HeadConfig,
    MedusaConfig,
    MtpConfig,
    default_eagle3_layers,
    head_layer_config,
)
from jaxspec.models.heads.head import DraftHead, init_head


def draft_vocabulary(rows: Sequence[dict], vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent target tokens of the responses (ties and the remainder filled by the
    prompts' tokens, then by the lowest ids), sorted ascending: the EAGLE-3 draft vocabulary."""
    size = min(size, vocab_size)
    response = np.zeros((vocab_size,), np.int64)
    prompt = np.zeros((vocab_size,), np.int64)
    for row in rows:
        np.add.at(response, np.asarray(row["response_ids"], np.int64), 1)
        np.add.at(prompt, np.asarray(row["prompt_ids"], np.int64), 1)
    # Lexicographic priority: response count, then prompt count, then lower id.
    order = np.lexsort((np.arange(vocab_size), -prompt, -response))
    return np.sort(order[:size])


def head_config_for(
    method: str, target: ModelConfig, *, depth: int, draft_vocab_size: int = 8192, medusa_layers: int = 1,
    mtp_modules: int = 1, eagle3_layers: tuple[int, ...] | None = None,
) -> HeadConfig:  # fmt: skip
    """A head config for `target`; Medusa shares the target's LM head (trains in minutes on a CPU)."""
    layer = head_layer_config(target)
    if method == "medusa":
        return MedusaConfig(
            num_heads=depth, num_layers=medusa_layers, hidden_size=target.hidden_size,
            vocab_size=target.vocab_size, own_lm_head=False,
        )  # fmt: skip
    if method == "eagle":
        return EagleConfig(layer=layer)
    if method == "eagle3":
        return Eagle3Config(
            layer=layer, target_hidden_size=target.hidden_size,
            draft_vocab_size=min(draft_vocab_size, target.vocab_size),
            target_layers=tuple(eagle3_layers or default_eagle3_layers(target.num_layers)),
        )  # fmt: skip
    if method == "mtp":
        return MtpConfig(layer=layer, num_modules=mtp_modules)
    raise ValueError(f"unknown head method {method!r}")


def new_head(
    config: HeadConfig, *, seed: int = 0, draft_ids: np.ndarray | None = None,
    dtype=jnp.float32,
) -> DraftHead:  # fmt: skip
    """A randomly initialised head; EAGLE-3 gets `draft_ids` as its vocabulary."""
    if isinstance(config, Eagle3Config):
        from jaxspec.models.heads.eagle3 import init_eagle3

        graphdef, params = init_eagle3(config, dtype, seed, draft_ids)
        return DraftHead(config=config, graphdef=graphdef, params=params, source=f"<random seed={seed}>")
    return init_head(config, dtype, seed)
