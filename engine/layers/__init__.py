"""Model layers that several models use: quantized linears, LoRA, rotary embeddings, and the transformer
encoder layer (transformer.py) that BERT and LLaVA's CLIP / SigLIP vision towers share."""
