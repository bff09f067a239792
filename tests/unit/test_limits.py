"""The ingress's limits and hardening, without Ray: per-request limits (400s naming the field), the
body size limit (413, read no further), CORS, and what never reaches a client or a log (stack
traces, the API key)."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from fastapi.testclient import TestClient

from serve_app.config import AppConfig, CorsConfig, RequestLimits
from serve_app.errors import BadRequest
from serve_app.http.backends import LocalBackend
from serve_app.http.ingress import create_app
from serve_app.http.limits import check_limits
from serve_app.protocol.embeddings import EmbeddingRequest
from serve_app.protocol.score import RerankRequest, ScoreRequest
from serve_app.replicas.generate import TextServer

MODEL = "tiny"
SMALL = RequestLimits(
    max_request_body_bytes=1000,
    max_prompts_per_request=2,
    max_n=3,
    max_choices_per_request=4,
    max_stop_strings=2,
    max_stop_string_chars=5,
    max_stop_token_ids=2,
    max_logit_bias_entries=2,
    max_images_per_request=1,
    max_logprobs=3,
)
TOO_LARGE_1000 = {
    "error": {
        "message": "the request body is larger than this server's limit of 1000 bytes; send a smaller request, "
        "or raise the server's max_request_body_bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
}


class RecordingBackend(LocalBackend):
    """Answers every request with `{}` and keeps it: what passed the ingress's checks."""

    def __init__(self):
        super().__init__(None)
        self.requests = []

    async def respond(self, request, context):
        self.requests.append(request)
        return "{}"

    async def statuses(self):
        return []  # no replica behind it: /v1/models shows no facts


def make_client(limits=None, cors=None, api_key=None, backend=None, **kwargs) -> TestClient:
    return TestClient(create_app({MODEL: backend or RecordingBackend()}, api_key, limits, cors), **kwargs)


def bad_request(message: str, param: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


# ---- per-request limits ----

COMPLETION_OVER_LIMITS = [
    ({"prompt": ["a", "b", "c"]}, "prompt holds 3 prompts", 2, "max_prompts_per_request",
     "split them over several requests", "prompt"),
    ({"prompt": [[1], [2], [3]]}, "prompt holds 3 prompts", 2, "max_prompts_per_request",
     "split them over several requests", "prompt"),
    ({"n": 4}, "n is 4", 3, "max_n", "lower n", "n"),
    ({"prompt": ["a", "b"], "n": 3}, "prompts x n is 6 choices (2 x 3)", 4, "max_choices_per_request",
     "send fewer prompts or a lower n", "n"),
    ({"stop": ["a", "b", "c"]}, "stop holds 3 strings", 2, "max_stop_strings", "send fewer", "stop"),
    ({"stop": "abcdef"}, "stop holds a string of 6 characters", 5, "max_stop_string_chars", "shorten it", "stop"),
    ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids holds 3 ids", 2, "max_stop_token_ids", "send fewer",
     "stop_token_ids"),
    ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias holds 3 entries", 2, "max_logit_bias_entries",
     "send fewer", "logit_bias"),
    ({"logprobs": 4}, "logprobs is 4", 3, "max_logprobs", "lower logprobs", "logprobs"),
]


@pytest.mark.parametrize("body, what, limit, setting, fix, param", COMPLETION_OVER_LIMITS)
def test_completion_over_a_limit_is_a_400_naming_field_and_limit(body, what, limit, setting, fix, param):
    backend = RecordingBackend()
    with make_client(SMALL, backend=backend) as client:
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    message = f"{what}, over this server's limit of {limit} ({setting}); {fix}"
    assert (response.status_code, response.json()) == (400, bad_request(message, param))
    assert backend.requests == []  # refused before any model server


