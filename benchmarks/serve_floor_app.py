"""What `serve run` costs before any model work: an application shaped like the default one (an
ingress over two model-server deployments, at the default app's CPU shares) whose servers load no
model. `startup_bench.py --floor bare` times it as it is; `--floor imports` has each server first
import what a model server must (jax and its CPU backend, levanter's models, transformers).
"""

from __future__ import annotations

from ray import serve
from starlette.requests import Request

ANSWER = {"choices": [{"message": {"role": "assistant", "content": "floor"}}]}


@serve.deployment
class FloorServer:
    def __init__(self, imports: bool):
        if imports:
            import jax.numpy as jnp
            import levanter.models.llama  # noqa: F401
            import transformers  # noqa: F401

            jnp.zeros(1).block_until_ready()  # the CPU backend started, as an engine starts it

    def answer(self) -> dict:
        return ANSWER


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class FloorIngress:
    def __init__(self, text, embeddings):
        # both servers are bound so that both start, as the default app's do; chat reaches the text one
        self.text, self.embeddings = text, embeddings

    async def __call__(self, request: Request) -> dict:
        return await self.text.answer.remote()


def build_app(args: dict):
    imports = bool(args.get("imports"))
    text = FloorServer.options(name="FloorText", ray_actor_options={"num_cpus": 0.5})
    embeddings = FloorServer.options(name="FloorEmbeddings", ray_actor_options={"num_cpus": 0.25})
    return FloorIngress.bind(text.bind(imports), embeddings.bind(imports))
