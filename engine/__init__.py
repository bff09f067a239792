"""A continuous-batching, paged-attention LLM engine in JAX on levanter models.

Surface: `LLMEngine.add_request / abort / step` (engine.generate.engine, imports jax) and `AsyncEngine`
(engine.generate.driver, pure Python). Grouped by concern:

- `core/`: request, config, pages, scheduler, step plan: pure Python, no jax;
- `executor/`: what runs step plans: in this process, or over one worker per host;
- `runner/`: the device side (model runner, step programs, sampler, sharding);
- `backends/`: the attention backends (cpu with its kernels, xla, tpu) and their KV cache layouts;
- `model/`: the forward pass over levanter modules, checkpoint loading;
- `formats/`: GGUF conversion and model sources.

This package's `__init__` imports nothing heavy so that the serving layer can use `engine.core`
and `engine.generate.driver` without jax.
"""
