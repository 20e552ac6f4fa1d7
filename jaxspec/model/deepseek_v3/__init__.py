"""DeepSeek-V3-family targets: Multi-head Latent Attention (MLA) + mixture of experts, their MTP layer.

config      DeepseekV3Config (a ModelConfig) and its reading from a Hugging Face config.json
model       MLA with the compressed latent + rope-key cache, the MoE, the decoder, the model
checkpoint  the Hugging Face layout (sharded safetensors, fp8 + block scales dequantised) -> params
mtp         the MTP layer stored at index num_hidden_layers, as a jaxspec MTP head
"""
