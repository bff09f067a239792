"""The generation engine's device side: the model runner (loads weights onto devices, dispatches jitted
steps, reads their results back), its sampler, sharding, the draft model and the KV pool's size."""
