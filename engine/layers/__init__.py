"""Model layers that several models use: quantized linears, LoRA, rotary embeddings."""
