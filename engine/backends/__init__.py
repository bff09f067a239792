"""Attention backends: each owns its KV cache layout, the cache write, attention over a step, how a
layer projects q/k/v, any weight preparation it needs, and its own options (select.py reads them).
Nothing outside this package asks which backend runs."""
