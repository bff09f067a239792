"""A LLaVA checkpoint served as text: its decoder converted once into a text checkpoint of its own
(engine.formats.llava), greedy tokens equal to transformers' LlavaForConditionalGeneration on
text-only prompts. (Image inputs are not yet placed into prompts.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.formats import llava
from engine.formats.model_sources import resolve_model
from engine.generate.engine import LLMEngine
from engine.generate.images import ImageInput
from engine.generate.request import FinishReason, SamplingParams
from serve_app.media.images import content_hash
from tests.support.parity import (
    TIGHT,
    llava_greedy,
    make_prompts,
    png_data_uri,
    run_to_completion,
    tokens_of,
)
from tests.support.tiny_models import make_llava_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"))


def test_the_decoder_becomes_a_text_checkpoint_once(checkpoint, tmp_path):
    text = resolve_model(str(checkpoint), cache_dir=tmp_path)
    assert text != checkpoint and text.parent == tmp_path.resolve()
    config = json.loads((text / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (text / llava.VISION_LINK).resolve() == checkpoint.resolve()
    assert (text / "tokenizer.json").is_file() and (text / "preprocessor_config.json").is_file()
    assert resolve_model(str(checkpoint), cache_dir=tmp_path) == text  # a cache hit: built once


def test_text_prompts_equal_transformers_llava(checkpoint, tmp_path):
    import transformers

    engine = LLMEngine(EngineConfig(model=str(resolve_model(str(checkpoint), cache_dir=tmp_path)), **TIGHT))
    reference = transformers.LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = make_prompts(lengths=(5, 19, 40), vocab=300)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens_of(outputs[str(i)]) == expected


def image(seed: int) -> ImageInput:
    pixels = np.random.default_rng(seed).standard_normal((3, 32, 32)).astype(np.float32)
    return ImageInput(content_hash(pixels), pixels)


def with_images(text: list[int], count: int, placeholder: int, per_image: int, after: int = 3) -> list[int]:
    """`text` with `count` runs of placeholders, the first after `after` tokens, then one every 5."""
    prompt, at = list(text), after
    for _ in range(count):
        prompt[at:at] = [placeholder] * per_image
        at += per_image + 5
    return prompt


@pytest.fixture(scope="module")
def vision_engine(checkpoint, tmp_path_factory):
    text = resolve_model(str(checkpoint), cache_dir=tmp_path_factory.mktemp("cache"))
    return LLMEngine(EngineConfig(model=str(text), **{**TIGHT, "max_model_len": 160, "num_pages": 120,
                                                      "max_num_batched_tokens": 48}, image_slots=3))


@pytest.mark.parametrize("count", [1, 2])
def test_prompts_with_images_equal_transformers(vision_engine, checkpoint, count):
    """Greedy tokens of prompts with one and with two images (read in several steps: the step
    budget is smaller than the prompt) equal LlavaForConditionalGeneration's."""
    import transformers

    reference = transformers.LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    placeholder, per_image = vision_engine.image_token_id, vision_engine.images.tokens_per_image
    images = tuple(image(seed) for seed in range(count))
    prompt = with_images(make_prompts(lengths=(14,), vocab=300, seed=count)[0], count, placeholder, per_image)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    vision_engine.add_request("r", prompt, params, images=images)
    deltas = []
    while vision_engine.has_work():
        deltas += vision_engine.step()
    with torch.no_grad():
        pixels = torch.tensor(np.stack([i.pixels for i in images]))
        expected = reference.generate(torch.tensor([prompt]), pixel_values=pixels, max_new_tokens=10,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert tokens_of(deltas) == expected
    assert deltas[0].num_prompt_tokens == len(prompt)
    assert vision_engine.images.held() == 0


def test_the_same_image_in_a_second_turn_hits_the_prefix_cache(vision_engine):
    placeholder, per_image = vision_engine.image_token_id, vision_engine.images.tokens_per_image
    first = with_images(make_prompts(lengths=(10,), vocab=300, seed=7)[0], 1, placeholder, per_image, after=1)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    turn = run_to_completion_with_images(vision_engine, first, (image(11),), params)
    follow_up = first + tokens_of(turn) + [5, 6, 7]
    again = run_to_completion_with_images(vision_engine, follow_up, (image(11),), params)
    assert again[0].num_cached_tokens >= per_image  # the image's pages were reused
    other = run_to_completion_with_images(vision_engine, follow_up, (image(12),), params)
    assert other[0].num_cached_tokens < 1 + per_image  # another image at the same place: only the text before it


def run_to_completion_with_images(engine, prompt, images, params):
    engine.add_request("turn", prompt, params, images=images)
    deltas = []
    while engine.has_work():
        deltas += engine.step()
    return deltas


def test_a_request_waits_while_its_image_slots_are_held(vision_engine):
    """Three images hold all three slots; a request with a fourth waits (not a 400) until they are
    given back, then answers as it does alone; one aborted while waiting ends at once."""
    placeholder, per_image = vision_engine.image_token_id, vision_engine.images.tokens_per_image
    text = make_prompts(lengths=(14,), vocab=300, seed=21)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    one, three = with_images(text, 1, placeholder, per_image), with_images(text, 3, placeholder, per_image)
    alone = tokens_of(run_to_completion_with_images(vision_engine, one, (image(34),), params))
    vision_engine.add_request("three", three, params, images=(image(31), image(32), image(33)))
    vision_engine.add_request("fourth", one, params, images=(image(34),))
    vision_engine.add_request("gone", one, params, images=(image(35),))
    assert vision_engine.images.held() == 3 and vision_engine.stats().num_waiting == 3
    deltas = vision_engine.step()
    vision_engine.abort("gone")
    while vision_engine.has_work():
        deltas += vision_engine.step()
    by_request = {rid: [d for d in deltas if d.request_id == rid] for rid in ("three", "fourth", "gone")}
    assert [d.finish_reason for d in by_request["gone"]] == [FinishReason.ABORT]
    assert tokens_of(by_request["fourth"]) == alone
    assert deltas.index(by_request["three"][-1]) < deltas.index(by_request["fourth"][0])  # it waited
    assert vision_engine.images.held() == 0 and vision_engine.stats().num_waiting == 0


def test_image_requests_are_checked(vision_engine, llama_dir):
    placeholder, per_image = vision_engine.image_token_id, vision_engine.images.tokens_per_image
    text = make_prompts(lengths=(30,), vocab=300)[0]
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match="places 1 images") as caught:
        vision_engine.validate(with_images(text, 1, placeholder, per_image), params, images=())
    assert caught.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="places 0 images"):
        vision_engine.validate(text, params, images=(image(0),))
    with pytest.raises(InvalidRequestError, match="more distinct images than the 3"):
        vision_engine.validate(with_images(text, 4, placeholder, per_image), params,
                               images=tuple(image(s) for s in range(4)))
    text_engine = LLMEngine(EngineConfig(model=str(llama_dir), **TIGHT))
    with pytest.raises(InvalidRequestError, match="this model takes no images"):
        text_engine.validate(text, params, images=(image(0),))


