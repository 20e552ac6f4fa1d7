"""Draft heads: Medusa, EAGLE-1/2, EAGLE-3 and MTP, one subpackage per family, and jaxspec's own checkpoints.

Modules are Flax NNX, split once and run functionally inside the engine's compiled round.

medusa/    module.py (Medusa heads), drafter.py (MedusaDrafter: static trees), loader.py (FasterDecoding)
eagle/     eagle.py (EAGLE-1/2), eagle3.py (EAGLE-3), drafter.py (EagleDrafter, both versions: chains and
           EAGLE-2 dynamic trees), loader.py (SafeAILab / SpecForge layouts)
mtp/       module.py (MiMo-style MtpModule, DeepSeek-V3's DeepseekMtpModule), drafter.py (MtpDrafter),
           loader.py (MTP layers in a target checkpoint: MiMo, DeepSeek-V3)
configs    the frozen head configs (the method names: jaxspec.config.HEAD_METHODS)
layers     what the attention-based heads share: AttentionInputs (their attention step), VocabMap,
           rope; their decoder layer is `jaxspec.model.llama.DecoderLayer` (layout "split")
head       DraftHead (config + graphdef + params), init_head / abstract_head
drafting   what every head drafter shares: draft distributions, chain and dynamic-tree loops, the hook
loaders    load_head(path, method, target_config, dtype, extra): published layouts + own format;
           published.py holds the pieces the family loaders share
orbax_io   jaxspec's own head checkpoints (jaxspec_head.json + Orbax params)
shipped    the heads shipped in configs/heads, resolve_head
registry   make_head_drafter(model, spec) -> (drafter, draft_params): what `drafters.make` calls

Pure functions for trainers: medusa.module.medusa_logits, eagle.eagle.eagle_sequence_forward,
mtp.module.mtp_module_forward / mtp_sequence_forward, and the modules' own methods (embed,
project_target_features, __call__, logits, draft_logits).
"""

from jaxspec.drafters.heads.configs import Eagle3Config, EagleConfig, MedusaConfig, MtpConfig
from jaxspec.drafters.heads.head import DraftHead, init_head

__all__ = ["DraftHead", "Eagle3Config", "EagleConfig", "MedusaConfig", "MtpConfig", "init_head"]
