"""The ingress's published schema: /openapi.json (OpenAPI 3.1) and /docs, without Ray.

The schema only describes the routes: a POST body is still parsed by `parse_request`, so an invalid
body stays our OpenAI-shaped 400, never FastAPI's 422. Every `$ref` resolves inside the document;
real responses validate against the schemas it publishes for them.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from serve_app.config import AppConfig
from serve_app.http.backends import LocalBackend
from serve_app.http.ingress import create_app
from serve_app.replicas.generate import TextServer
from tests.support.serving_helpers import openai_error

jsonschema = pytest.importorskip("jsonschema")  # installed with ray; openapi-spec-validator is not

MODEL = "tiny"
PATHS = {
    "/v1/completions": {"post"},
    "/v1/chat/completions": {"post"},
    "/v1/embeddings": {"post"},
    "/v1/rerank": {"post"},
    "/v1/score": {"post"},
    "/v1/audio/transcriptions": {"post"},
    "/v1/audio/translations": {"post"},
    "/tokenize": {"post"},
    "/detokenize": {"post"},
    "/v1/models": {"get"},
    "/v1/models/{model_id}": {"get"},
    "/v1/load_lora_adapter": {"post"},
    "/v1/unload_lora_adapter": {"post"},
    "/health": {"get"},
    "/metrics": {"get"},
}
BODIES = {
    "/v1/completions": ("CompletionRequest", "prompt"),
    "/v1/chat/completions": ("ChatCompletionRequest", "messages"),
    "/v1/embeddings": ("EmbeddingRequest", "input"),
    "/v1/rerank": ("RerankRequest", "documents"),
    "/v1/score": ("ScoreRequest", "text_1"),
    "/detokenize": ("DetokenizeRequest", "tokens"),
}
MESSAGES = [{"role": "user", "content": "Hello world"}]


class StubBackend(LocalBackend):
    """Answers every request with `{}`: the ingress alone is under test."""

    def __init__(self):
        super().__init__(None)

    async def respond(self, request, context):
        return "{}"

    async def statuses(self):
        return [{"alive": True}]

    async def metric_families(self):
        return []


def make_client(api_key=None) -> TestClient:
    return TestClient(create_app({MODEL: StubBackend()}, api_key))


@pytest.fixture(scope="module")
def document() -> dict:
    with make_client() as client:
        response = client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def resolve(document: dict, ref: str):
    assert ref.startswith("#/"), ref
    node = document
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def refs(node) -> list[str]:
    """Every `$ref` under `node`."""
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    if not isinstance(node, dict):
        return []
    found = [node["$ref"]] if "$ref" in node else []
    return found + [r for key, value in node.items() if key != "$ref" for r in refs(value)]


def validator(document: dict, ref: str):
    """A JSON Schema validator of `ref` whose `#/components/...` refs resolve in `document`."""
    return jsonschema.Draft202012Validator({"$ref": ref, "components": document["components"]})


def test_the_document_lists_exactly_the_routes(document):
    assert document["openapi"].startswith("3.1")
    assert {path: set(operations) for path, operations in document["paths"].items()} == PATHS


@pytest.mark.parametrize("path", sorted(BODIES))
def test_each_post_declares_its_request_body(document, path):
    name, field = BODIES[path]
    body = document["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    schema = resolve(document, body["content"]["application/json"]["schema"]["$ref"])
    assert schema["title"] == name and schema["type"] == "object"
    assert {"model", field} <= set(schema["properties"]) and {"model", field} <= set(schema["required"])
    assert schema["additionalProperties"] is False  # unknown fields are 400s


@pytest.mark.parametrize("path, name", [("/v1/audio/transcriptions", "TranscriptionRequest"),
                                        ("/v1/audio/translations", "TranslationRequest")])
def test_audio_routes_declare_a_multipart_form(document, path, name):
    body = document["paths"][path]["post"]["requestBody"]
    fields, file = body["content"]["multipart/form-data"]["schema"]["allOf"]
    schema = resolve(document, fields["$ref"])
    assert schema["title"] == name and "model" in schema["required"] and schema["additionalProperties"] is False
    assert file["required"] == ["file"] and file["properties"]["file"]["format"] == "binary"
    assert ("language" in schema["properties"]) == (name == "TranscriptionRequest")


def test_every_ref_resolves_and_every_schema_is_valid(document):
    nested = {"#/components/schemas/ChatMessage", "#/components/schemas/StreamOptions"}  # the request models' $defs
    assert nested <= set(refs(document))
    for ref in refs(document):
        assert ref.startswith("#/components/schemas/"), ref
        resolve(document, ref)
    for schema in document["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_responses_are_declared_and_no_422(document):
    for path, operations in document["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path
            for status in ("4XX", "5XX"):
                schema = operation["responses"][status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "HTTPValidationError" not in document["components"]["schemas"]
    metrics, completions = document["paths"]["/metrics"]["get"], document["paths"]["/v1/completions"]["post"]
    assert metrics["responses"]["200"]["content"] == {"text/plain": {"schema": {"type": "string"}}}
    assert set(completions["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [3]], "stop": "x", "stream": False,
                             "logit_bias": {"5": -100}, "echo": True, "max_tokens": 0}),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 2, "seed": None}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text",
                                                                                         "text": "hi"}]}]}),
    ],
)
def test_bodies_the_server_accepts_fit_the_schema(document, path, body):
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    validator(document, ref).validate(body)
    with make_client() as client:
        assert client.post(path, json=body).status_code == 200
    assert not validator(document, ref).is_valid({**body, "bogus": 1})


@pytest.mark.parametrize(
    "path, kwargs, message, param",
    [
        ("/v1/completions", {"json": {"model": MODEL, "prompt": "x", "n": "x"}},
         "n: Input should be a valid integer, unable to parse string as an integer", "n"),
        ("/v1/completions", {"json": {"prompt": "x"}}, "model: Field required", "model"),
        ("/v1/completions", {"content": b'{"model": ', "headers": {"content-type": "application/json"}},
         "Invalid JSON: EOF while parsing a value at line 1 column 10", None),
        ("/v1/completions", {"content": b"[]"}, "Input should be an object", None),
        ("/v1/chat/completions", {"json": {"model": MODEL}}, "messages: Field required", "messages"),
        ("/v1/chat/completions", {"json": {"model": MODEL, "messages": MESSAGES, "bogus": 1}},
         "'bogus' is not a supported field; remove it", "bogus"),
    ],
)
def test_an_invalid_body_is_still_our_400_never_a_422(document, path, kwargs, message, param):
    with make_client() as client:
        response = client.post(path, **kwargs)
    assert (response.status_code, response.json()) == (400, openai_error(message, param))
    validator(document, "#/components/schemas/ErrorResponse").validate(response.json())


def test_docs_are_html_and_point_at_the_document():
    with make_client() as client:
        for path in ("/docs", "/redoc"):
            response = client.get(path)
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
            assert "/openapi.json" in response.text


def test_with_an_api_key_the_schema_is_open_and_declares_bearer_auth():
    with make_client(api_key="sesame") as client:
        document = client.get("/openapi.json")
        assert document.status_code == 200 and client.get("/docs").status_code == 200
        missing = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        right = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                            headers={"Authorization": "Bearer sesame"})
    assert (missing.status_code, missing.json()) == (
        401,
        openai_error("no API key provided; send it as 'Authorization: Bearer <key>'", code="invalid_api_key"),
    )
    assert right.status_code == 200
    document = document.json()
    assert document["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the server's API key, as `Authorization: Bearer <key>`",
    }
    for path, operations in document["paths"].items():
        security = [{"HTTPBearer": []}] if path.startswith(("/v1/", "/tokenize", "/detokenize")) else None
        assert all(op.get("security") == security for op in operations.values()), path


def test_without_an_api_key_nothing_declares_security(document):
    assert "securitySchemes" not in document["components"]
    assert all("security" not in op for ops in document["paths"].values() for op in ops.values())


@pytest.fixture(scope="module")
def engine_client(llama_dir):
    args = {"model": str(llama_dir), "model_id": MODEL, "engine_cls": "tests.support.fake_engine:FakeEngine", "max_num_seqs": 8}
    server = TextServer(AppConfig.from_args({**args, "max_model_len": 128}).models[0])
    with TestClient(create_app({MODEL: LocalBackend(server)})) as client:
        yield client
    server.driver.shutdown()


@pytest.mark.parametrize(
    "method, path, body, status, operation",
    [
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hello world", "max_tokens": 3, "logprobs": 1},
         "200", ("/v1/completions", "post")),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "logprobs": True,
                                          "top_logprobs": 1}, "200", ("/v1/chat/completions", "post")),
        ("GET", "/v1/models", None, "200", ("/v1/models", "get")),
        ("GET", f"/v1/models/{MODEL}", None, "200", ("/v1/models/{model_id}", "get")),
        ("GET", "/health", None, "200", ("/health", "get")),
        ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, "4XX", ("/v1/completions", "post")),
        ("GET", "/v1/models/gpt-4", None, "4XX", ("/v1/models/{model_id}", "get")),
    ],
)
def test_real_responses_fit_their_published_schemas(document, engine_client, method, path, body, status, operation):
    response = engine_client.request(method, path, json=body)
    assert response.status_code // 100 == int(status[0]), response.text
    spec = document["paths"][operation[0]][operation[1]]["responses"][status]
    schema = spec["content"]["application/json"]["schema"]
    jsonschema.Draft202012Validator({**schema, "components": document["components"]}).validate(response.json())
