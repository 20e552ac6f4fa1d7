"""Rotary position embedding (Hugging Face "rotate half" layout), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, Llama-3 scaled when config.rope_scaling is set."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if config.rope_scaling is not None:
        factor, low_freq_factor, high_freq_factor, original_max = config.rope_scaling
        low_freq_wavelen = original_max / low_freq_factor
        high_freq_wavelen = original_max / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions [B, N] int -> cos, sin [B, N, head_dim] float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, N, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, H, N, D]; cos/sin [B, N, D] -> rotated x (same dtype)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    out = xf * cos[:, None] + rotated.astype(jnp.float32) * sin[:, None]
    return out.astype(x.dtype)