@pytest.mark.parametrize(
    "body, message, param",
    [
        ({"n": 4}, "n is 4, over this server's limit of 3 (max_n); lower n", "n"),
        ({"n": 5}, "n is 5, over this server's limit of 3 (max_n); lower n", "n"),
        ({"stop": ["a", "b", "c"]}, "stop holds 3 strings, over this server's limit of 2 (max_stop_strings); "
         "send fewer", "stop"),
        ({"stop": ["ok", "toolong"]}, "stop holds a string of 7 characters, over this server's limit of 5 "
         "(max_stop_string_chars); shorten it", "stop"),
        ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias holds 3 entries, over this server's limit of 2 "
         "(max_logit_bias_entries); send fewer", "logit_bias"),
        ({"logprobs": True, "top_logprobs": 4}, "top_logprobs is 4, over this server's limit of 3 (max_logprobs); "
         "lower top_logprobs", "top_logprobs"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png,x"}}]
                        * 2}]}, "the messages hold 2 images, over this server's limit of 1 (max_images_per_request); "
         "send fewer", "messages"),
    ],
)
def test_chat_over_a_limit_is_a_400_naming_field_and_limit(body, message, param):
    with make_client(SMALL) as client:
        response = client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body}
        )
    assert (response.status_code, response.json()) == (400, bad_request(message, param))


def test_requests_at_every_limit_pass():
    backend = RecordingBackend()
    at_limits = {
        "n": 2,
        "stop": ["abcde", "x"],
        "stop_token_ids": [1, 2],
        "logit_bias": {"1": 1, "2": -1},
    }
    with make_client(SMALL, backend=backend) as client:
        completion = {"model": MODEL, "prompt": ["a", "b"], "logprobs": 3, **at_limits}
        messages = [{"role": "user", "content": "x"}]
        chat = {"model": MODEL, "messages": messages, "logprobs": True, "top_logprobs": 3, **at_limits, "n": 3}
        responses = [
            client.post("/v1/completions", json=completion),
            client.post("/v1/completions", json={"model": MODEL, "prompt": list(range(50)), "n": 3}),  # one prompt
            client.post("/v1/chat/completions", json=chat),
        ]
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert len(backend.requests) == 3


@pytest.mark.parametrize(
    "body, message, param",
    [
        ({"prompt": ["x"] * 257}, "prompt holds 257 prompts, over this server's limit of 256 "
         "(max_prompts_per_request); split them over several requests", "prompt"),
        ({"n": 129}, "n is 129, over this server's limit of 128 (max_n); lower n", "n"),
        ({"prompt": ["x"] * 3, "n": 100}, "prompts x n is 300 choices (3 x 100), over this server's limit of 256 "
         "(max_choices_per_request); send fewer prompts or a lower n", "n"),
        ({"stop": [str(i) for i in range(65)]}, "stop holds 65 strings, over this server's limit of 64 "
         "(max_stop_strings); send fewer", "stop"),
        ({"stop": "s" * 1025}, "stop holds a string of 1025 characters, over this server's limit of 1024 "
         "(max_stop_string_chars); shorten it", "stop"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids holds 65 ids, over this server's limit of 64 "
         "(max_stop_token_ids); send fewer", "stop_token_ids"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias holds 301 entries, over this server's "
         "limit of 300 (max_logit_bias_entries); send fewer", "logit_bias"),
        ({"logprobs": 21}, "logprobs is 21, over this server's limit of 20 (max_logprobs); lower logprobs",
         "logprobs"),
    ],
)
def test_default_limits(body, message, param):
    with make_client() as client:
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert (response.status_code, response.json()) == (400, bad_request(message, param))


# ---- the body size limit ----


def test_a_body_over_the_limit_is_a_413():
    padded = json.dumps({"model": MODEL, "prompt": "x"}).ljust(1000).encode()  # exactly at the limit: served
    with make_client(SMALL) as client:
        at_limit = client.post("/v1/completions", content=padded, headers={"content-type": "application/json"})
        over = client.post("/v1/completions", content=padded + b" ", headers={"content-type": "application/json"})
        chunked = client.post("/v1/completions", content=iter([padded, b" "]))  # no Content-Length
    assert at_limit.status_code == 200
    assert (over.status_code, over.json()) == (413, TOO_LARGE_1000)
    assert "content-length" not in chunked.request.headers
    assert (chunked.status_code, chunked.json()) == (413, TOO_LARGE_1000)


