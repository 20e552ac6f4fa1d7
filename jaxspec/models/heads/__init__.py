"""Draft heads: Medusa, EAGLE-1/2, EAGLE-3 and MTP modules, their loaders and jaxspec's own checkpoints.

Modules are Flax NNX, split once and run functionally; the drafters that run them inside the engine's
compiled round live in jaxspec/spec (medusa_drafter.py, eagle_drafter.py, mtp_drafter.py).
"""

from jaxspec.models.heads.configs import Eagle3Config, EagleConfig, MedusaConfig, MtpConfig
from jaxspec.models.heads.head import DraftHead, init_head

__all__ = ["DraftHead", "Eagle3Config", "EagleConfig", "MedusaConfig", "MtpConfig", "init_head"]
