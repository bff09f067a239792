"""Attention backends: each owns its KV cache layout, the cache write, attention over a step and
any weight preparation it needs."""
