"""DeepseekV3Config: the architecture of a DeepSeek-V3-family target, read from a Hugging Face
config.json (DeepSeek-V3 / R1 field names).

It is a `ModelConfig` (same loading, cache, forward and sharding machinery) whose extra fields describe
MLA and the mixture of experts. The inherited fields mean: num_heads = query heads, num_kv_heads = the
same (each head has its own key/value after the latent is expanded; shardings split heads over
"model"), head_dim = v_head_dim (the width of one head in o_proj's input), intermediate_size = the
dense layers' MLP width. The KV cache holds per layer the compressed latent [B, 1, S, kv_lora_rank]
(`KVCache.keys`) and the shared rope key [B, 1, S, qk_rope_head_dim] (`KVCache.values`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from jaxspec.errors import ModelLoadError
from jaxspec.model.config import ModelConfig

MODEL_TYPES = ("deepseek_v3",)

# config.json fields that change nothing jaxspec computes (training settings, bookkeeping).
_IGNORED_FIELDS = frozenset(
    {
        "architectures", "auto_map", "aux_loss_alpha", "seq_aux", "initializer_range", "torch_dtype", "dtype",
        "transformers_version", "use_cache", "attention_dropout", "ep_size", "pretraining_tp",
        "pad_token_id", "output_router_logits", "_name_or_path", "model_type", "qk_head_dim", "head_dim",
        "num_mtp_layers", "router_aux_loss_coef", "tokenizer_class",
    }
)  # fmt: skip
# Fields read into DeepseekV3Config (values checked below).
_READ_FIELDS = frozenset(
    {
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
        "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
        "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
        "norm_topk_prob", "hidden_act", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
        "eos_token_id", "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
        "rope_interleave", "attention_bias", "num_nextn_predict_layers", "scoring_func", "topk_method",
        "moe_layer_freq", "quantization_config",
    }
)  # fmt: skip


_POSITIVE_FIELDS = (
    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
)  # fmt: skip
# Fields whose only supported value is fixed.
_FIXED_FIELDS = {
    "hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
    "attention_bias": False,
}  # fmt: skip


@dataclass(frozen=True)
class DeepseekV3Config(ModelConfig):
    """MLA + MoE dimensions on top of `ModelConfig` (see the module docstring for the shared fields).

    yarn: (factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim) of
    YaRN rope scaling over the rope part, or None (plain rope).
    """

    # MLA layers always run their jnp absorbed form (no Pallas latent-attention kernel yet).
    attention_impls: ClassVar[tuple[str, ...]] = ("auto", "reference")
    moe_intermediate_size: int = 1
    n_routed_experts: int = 1
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 1
    qk_nope_head_dim: int = 1
    qk_rope_head_dim: int = 2
    v_head_dim: int = 1
    rope_interleave: bool = True
    yarn: tuple[float, int, float, float, float, float] | None = None
    num_nextn_predict_layers: int = 0
    architecture: str = "deepseek_v3"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in _POSITIVE_FIELDS:
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group")
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2 and self.n_group > 1:
            raise ValueError("n_group leaves fewer than 2 experts per group (group scores sum the top 2)")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}]")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of topk_group groups"
            )
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be >= 1 or null, got {self.q_lora_rank}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(
                f"first_k_dense_replace must be in [0, num_hidden_layers], got {self.first_k_dense_replace}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """MLA caches the latent [B, 1, S, kv_lora_rank] and the rope key [B, 1, S, qk_rope_head_dim]."""
        return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)

    def is_moe_layer(self, index: int) -> bool:
        """Layers from first_k_dense_replace on (and the MTP layers after them) use the MoE."""
        return index >= self.first_k_dense_replace


def kv_cache_bytes_per_token(config: DeepseekV3Config, bytes_per_element: int = 2) -> dict[str, int]:
    """Per token, summed over the decoder layers: the MLA cache (latent + rope key) and the full K/V a
    plain multi-head cache of the same attention would hold (K: qk_head_dim, V: v_head_dim per head)."""
    mla = config.kv_lora_rank + config.qk_rope_head_dim
    full = config.num_heads * (config.qk_head_dim + config.v_head_dim)
    return {
        "mla": config.num_layers * mla * bytes_per_element,
        "full_kv": config.num_layers * full * bytes_per_element,
    }


def is_deepseek_dir(directory: Path) -> bool:
    """True when `directory/config.json` names a DeepSeek-V3-family model_type."""
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("model_type") in MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def _yarn(raw: dict[str, Any], where: str) -> tuple[float, tuple | None]:
    """(rope_theta, yarn tuple or None) from `rope_scaling` (4.x) or `rope_parameters` (5.x)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ModelLoadError(f"{where}: field 'rope_scaling': type {kind!r} is not supported (default, yarn)")
    if scaling.get("attention_factor") is not None or scaling.get("truncate", True) is not True:
        raise ModelLoadError(
            f"{where}: field 'rope_scaling': attention_factor / truncate=false are not supported"
        )
    try:
        factor = float(scaling["factor"])
        original = int(scaling.get("original_max_position_embeddings") or raw["max_position_embeddings"])
    except KeyError as missing:
        raise ModelLoadError(f"{where}: field 'rope_scaling' lacks {missing}") from None
    return theta, (
        factor,
        original,
        float(scaling.get("beta_fast") or 32),
        float(scaling.get("beta_slow") or 1),
        float(scaling.get("mscale") or 0.0),
        float(scaling.get("mscale_all_dim") or 0.0),
    )


