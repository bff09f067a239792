"""A continuous-batching, paged-attention LLM engine in JAX on levanter models.

Surface: `LLMEngine.add_request / abort / step` (engine.engine, imports jax) and `AsyncEngine`
(engine.async_engine, pure Python). This package's `__init__` imports nothing heavy so that the
serving layer can use `engine.request` and `engine.async_engine` without jax.
"""