async def call_asgi(app, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[int, dict, int]:
    """POST /v1/completions straight into the ASGI app; returns (status, JSON body, chunks it read)."""
    read = 0

    async def receive():
        nonlocal read
        if read == len(chunks):
            return {"type": "http.disconnect"}
        read += 1
        return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers], "client": ("c", 1), "server": ("s", 80),
    }
    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), read


def test_a_declared_length_over_the_limit_is_refused_unread():
    app = create_app({MODEL: RecordingBackend()}, limits=SMALL)
    chunks = [b" " * 400] * 100
    status, body, read = asyncio.run(call_asgi(app, [(b"content-length", b"40000")], chunks))
    assert (status, body, read) == (413, TOO_LARGE_1000, 0)


def test_a_chunked_body_is_read_only_until_it_passes_the_limit():
    app = create_app({MODEL: RecordingBackend()}, limits=SMALL)
    status, body, read = asyncio.run(call_asgi(app, [], [b" " * 400] * 100))
    assert (status, body, read) == (413, TOO_LARGE_1000, 3)  # 1200 bytes > 1000: stop there


def test_the_default_body_limit_is_32_mib():
    app = create_app({MODEL: RecordingBackend()})
    over = str(32 * 2**20 + 1).encode()
    status, body, read = asyncio.run(call_asgi(app, [(b"content-length", over)], [b"{}"]))
    assert (status, read) == (413, 0)
    assert body["error"]["message"].startswith("the request body is larger than this server's limit of 33554432 bytes")


def test_refused_requests_leave_a_request_in_flight_alone(llama_dir):
    args = {"model": str(llama_dir), "model_id": MODEL, "engine_cls": "tests.support.fake_engine:SlowFakeEngine"}
    server = TextServer(AppConfig.from_args({**args, "max_model_len": 128}).models[0])
    app = create_app({MODEL: LocalBackend(server)}, limits=RequestLimits(max_request_body_bytes=4096))
    slow_request = {"model": MODEL, "prompt": "Hello world", "max_tokens": 20, "temperature": 0, "ignore_eos": True}

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            slow = asyncio.create_task(client.post("/v1/completions", json=slow_request))
            async with asyncio.timeout(30):
                while server.driver.stats().num_running == 0:
                    await asyncio.sleep(0.01)
            refused = [
                await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 1000}),
                await client.post("/v1/completions", content=b" " * 5000),
            ]
            assert not slow.done()
            return [r.status_code for r in refused], await slow

    try:
        statuses, slow = asyncio.run(run())
    finally:
        server.driver.shutdown()
    assert statuses == [400, 413]
    assert slow.status_code == 200
    assert slow.json()["choices"][0]["text"] == "Hello world" * 10
    assert slow.json()["choices"][0]["finish_reason"] == "length"


# ---- CORS ----

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def test_cors_preflight_from_an_allowed_origin_gets_the_headers():
    cors = CorsConfig(allowed_origins=["https://app.example"])
    with make_client(cors=cors, api_key="sesame") as client:
        preflight = client.options("/v1/chat/completions", headers={"Origin": "https://app.example", **PREFLIGHT})
        simple = client.get("/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer sesame"})
    assert preflight.status_code == 200  # no API key needed for a preflight
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert set(preflight.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
    assert preflight.headers["access-control-allow-headers"] == "authorization,content-type"
    assert "access-control-allow-credentials" not in preflight.headers
    assert simple.status_code == 200
    assert simple.headers["access-control-allow-origin"] == "https://app.example"
    assert simple.headers["access-control-expose-headers"] == "Retry-After"


def test_cors_preflight_from_another_origin_gets_no_cors_headers():
    with make_client(cors=CorsConfig(allowed_origins=["https://app.example"])) as client:
        preflight = client.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **PREFLIGHT})
        simple = client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in simple.headers


