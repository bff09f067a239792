"""The engine's core: what a request is, its configuration, the KV page allocator, the scheduler and
the step plan. Pure Python and numpy; nothing here imports jax, so the serving layer and the
scheduler's tests use it without a model."""
