"""Text generation: the LLM engine (engine.py: add / abort / step over token ids) and its async
driver (driver.py), over a pure-Python layer (request, scheduler, pages, buckets, step plan,
speculation, grammar, adapters, images: nothing there imports jax), the executors that run a
step plan (executor/) and the device side (runner/)."""
