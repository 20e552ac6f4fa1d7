"""Tree-masked attention for speculative verification: jnp reference, Pallas TPU and GPU kernels."""

from pallas_kernels.dispatch import tree_attention
from pallas_kernels.gpu import tree_attention_gpu
from pallas_kernels.reference import tree_attention_reference
from pallas_kernels.tpu import tree_attention_tpu

__all__ = ["tree_attention", "tree_attention_gpu", "tree_attention_reference", "tree_attention_tpu"]
