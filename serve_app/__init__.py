"""The serving layer: an OpenAI-compatible HTTP API on Ray Serve over the engine.

`build_app` is the Serve import path `serve_app:build_app`. Nothing here imports jax: the engine
class is imported by its import-path string on the model-server replicas. `build_app` is loaded on
first use: an ingress replica (which imports `serve_app.http.ingress`) and a model-server replica
never load the app builder.
"""

__all__ = ["build_app"]


def __getattr__(name: str):
    if name == "build_app":
        # lazy: else importing any serve_app module (in a replica, the ingress) would load the app builder
        from serve_app.app import build_app

        return build_app
    raise AttributeError(f"module 'serve_app' has no attribute {name!r}")
