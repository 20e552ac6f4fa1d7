"""Draft heads: Medusa, EAGLE-1/2, EAGLE-3 and MTP modules, their loaders and jaxspec's own checkpoints.

Modules are Flax NNX, split once and run functionally; the drafters that run them inside the engine's
compiled round live in jaxspec/spec (medusa_drafter.py, eagle_drafter.py, mtp_drafter.py).

Entry points:
  registry.make_head_drafter(model, spec) -> (drafter, draft_params)   what the engine calls
  head.init_head(config, dtype, seed) / head.abstract_head(config, dtype)
  loaders.load_head(path, method, target_config, dtype, extra)        published layouts + own format
  orbax_io.save_head(head, directory) / orbax_io.load_own_head(directory)
  pure functions for trainers: medusa.medusa_logits, eagle.eagle_sequence_forward,
    mtp.mtp_module_forward / mtp.mtp_sequence_forward, and the modules' own methods
    (embed, project_target_features, __call__, logits, draft_logits)
  timing.draft_step_fn(model, spec) / timing.time_draft_and_target(model, spec)
"""

from jaxspec.drafters.heads.configs import Eagle3Config, EagleConfig, MedusaConfig, MtpConfig
from jaxspec.drafters.heads.head import DraftHead, init_head

__all__ = ["DraftHead", "Eagle3Config", "EagleConfig", "MedusaConfig", "MtpConfig", "init_head"]
