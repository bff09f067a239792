"""A continuous-batching, paged-attention LLM engine in JAX on levanter models, and the embedding
and speech engines beside it.

Each task is a package with its engine (sync: add / abort / step over token ids) and its async
driver: `generate/` (LLMEngine, AsyncEngine), `embed/` (EmbeddingEngine, AsyncEmbedder),
`transcribe/` (SpeechEngine, AsyncTranscriber). What they share sits here (config, errors, stats,
task names, the worker spine, the step compiler, the size ladders); below them `step/` (one step
as the device side reads it), `layers/`, `backends/`, `models/`, and `formats/` (pure I/O); `tools/`
holds the offline tools.

This package's `__init__` imports nothing heavy, so that the serving layer can use the engine's
pure modules (`engine.generate.request`, the drivers, `engine.config`) without jax.
"""
