"""The test suite: unit/ (no server), integration/ (a real HTTP server, Ray Serve, a container or a
subprocess), multidevice/ (several devices or JAX processes), and support/, the shared test models
and helpers, importable as `tests.support` by tests and benchmarks alike."""
