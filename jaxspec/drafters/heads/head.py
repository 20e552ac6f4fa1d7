"""A draft head = its config + NNX graph (split once) + parameters; seeded random initialisation.

For MTP the graph is that of ONE module and the parameters are stacked [num_modules, ...]
(`jaxspec.drafters.heads.mtp.module`); for the other heads graph and parameters come from one `nnx.split`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.drafters.heads.configs import Eagle3Config, EagleConfig, HeadConfig, MedusaConfig, MtpConfig
from jaxspec.drafters.heads.eagle.eagle import init_eagle
from jaxspec.drafters.heads.eagle.eagle3 import init_eagle3
from jaxspec.drafters.heads.medusa.module import init_medusa
from jaxspec.drafters.heads.mtp.module import init_mtp


@dataclasses.dataclass(frozen=True, eq=False)
class DraftHead:
    config: HeadConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    source: str = "<random>"


def init_head(config: HeadConfig, dtype: jnp.dtype = jnp.float32, seed: int = 0) -> DraftHead:
    """A randomly initialised head (normal(0.02) weights, unit norms), reproducible from `seed`."""
    if isinstance(config, MedusaConfig):
        graphdef, params = init_medusa(config, dtype, seed)
    elif isinstance(config, EagleConfig):
        graphdef, params = init_eagle(config, dtype, seed)
    elif isinstance(config, Eagle3Config):
        graphdef, params = init_eagle3(config, dtype, seed)
    elif isinstance(config, MtpConfig):
        graphdef, params = init_mtp(config, dtype, seed)
    else:
        raise TypeError(f"init_head: unknown head config {config!r}")
    return DraftHead(config=config, graphdef=graphdef, params=params, source=f"<random seed={seed}>")


def abstract_head(config: HeadConfig, dtype: jnp.dtype = jnp.float32) -> DraftHead:
    """The head's graph and shape-only parameters (jax.ShapeDtypeStruct leaves); nothing allocated."""
    graphdefs = []

    def build() -> nnx.State:
        head = init_head(config, dtype, 0)
        graphdefs.append(head.graphdef)
        return head.params

    params = jax.eval_shape(build)
    return DraftHead(config=config, graphdef=graphdefs[0], params=params, source="<abstract>")
