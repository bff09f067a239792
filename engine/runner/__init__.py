"""The device side: the one place that loads weights onto devices, dispatches jitted steps and
reads their results back (model runner, sampler, sharding)."""