def fp8_block_size(raw: dict[str, Any], where: str) -> tuple[int, int] | None:
    """The [rows, cols] block of the fp8 weight scales (`quantization_config`), None when unquantised."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    if (
        not isinstance(quant, dict)
        or quant.get("quant_method") != "fp8"
        or quant.get("fmt", "e4m3") != "e4m3"
    ):
        raise ModelLoadError(
            f"{where}: field 'quantization_config' {json.dumps(quant)} is not supported "
            "(fp8 e4m3 block scales)"
        )
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{where}: field 'quantization_config.weight_block_size' must be [rows, cols]")
    return int(block[0]), int(block[1])


def config_from_hf(raw: dict[str, Any], where: str) -> DeepseekV3Config:
    """DeepseekV3Config from a config.json object; every unsupported field or value is named."""
    unknown = sorted(set(raw) - _READ_FIELDS - _IGNORED_FIELDS)
    if unknown:
        raise ModelLoadError(
            f"{where}: unsupported config field(s) {unknown} for model_type {raw.get('model_type')!r} "
            "(jaxspec implements DeepSeek-V3 MLA + MoE)"
        )
    for name, value in _FIXED_FIELDS.items():
        if name in raw and raw[name] != value:
            found, supported = json.dumps(raw[name]), json.dumps(value)
            raise ModelLoadError(f"{where}: field {name!r} = {found} is not supported (only {supported})")

    def get(name: str, default: Any = None) -> Any:
        value = raw.get(name, default)
        if value is None and default is None and name != "q_lora_rank":
            raise ModelLoadError(f"{where}: required field {name!r} is missing")
        return value

    try:
        rope_theta, yarn = _yarn(raw, where)
    except (TypeError, ValueError, AttributeError) as error:
        raise ModelLoadError(f"{where}: field 'rope_scaling' is invalid ({error})") from None
    fp8_block_size(raw, where)
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    bos = raw.get("bos_token_id")
    num_heads = get("num_attention_heads")
    fields = dict(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        num_layers=get("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=get("v_head_dim"),
        rope_theta=rope_theta,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=get("max_position_embeddings", 4096),
        bos_token_id=bos if isinstance(bos, int) else None,
        eos_token_ids=tuple(int(i) for i in eos_ids),
        moe_intermediate_size=get("moe_intermediate_size"),
        n_routed_experts=get("n_routed_experts"),
        n_shared_experts=get("n_shared_experts", 0),
        num_experts_per_tok=get("num_experts_per_tok"),
        n_group=get("n_group", 1),
        topk_group=get("topk_group", 1),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        first_k_dense_replace=get("first_k_dense_replace", 0),
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"),
        rope_interleave=bool(raw.get("rope_interleave", True)),
        yarn=yarn,
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )
    kv_heads = raw.get("num_key_value_heads", num_heads)
    if kv_heads != num_heads:
        raise ModelLoadError(f"{where}: field 'num_key_value_heads' must equal num_attention_heads for MLA")
    names = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "head_dim": "v_head_dim"}
    try:
        return DeepseekV3Config(**fields)
    except (ValueError, TypeError) as error:
        message = str(error)
        for ours, theirs in names.items():
            message = message.replace(ours, theirs)
        raise ModelLoadError(f"{where}: {message}") from None


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def read_deepseek_config(path: Path) -> DeepseekV3Config:
    """DeepseekV3Config of a config.json file or of a directory's config.json (errors name the file
    and field)."""
    path = Path(path)
    path = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path}: cannot read ({error})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return config_from_hf(raw, str(path))
