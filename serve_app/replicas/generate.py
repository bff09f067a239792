"""The text generation replica (deployments `TextServer-<model_id>`): one tokenizer and one async
engine per replica.

The path of one request through a replica: the ingress sends a parsed OpenAI request; `_plan` turns
it, on a worker thread, into token ids (a chat template for chat) and one engine request per choice
(n > 1 fans out as ids f"{rid}-{i}" with seeds seed + i); `_run` reads each engine request's token
deltas into `ChoiceUpdate`s (serve_app.text.choices: incremental text, stop strings, logprobs,
counts); the choices are merged and formatted as OpenAI chunks (batched over `stream_batch_ms`) or
as one response.

A request for a LoRA adapter arrives with its `LoraRef`: the replica reads the adapter on first
use (serve_app.replicas.adapters) and runs the request's engine requests with it.

Invariants: everything raised to the caller is an `APIError` (it survives the Ray hop); closing a
stream (client gone, stop string matched) aborts its engine requests, returning their KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Union

from engine.config import EngineConfig
from engine.formats.checkpoint_config import generation_defaults
from engine.generate.driver import AsyncEngine
from engine.generate.images import ImageInput
from engine.generate.request import Grammar, SamplingParams
from engine.stats import EngineStats
from serve_app.config import ModelConfig, TracingConfig
from serve_app.errors import BadRequest
from serve_app.media.images import (
    ImageProcessor,
    content_hash,
    decode_image,
    fetch_image,
    parse_data_uri,
)
from serve_app.protocol.chat import ChatCompletionRequest
from serve_app.protocol.completions import CompletionRequest
from serve_app.protocol.context import LoraRef, RequestContext
from serve_app.replicas.adapters import ReplicaAdapters
from serve_app.replicas.base import Replica, api_errors
from serve_app.replicas.metrics import RequestTracker
from serve_app.sampling_defaults import SamplingDefaults, effective_defaults
from serve_app.tasks import GENERATE
from serve_app.text import harmony, reasoning
from serve_app.text.choices import ChoiceReader, OutputRules
from serve_app.text.detokenize import TokenStrings, special_ids
from serve_app.text.responses import (
    ChatFormatter,
    ChoiceCounts,
    ChoiceUpdate,
    CompletionFormatter,
    total_usage,
)
from serve_app.text.streams import ChunkPacing, merge_batches, with_keepalive
from serve_app.text.tokenizer import PromptInput
from serve_app.text.tool_calls import (
    PARSER_TAGS,
    CallStream,
    NamedCallStream,
    RequiredCallStream,
    ToolCallStream,
    default_parser,
    named_schema,
    required_schema,
)
from serve_app.tracing import Tracing

logger = logging.getLogger(__name__)

OpenAIRequest = Union[CompletionRequest, ChatCompletionRequest]
CallReader = Callable[[], CallStream]
ThoughtReader = Callable[[], reasoning.ReasoningStream]


@dataclasses.dataclass(frozen=True)
class ChoiceRequest:
    """One engine request: choice `index` of a response."""

    index: int
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    images: tuple[ImageInput, ...] = ()
    """The prompt's images, one per run of placeholders (engine.generate.images)."""


@dataclasses.dataclass(frozen=True)
class RequestPlan:
    """A request turned into engine requests, and how to shape their output."""

    choices: list[ChoiceRequest]
    n: int
    rules: OutputRules
    formatter: Union[CompletionFormatter, ChatFormatter]
    adapter: Optional[str] = None
    """The engine's name of the LoRA adapter the request runs with (None: the base model)."""
    span: object = None
    """The request's `generate` span (None: tracing is off); each engine request adds its own."""


