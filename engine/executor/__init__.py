"""Executors run step plans: `engine.runner.model_runner.ModelRunner` in this process (one host),
or `multihost.MultiHostExecutor` over one `EngineWorker` per host of a replica."""