def test_chat_with_images_through_the_openai_client(checkpoint, tmp_path):
    """image_url parts through the app and the official client: the answer is transformers' greedy
    one for the same prompt and pixels (one image, then two); the image repeated in the second turn
    is a prefix-cache hit (the metric); a text-only model refuses images with a 400."""
    from tests.support.serving_helpers import app_in_process

    first, first_image = png_data_uri(1)
    second, second_image = png_data_uri(2)
    args = dict(cache_dir=str(tmp_path), max_model_len=160, num_pages=120, page_size=4, max_num_batched_tokens=64)
    with app_in_process(checkpoint, "tiny-llava", **args) as (server, http, client):
        def expected(messages, images):
            return llava_greedy(checkpoint, messages, images, 8)

        def ask(content):
            return client.chat.completions.create(model="tiny-llava", max_tokens=8, temperature=0.0,
                                                  extra_body={"ignore_eos": True},
                                                  messages=[{"role": "user", "content": content}])

        one = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": first}}]
        answer = ask(one)
        text, prompt_tokens = expected([{"role": "user", "content": "What is this?\n<image>"}], [first_image])
        assert answer.choices[0].message.content == text and answer.usage.prompt_tokens == prompt_tokens

        def hits():
            return sum(float(line.split()[-1]) for line in http.get("/metrics").text.splitlines()
                       if line.startswith("vllm:prefix_cache_hits_total"))

        before = hits()
        two = one + [{"type": "text", "text": "And this?"}, {"type": "image_url", "image_url": {"url": second}}]
        answer = ask(two)
        text, prompt_tokens = expected([{"role": "user", "content": "What is this?\n<image>\nAnd this?\n<image>"}],
                                       [first_image, second_image])
        assert answer.choices[0].message.content == text and answer.usage.prompt_tokens == prompt_tokens
        assert hits() - before >= 16  # the first image's pages, written by the first request
        refused = http.post("/v1/chat/completions", json={"model": "tiny-llava", "messages": [{"role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]})
        assert refused.status_code == 400 and "data: URI" in refused.json()["error"]["message"]


def test_a_text_model_refuses_images(llama_dir):
    from serve_app.errors import BadRequest
    from serve_app.protocol.chat import ChatMessage
    from serve_app.text.tokenizer import PromptTokenizer

    message = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]})
    with pytest.raises(BadRequest, match="takes no images") as caught:
        PromptTokenizer(str(llama_dir), "tiny").chat([message])
    assert caught.value.param == "messages"


def test_the_processors_chat_template_is_the_tokenizers(checkpoint, tmp_path):
    """llava-hf keeps the chat template in the processor's chat_template.json."""
    import shutil

    from engine.formats.transformers_files import load_tokenizer

    copy = tmp_path / "llava"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    jinja = copy / "chat_template.jinja"  # where transformers 4.57 saves it; older ones: tokenizer_config.json
    template = jinja.read_text() if jinja.is_file() else config.pop("chat_template")
    jinja.unlink(missing_ok=True)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    (copy / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_tokenizer(copy).chat_template == template
    (copy / "chat_template.json").unlink()
    assert not load_tokenizer(copy).chat_template


def test_images_from_an_allowed_host(checkpoint, tmp_path):
    """http(s) image URLs are fetched from the hosts the operator allows (the same answer as the
    image inline); another host and a redirect are 400s."""
    import http.server
    import threading

    from tests.support.serving_helpers import app_in_process

    uri, _ = png_data_uri(5)
    png = __import__("base64").b64decode(uri.partition(",")[2])

    class Images(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 -- http.server's name
            if self.path == "/moved.png":
                self.send_response(302)
                self.send_header("Location", "http://elsewhere.invalid/a.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    args = dict(cache_dir=str(tmp_path), max_model_len=160, num_pages=120, page_size=4, max_num_batched_tokens=64,
                image_url_hosts=["127.0.0.1"])
    try:
        with app_in_process(checkpoint, "tiny-llava", **args) as (_, http, client):
            def ask(url):
                return http.post("/v1/chat/completions", json={
                    "model": "tiny-llava", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})

            fetched, inline = ask(f"{base}/a.png"), ask(uri)
            assert fetched.status_code == 200
            assert fetched.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]
            moved = ask(f"{base}/moved.png")
            assert moved.status_code == 400 and "not followed" in moved.json()["error"]["message"]
            other = ask("http://localhost:1/a.png")
            assert other.status_code == 400 and "only from the hosts it allows (127.0.0.1)" in other.json()["error"][
                "message"]
    finally:
        server.shutdown()
