"""Executors run step plans (engine.generate.executor.base): `LocalExecutor` in this process (one
host), or `MultiHostExecutor` over one `EngineWorker` per host of a replica."""