class TextServer(Replica):
    """One replica of a text generation model: tokenizer + async engine + metrics."""

    task = GENERATE
    driver_class = AsyncEngine
    driver: AsyncEngine

    def __init__(self, config: ModelConfig, tracing: Optional[TracingConfig] = None):
        self.tracing = Tracing.to_endpoint(tracing.otlp_traces_endpoint if tracing else None,
                                           "jax-serve-model-server")
        super().__init__(config)

    def _set_up(self, config: ModelConfig, model_dir: Path, engine_config: EngineConfig, engine: Any) -> None:
        self.tokenizer = self.prompts.hf
        checkpoint = generation_defaults(model_dir, SamplingDefaults.model_fields)
        self.sampling_defaults = effective_defaults(config.sampling_defaults, checkpoint)
        """The sampling values of requests that leave them unset (serve_app.sampling_defaults)."""
        self._tool_parser = config.tool_call_parser or default_parser(self.tokenizer.chat_template)
        parser = config.reasoning_parser or reasoning.default_parser(self.tokenizer.chat_template)
        self._harmony = harmony.PARSER in (self._tool_parser, parser)
        """gpt-oss's format: one reader makes every chat's thinking, answer and tool calls."""
        self._harmony_thinks = parser != "none"
        tool_tags = harmony.TAGS if self._harmony else PARSER_TAGS[self._tool_parser]
        self._tool_tags = _special_tags(self.tokenizer, tool_tags)
        self._thinks = parser not in (None, "none") and not self._harmony
        self._think_tags = _special_tags(self.tokenizer, reasoning.TAGS) if self._thinks else frozenset()
        self._strings = TokenStrings(self.tokenizer)
        self._image_layout = self.driver.image_layout
        """(placeholder token id, tokens per image) of a vision-language model, else None."""
        self._image_processor = ImageProcessor.from_dir(model_dir) if self._image_layout else None
        self._max_image_pixels = config.max_image_pixels
        self._image_fetch = functools.partial(fetch_image, hosts=frozenset(h.lower() for h in config.image_url_hosts),
                                              max_bytes=config.max_image_bytes, timeout_s=config.image_fetch_timeout_s)
        self.pacing = ChunkPacing(config.stream_batch_ms / 1000.0, config.stream_chunks_per_s)
        """The chunk interval of each open stream (they share stream_chunks_per_s)."""
        self._keepalive_s = config.stream_keepalive_s
        self._adapters = (ReplicaAdapters(self.driver.add_adapter, self.driver.remove_adapter, config.max_cpu_loras)
                          if engine_config.max_loras else None)

    def _engine_stats(self) -> EngineStats:
        return self.driver.stats()

    def card(self) -> dict[str, Any]:
        return {**super().card(), "sampling_defaults": self.sampling_defaults}

    @property
    def max_model_len(self) -> int:
        return self.driver.stats().max_model_len

    # ---- called through deployment handles ----

    async def stream_chunks(self, request: OpenAIRequest, context: RequestContext) -> AsyncIterator[list[str]]:
        """JSON chunks of a streamed response, in batches; with include_usage, a last usage chunk."""
        with self.pacing.opened():
            async with self._planned(request, context) as plan:
                finals = []
                batches = merge_batches(self._runs(plan, context.arrival_time), self.pacing.interval,
                                        flush=lambda update: update.finish_reason is not None)
                # closed with this stream (a client gone): its engine requests end now, not when collected
                async with contextlib.aclosing(with_keepalive(batches, self._keepalive_s)) as kept:
                    async for batch in kept:  # [] while there is no output
                        finals += [u for u in batch if u.finish_reason is not None]
                        yield [plan.formatter.chunk(u).model_dump_json() for u in batch]
                if request.include_usage:
                    yield [plan.formatter.usage_chunk(total_usage(finals, plan.n)).model_dump_json()]

    async def respond(self, request: OpenAIRequest, context: RequestContext) -> str:
        """The JSON of a whole (non-streamed) response."""
        async with self._planned(request, context) as plan:
            choices = {c.index: ChoiceUpdate(c.index) for c in plan.choices}
            async for batch in merge_batches(self._runs(plan, context.arrival_time)):
                for update in batch:
                    choices[update.index].extend(update)
            finals = [choices[i] for i in sorted(choices)]
            return plan.formatter.response(finals, total_usage(finals, plan.n)).model_dump_json()

    async def load_adapter(self, lora: LoraRef) -> str:
        """Read an adapter now (POST /v1/load_lora_adapter), refusing one the engine cannot serve."""
        with api_errors():
            async with self._adapter(lora, "lora_path"):
                return ""

    @contextlib.asynccontextmanager
    async def _planned(self, request: OpenAIRequest, context: RequestContext) -> AsyncIterator[RequestPlan]:
        """The request's plan, with its adapter held and its `generate` span open (a child of the
        ingress's; None when tracing is off) while it runs; what fails is an APIError on the span."""
        span = self.tracing.start(self.task, context.trace, **{
            "gen_ai.request.model": request.model, "jax_serve.model_id": self.model_id,
            "jax_serve.lora": context.lora.name if context.lora else None, "jax_serve.choices": request.n,
            "jax_serve.stream": bool(request.stream)})
        try:
            with api_errors(span):
                images = await self._images(request)
                async with self._adapter(context.lora) as adapter:
                    yield await self._prepare(request, adapter, span, images)
        finally:
            if span is not None:
                span.end()

    def _adapter(self, lora: Optional[LoraRef], param: str = "model"):
        """An async context holding `lora` (read first if this replica does not hold it) while a
        request runs with it; it yields the engine's name of the adapter (None: the base model)."""
        if lora is None:
            return contextlib.nullcontext()
        if self._adapters is None:
            raise BadRequest(f"model {self.model_id!r} serves no LoRA adapters; set max_loras in its config", param)
        return self._adapters.lease(lora, param)

    # ---- requests to engine requests ----

    async def _prepare(self, request: OpenAIRequest, adapter: Optional[str], span,
                       images: tuple[ImageInput, ...]) -> RequestPlan:
        """`_plan` on a worker thread: a long prompt's template and tokenizing or a grammar's first
        compile must not hold up the streams this event loop serves (the tokenizer releases the
        GIL). A client gone meanwhile drops the plan: nothing is queued in the engine until `_run`."""
        return await asyncio.to_thread(self._plan, request, adapter, span, images)

    def _plan(self, request: OpenAIRequest, adapter: Optional[str] = None, span=None,
              images: tuple[ImageInput, ...] = ()) -> RequestPlan:
        """`images`: the chat's images (`_images`), in the order of its image parts."""
        chat = isinstance(request, ChatCompletionRequest)
        prompts, params, calls, thinking = self._chat_prompt(request) if chat else self._prompts(request)
        self.prompts.check_token_ids([t for t, _ in params.logit_bias], "logit_bias")
        self.prompts.check_token_ids(params.stop_token_ids, "stop_token_ids")
        for prompt in prompts:
            self.driver.validate(prompt.ids, params, adapter, images)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        n, logprobs = request.n, params.logprobs is not None
        keep_special = self._kept_tags(request, params) if chat else frozenset()
        rules = OutputRules(stops=request.stops, echo=not chat and request.echo,
                            drop_output=not chat and request.max_tokens == 0, logprobs=logprobs,
                            keep_special=keep_special, calls=calls, reasoning=thinking)
        choices = [ChoiceRequest(p * n + i, f"{request_id}-{p * n + i}", prompt, _seeded(params, i), images)
                   for p, prompt in enumerate(prompts) for i in range(n)]
        formatter = (ChatFormatter if chat else CompletionFormatter)(request_id, request.model, self._strings, logprobs)
        return RequestPlan(choices, n, rules, formatter, adapter, span)

    def _prompts(self, request: CompletionRequest) -> tuple[list[PromptInput], SamplingParams, None, None]:
        params = request.apply_defaults(request.to_sampling_params(), self.sampling_defaults)
        return [self.prompts.prompt(p) for p in request.prompts], params, None, None

    def _chat_prompt(self, request: ChatCompletionRequest) -> tuple[list[PromptInput], SamplingParams,
                                                                    Optional[CallReader], Optional[ThoughtReader]]:
        """A chat's prompt and sampling, and how to read its tool calls and thinking (None: none)."""
        prompt = self.prompts.chat(request.messages, request.tools if request.tool_mode != "none" else (),
                                   template_kwargs=request.template_kwargs(), image_tokens=self._image_layout)
        params = request.to_sampling_params(default_max_tokens=self._room_after(prompt))
        params = request.apply_defaults(params, self.sampling_defaults)
        params, calls = self._tool_plan(request, params)
        thinking = None
        if self._harmony:
            calls = self._harmony_reader(request, params, calls)
        elif self._thinks:  # a constraint applies to the answer, after the thinking
            grammar, inside = reasoning.after_thinking(params.grammar, prompt.rendered)
            params = dataclasses.replace(params, grammar=grammar)
            thinking = functools.partial(reasoning.ReasoningStream, inside)
        return [prompt], params, calls, thinking

    def _harmony_reader(self, request: ChatCompletionRequest, params: SamplingParams,
                        calls: Optional[CallReader]) -> Optional[CallReader]:
        """A harmony chat's reader of its messages, unless decoding is constrained: a grammar's text
        has no channels (then the forced calls' reader reads it, or nothing does)."""
        if params.grammar is not None:
            return None if request.tool_mode == "auto" else calls
        return functools.partial(harmony.HarmonyStream, request.tool_mode == "auto", self._harmony_thinks)

    def _kept_tags(self, request: ChatCompletionRequest, params: SamplingParams) -> frozenset[int]:
        """The special tokens a chat's readers read, which its text therefore keeps."""
        if self._harmony:
            return self._tool_tags if params.grammar is None else frozenset()
        return (self._tool_tags if request.tool_mode == "auto" else frozenset()) | self._think_tags

    def _tool_plan(self, request: ChatCompletionRequest, params: SamplingParams) -> tuple[SamplingParams,
                                                                                          Optional[CallReader]]:
        """How tool calls come out: `auto` parses the model's own format; `required` and a named
        function constrain the output to the tools' schemas (a grammar naming `tools` in errors)."""
        mode = request.tool_mode
        if mode == "none":
            return params, None
        if mode == "auto":
            return params, functools.partial(ToolCallStream, self._tool_parser)
        if mode == "required":
            schema = required_schema([t.model_dump(exclude_none=True) for t in request.tools],
                                     request.parallel_tool_calls)
            calls: CallReader = RequiredCallStream
        else:
            name = request.tool_choice.function.name
            schema = named_schema(next(t.function.parameters for t in request.tools if t.function.name == name))
            calls = functools.partial(NamedCallStream, name)
        return dataclasses.replace(params, grammar=Grammar("json_schema", json.dumps(schema), "tools")), calls

    async def _images(self, request: OpenAIRequest) -> tuple[ImageInput, ...]:
        """A chat's images, fetched, decoded and preprocessed on worker threads (not this loop)."""
        if not isinstance(request, ChatCompletionRequest):
            return ()
        urls = [url for message in request.messages for url in message.image_urls]
        if urls and self._image_processor is None:
            raise BadRequest(f"model {self.model_id!r} takes no images; send text only, or a vision-language model",
                             "messages")
        return tuple(await asyncio.gather(*(asyncio.to_thread(self._image, url) for url in urls)))

    def _image(self, url: str) -> ImageInput:
        """An image part's preprocessed pixels: a data: URI, or an allowed host's http(s) URL, decoded
        (refused past max_image_pixels)."""
        data = parse_data_uri(url) if url[:5].lower() == "data:" else self._image_fetch(url)
        pixels = self._image_processor(decode_image(data, self._max_image_pixels))
        return ImageInput(content_hash(pixels), pixels)

    def _room_after(self, prompt: PromptInput) -> int:
        """Tokens left in the context after the prompt (at least 1, so that the engine's own
        length check reports a prompt that does not fit)."""
        return max(1, self.driver.stats().max_model_len - len(prompt.ids))

    # ---- engine requests to choice updates ----

    def _runs(self, plan: RequestPlan, arrival_time: float) -> list[AsyncIterator[ChoiceUpdate]]:
        return [self._run(plan, choice, arrival_time) for choice in plan.choices]

    async def _run(self, plan: RequestPlan, choice: ChoiceRequest, arrival_time: float) -> AsyncIterator[ChoiceUpdate]:
        """The updates of one choice; the last one has the finish reason and counts. Returning
        early (a stop string) or being closed aborts the engine request."""
        tracker = self.metrics.track(choice.request_id, arrival_time)
        reader = ChoiceReader(self.tokenizer, choice.index, choice.prompt, plan.rules)
        scheduled = None  # when the engine first scheduled it (its first delta says)
        try:
            deltas = self.driver.generate(choice.request_id, choice.prompt.ids, choice.params, plan.adapter,
                                          choice.images)
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    tracker.on_tokens(len(delta.token_ids))
                    scheduled = scheduled or delta.scheduled_time
                    update = reader.read(delta)
                    if update is not None:
                        yield update
                    if reader.reason is not None:
                        return
        finally:
            reason, counts = reader.reason or "abort", reader.counts
            tracker.finish(reason, counts.prompt_tokens, counts.completion_tokens, counts.cached_tokens)
            _trace_engine_request(self.tracing, plan.span, choice.request_id, tracker, scheduled, reason, counts)


