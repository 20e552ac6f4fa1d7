"""MTP heads (MiMo-style and DeepSeek-V3): module, drafter, loaders."""
