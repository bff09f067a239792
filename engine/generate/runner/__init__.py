"""The generation engine's device side: the model runner (dispatches jitted steps, reads their results
back) and what it is made of: the loader (weights onto devices), the KV pool's size (kv_pool) and the
check before loading (memory_plan), the step programs, the sampler, sharding, the draft model, and
the facts it hands up to the engine."""