def _trace_engine_request(tracing, parent, request_id: str, tracker: RequestTracker, scheduled: Optional[float],
                          reason: str, counts: ChoiceCounts) -> None:
    """The engine request's span under the request's (`parent`; None: not traced), with its phases:
    queued (until the engine first scheduled it), prefill (until its first token), decode (the rest)."""
    if parent is None:
        return
    end = time.time()
    span = tracing.child("engine_request", parent, tracker.started, end, **{
        "jax_serve.request_id": request_id, "gen_ai.usage.input_tokens": counts.prompt_tokens,
        "gen_ai.usage.output_tokens": counts.completion_tokens, "jax_serve.cached_tokens": counts.cached_tokens,
        "gen_ai.response.finish_reasons": (reason,)})
    first = tracker.first_token or end
    if scheduled is not None:
        tracing.child("queued", span, tracker.started, scheduled)
    tracing.child("prefill", span, scheduled or tracker.started, first)
    if tracker.first_token is not None:
        tracing.child("decode", span, first, end)


def _special_tags(tokenizer, tags: tuple[str, ...]) -> frozenset[int]:
    """The ids of `tags` that `tokenizer` has as special tokens (decoding would drop them)."""
    vocab = tokenizer.get_vocab()
    return frozenset(vocab[t] for t in tags if t in vocab) & special_ids(tokenizer)


def _seeded(params: SamplingParams, i: int) -> SamplingParams:
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
