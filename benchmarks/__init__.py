"""Benchmarks of jax-serve: the engine alone (engine_bench), any OpenAI-compatible server
(serve_bench), and a side-by-side comparison with vLLM and llama.cpp (compare)."""