def test_cors_is_off_by_default():
    with make_client() as client:
        preflight = client.options("/v1/chat/completions", headers={"Origin": "https://app.example", **PREFLIGHT})
        simple = client.get("/v1/models", headers={"Origin": "https://app.example"})
    assert preflight.status_code == 405
    assert not [h for h in (*preflight.headers, *simple.headers) if h.startswith("access-control-")]


def test_a_413_carries_cors_headers_so_browsers_can_read_it():
    cors = CorsConfig(allowed_origins=["*"])
    with make_client(SMALL, cors=cors) as client:
        response = client.post("/v1/completions", content=b" " * 1001, headers={"Origin": "https://app.example"})
    assert response.status_code == 413
    assert response.headers["access-control-allow-origin"] == "*"


# ---- nothing leaks ----


class BrokenBackend(RecordingBackend):
    """Every call raises an exception whose message looks like a secret."""

    async def respond(self, request, context):
        raise RuntimeError("secret internals: /srv/keys at 0xdeadbeef")

    async def statuses(self):
        raise RuntimeError("secret internals: /srv/keys at 0xdeadbeef")

    async def metric_families(self):
        raise KeyError("secret internals")


@pytest.mark.parametrize(
    "method, path, exc_name",
    [("POST", "/v1/completions", "RuntimeError"), ("GET", "/health", "RuntimeError"), ("GET", "/metrics", "KeyError")],
)
def test_an_unexpected_exception_is_a_500_without_a_traceback(caplog, method, path, exc_name):
    with make_client(backend=BrokenBackend(), raise_server_exceptions=False) as client:
        response = client.request(method, path, json={"model": MODEL, "prompt": "x"})
    assert (response.status_code, response.json()) == (
        500,
        {
            "error": {
                "message": f"internal server error ({exc_name}); see the server log",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        },
    )
    assert "Traceback" not in response.text and "secret" not in response.text
    assert "secret internals" in caplog.text  # the server log has it


def test_the_api_key_never_reaches_the_log(caplog):
    caplog.set_level(logging.DEBUG)
    logging.getLogger("serve_app").addHandler(caplog.handler)  # also if it does not propagate
    key, wrong = "sesame-0123456789", "guess-9876543210"
    try:
        with make_client(api_key=key, backend=BrokenBackend(), raise_server_exceptions=False) as client:
            for token in (key, wrong):
                auth = {"Authorization": f"Bearer {token}"}
                client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=auth)
                client.post("/v1/completions", content=b"{bad json", headers=auth)
                client.get("/v1/models", headers=auth)
                client.get("/health", headers=auth)
    finally:
        logging.getLogger("serve_app").removeHandler(caplog.handler)
    assert "internal error while serving a request" in caplog.text  # the log was captured
    assert key not in caplog.text and wrong not in caplog.text
    config = AppConfig.from_args({"model": "m", "api_key": key})
    assert key not in repr(config) and key not in str(config.model_dump())


@pytest.mark.parametrize("request_, message, param", [
    (RerankRequest(model=MODEL, query="q", documents=["a", "b", "c"]), "documents holds 3 documents, over this "
     "server's limit of 2 (max_prompts_per_request); split them over several requests", "documents"),
    (ScoreRequest(model=MODEL, text_1="q", text_2=["a", "b", "c"]), "text_2 holds 3 pairs, over this server's "
     "limit of 2 (max_prompts_per_request); split them over several requests", "text_2"),
    (EmbeddingRequest(model=MODEL, input=["a", "b", "c"]), "input holds 3 inputs, over this server's limit of 2 "
     "(max_prompts_per_request); split them over several requests", "input"),
])
def test_a_reranks_documents_and_a_score_requests_pairs_count_as_prompts(request_, message, param):
    with pytest.raises(BadRequest) as refused:
        check_limits(request_, SMALL)
    assert (refused.value.message, refused.value.param) == (message, param)
    check_limits(request_.model_copy(update={"documents": ["a", "b"]} if isinstance(request_, RerankRequest) else
                                     {"text_2": ["a", "b"]} if isinstance(request_, ScoreRequest) else
                                     {"input": ["a", "b"]}), SMALL)  # at the limit: accepted
