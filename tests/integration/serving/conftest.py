"""The serving tests' Ray instance: one local Ray and Serve for the session (`serving`), and one app
per concern (tests/support/serving_apps.py), all deployed at once when the first test asks; each
concern's fixture (`text_app`, `multidevice_app`, `media_app`, `failure_app`) waits for its own app
only, so a model that cannot start fails its concern's tests and no other. Only the apps the
collected tests use are deployed. Reference outputs come from transformers running the same
checkpoints (`serving.model`, `serving.eight_heads`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.support.hub_server import HubServer
from tests.support.s3_server import S3Server
from tests.support.score_models import make_cross_encoder
from tests.support.serving_apps import API_KEY, CONCERNS, EIGHT_HEADS, HUB_REPO, S3_URI, Sources, app_args
from tests.support.serving_helpers import hf_greedy, hf_prompt_logprobs, wait_for
from tests.support.tiny_models import make_lora_adapter

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@dataclass
class App:
    """One concern's app: its base URL (the proxy's, then /<concern>), and clients that carry the key."""

    url: str
    client: "openai.OpenAI"
    http: httpx.Client


@dataclass
class Serving:
    """The session's Ray Serve: the proxy's URL, the apps being deployed, and the references."""

    url: str
    checkpoint: Path
    tokenizer: object
    model: object
    """transformers' model of `checkpoint` (MODEL, MODEL_TP2)."""
    eight_heads: object
    """transformers' model of the Hub repo's checkpoint (MODEL_2HOSTS)."""
    hub: HubServer
    adapters: Path
    deploying: dict = field(default_factory=dict)
    """concern -> the future of its serve.run (it returns once the app runs, raises if it cannot)."""
    apps: dict = field(default_factory=dict)

    def app(self, concern: str) -> App:
        if concern not in self.apps:
            if concern not in self.deploying:
                raise RuntimeError(f"the {concern!r} app was not deployed: no collected test asked for it")
            self.deploying[concern].result(timeout=600)
            url = f"{self.url}/{concern}"
            wait_for(lambda: healthy(url), 300, f"a healthy {concern} app")
            http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
            self.apps[concern] = App(url, client, http)
        return self.apps[concern]

    def greedy_text(self, prompt_ids: list[int], count: int, model=None) -> str:
        """transformers' greedy answer (`model`, else `self.model`) of `count` tokens, as text."""
        return self.tokenizer.decode(hf_greedy(model or self.model, prompt_ids, count), skip_special_tokens=True)

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float]:
        return hf_prompt_logprobs(self.model, prompt_ids)

    def close(self) -> None:
        for app in self.apps.values():
            app.client.close()
            app.http.close()


def healthy(url: str) -> bool:
    """Whether the app at `url` answers /health with 200; an answer slow to come (the apps start at
    once, on few cores) is a no, not an error."""
    try:
        return httpx.get(f"{url}/health", timeout=30).status_code == 200
    except httpx.TransportError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wanted_concerns(session) -> list[str]:
    """The concerns whose app fixture a collected test uses."""
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    return [concern for concern in CONCERNS if f"{concern}_app" in used]


@pytest.fixture(scope="session")
def serving(request, checkpoint_factory, tmp_path_factory):
    import ray
    from ray import serve

    from serve_app import build_app

    concerns = wanted_concerns(request.session)
    checkpoint = checkpoint_factory("llama")
    eight_heads = checkpoint_factory("llama", **EIGHT_HEADS)
    media = "media" in concerns
    with contextlib.ExitStack() as stack:  # closed in reverse: Serve, the deploying threads, Ray, S3, the Hub
        hub = HubServer()
        stack.callback(hub.close)
        hub.add(HUB_REPO, eight_heads)
        s3 = stack.enter_context(S3Server())
        s3.upload(checkpoint, S3_URI)
        adapters = tmp_path_factory.mktemp("adapters")
        make_lora_adapter(checkpoint, adapters / "every", seed=1)
        sources = Sources(checkpoint=checkpoint, moe=checkpoint_factory("qwen3_moe"), adapters=adapters,
                          s3_env=s3.env,
                          whisper=request.getfixturevalue("whisper_dir") if media else None,
                          llava=request.getfixturevalue("llava_dir") if media else None,
                          reranker=make_cross_encoder(tmp_path_factory.mktemp("reranker")) if media else None,
                          hub_env={"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0",
                                   "HF_HOME": str(tmp_path_factory.mktemp("hf"))},
                          cache_dir=tmp_path_factory.mktemp("models"))
        port = free_port()
        # USE_TORCH=0 as deploy/config.yaml sets it: no serving process runs a torch model, and each of
        # the ~15 these apps start at once would import torch through transformers (~2.5 s of CPU each)
        ray.init(address="local", num_cpus=5, include_dashboard=False,
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "USE_TORCH": "0"}})
        stack.callback(ray.shutdown)
        pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(len(CONCERNS)))
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        stack.callback(serve.shutdown)  # before the pool waits: a serve.run still waiting then raises
        deploying = {c: pool.submit(serve.run, build_app(app_args(c, sources)), name=c, route_prefix=f"/{c}")
                     for c in concerns}
        serving = Serving(url=f"http://127.0.0.1:{port}", checkpoint=checkpoint,
                          tokenizer=transformers.AutoTokenizer.from_pretrained(checkpoint),
                          model=transformers.AutoModelForCausalLM.from_pretrained(checkpoint,
                                                                                  dtype=torch.float32).eval(),
                          eight_heads=transformers.AutoModelForCausalLM.from_pretrained(
                              eight_heads, dtype=torch.float32).eval(),
                          hub=hub, adapters=adapters, deploying=deploying)
        stack.callback(serving.close)
        yield serving


@pytest.fixture(scope="session")
def text_app(serving) -> App:
    return serving.app("text")


@pytest.fixture(scope="session")
def multidevice_app(serving) -> App:
    return serving.app("multidevice")


@pytest.fixture(scope="session")
def media_app(serving) -> App:
    return serving.app("media")


@pytest.fixture(scope="session")
def failure_app(serving) -> App:
    return serving.app("failure")
