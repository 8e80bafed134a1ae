"""Llama-family decoders (Llama, Qwen2, Mistral): RoPE, RMSNorm, SwiGLU, grouped-query attention."""
