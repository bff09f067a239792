"""Helpers shared by the serving tests: waiting on a condition, reading server-sent events,
finding the Ray processes a test started, serving a checkpoint in this process, holding a
request inside its tokenizing, reading an app's metrics, holding a stream open, and transformers'
reference answers."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable


@contextlib.contextmanager
def held_in_tokenizing(prompts, text: str):
    """Patches `prompts` (a replica's PromptTokenizer) so that tokenizing the prompt `text` waits
    for the yielded `release` event; `entered` is set once it waits. Unreleased after 30 s, the
    request fails with a TimeoutError that names the likely cause."""
    entered, release = threading.Event(), threading.Event()
    encode = prompts.prompt

    def held_prompt(value, param="prompt"):
        if value == text:
            entered.set()
            if not release.wait(timeout=30):
                raise TimeoutError("never released: the event loop was blocked while this request was tokenized")
        return encode(value, param)

    prompts.prompt = held_prompt
    try:
        yield entered, release
    finally:
        del prompts.prompt  # the class's method again


def wait_for(condition: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`. The polls start
    20 ms apart and back off to 0.25 s: a condition that takes long (a replica starting) is not
    asked 50 times a second through the HTTP proxy and Serve's controller, on the cores the
    replica needs."""
    deadline, pause = time.monotonic() + timeout_s, 0.02
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(pause)
        pause = min(0.25, pause * 1.5)


def sse_events(lines: Iterable[str]) -> list[Any]:
    """The `data:` payloads of an event stream: parsed JSON, or the string "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def ray_processes(title: str) -> list:
    """The processes of this test's Ray instance (children of this process) whose title, as Ray
    sets it (`ray::<Class>` or `ray::ServeReplica:<app>:<deployment>`, then the method it runs),
    matches the regex `title` at its start."""
    import psutil

    def matches(process) -> bool:
        try:
            return re.match(title, " ".join(process.cmdline())) is not None
        except psutil.Error:  # gone (or a zombie) since it was listed
            return False

    return [p for p in psutil.Process().children(recursive=True) if matches(p)]


def engine_worker_processes() -> list:
    """The EngineWorker processes (how operators find them too)."""
    return ray_processes(r"ray::EngineWorker")


def model_server_processes(app: str, model_id: str) -> list:
    """The processes of the Ray Serve replicas of `model_id`'s server in the Serve application `app`."""
    return ray_processes(rf"ray::ServeReplica:{re.escape(app)}:TextServer-{re.escape(model_id)}(\.|\s|$)")


def templated_checkpoint(model_dir, out: Path, template: str, fixed_output: list[int] | None = None) -> Path:
    """A copy of the checkpoint in `out` with `template` as its chat template (chat_template.jinja
    wins over tokenizer_config.json's) and, for fake_engine's FixedOutputEngine, `fixed_output` as
    the token ids it says."""
    from tests.support.fake_engine import FIXED_OUTPUT_FILE

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    (out / "chat_template.jinja").write_text(template)
    if fixed_output is not None:
        (out / FIXED_OUTPUT_FILE).write_text(json.dumps(fixed_output))
    return out


@contextlib.contextmanager
def app_in_process(checkpoint, model_id: str, tracing=None, **args):
    """(server, http, openai client): the OpenAI app over one TextServer in this process, the
    official client talking to it through FastAPI's test client; the engine shut down after.
    `tracing`: a serve_app.tracing.Tracing for the ingress and the server (default: off)."""
    import openai
    from fastapi.testclient import TestClient

    from serve_app.config import AppConfig
    from serve_app.http.backends import LocalBackend
    from serve_app.http.ingress import create_app
    from serve_app.replicas.generate import TextServer

    config = AppConfig.from_args({"model": str(checkpoint), "model_id": model_id, "warmup": False, **args})
    from serve_app.tracing import Tracing

    server = TextServer(config.models[0])
    server.tracing = tracing or Tracing.off()
    try:
        adapters = {model_id: config.models[0].lora_modules}
        app = create_app({model_id: LocalBackend(server)}, adapters=adapters, tracing=server.tracing)
        with TestClient(app) as http:
            yield server, http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
    finally:
        server.driver.shutdown()


def metric(http, name: str, model_name: str, **labels) -> float:
    """Sum of the samples of `name` (over replicas) of `model_name` whose labels include `labels`,
    from the /metrics of the app `http` talks to."""
    return sum(sample.value for sample in samples(http, name, model_name=model_name, **labels))


def samples(http, name: str, **labels) -> list:
    """The samples of `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    return [sample for family in text_string_to_metric_families(http.get("/metrics").text)
            for sample in family.samples if sample.name == name and labels.items() <= sample.labels.items()]


def openai_error(message: str, param=None, type="invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class OpenStream:
    """A long streamed completion of `prompt` (seconds of engine steps), read up to its first event
    and held open until `close()`."""

    def __init__(self, http, model: str, prompt: str, max_tokens: int = 480):
        request = http.build_request(
            "POST",
            "/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True},
        )
        self.response = http.send(request, stream=True)
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()  # dropping this iterator would close the response
        assert next(line for line in self.lines if line).startswith("data: {")

    def close(self) -> None:
        self.response.close()


def hf_greedy(model, prompt_ids: list[int], count: int) -> list[int]:
    """`count` tokens of greedy decoding by the transformers `model`, one argmax at a time."""
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(count):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids) :].tolist()


def hf_prompt_logprobs(model, prompt_ids: list[int]) -> list[float]:
    """The log-probability transformers' `model` gives each prompt token after the first."""
    import torch

    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0], dim=-1)
    return [logprobs[i - 1, t].item() for i, t in enumerate(prompt_ids) if i > 0]
