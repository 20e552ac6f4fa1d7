"""DeepSeek-V3-family targets: Multi-head Latent Attention (MLA) + mixture of experts.

config      DeepseekV3Config (a ModelConfig) and its reading from a Hugging Face config.json
model       MLA with the compressed latent + rope-key cache, the MoE, the decoder, the model

Their checkpoint layout (sharded safetensors, fp8 + block scales dequantised) is read by
`jaxspec.loading.deepseek_v3`; their MTP layers run as a jaxspec MTP head (`jaxspec.drafters.heads.mtp`).
"""
