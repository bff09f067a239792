"""A replica's tokenizer: prompts, chats and token ids, both ways (what /tokenize and /detokenize
answer, and what every model server feeds its engine).

Invariant: every token id that leaves here for an engine is inside the vocabulary, and every
problem with a prompt is a `BadRequest` naming its field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence, Union

import jinja2

from engine.formats.transformers_files import load_tokenizer
from serve_app.errors import BadRequest
from serve_app.protocol.admin import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from serve_app.protocol.chat import IMAGE_MARKER, ChatMessage, Tool


@dataclasses.dataclass(frozen=True)
class PromptInput:
    ids: list[int]
    text: Optional[str] = None
    """The prompt as the client sent it, when it was text (echoed as is)."""
    rendered: Optional[str] = None
    """A chat's prompt as its template rendered it."""


class PromptTokenizer:
    """The Hugging Face tokenizer of one model, with the checks a server needs.

    Thread-safety: requests are tokenized on worker threads while streams decode on the event
    loop. The fast tokenizer allows that as long as every call only reads it; an encode changes
    it only to reset truncation or padding settings that differ from the call's, which the encode
    in __init__ settles (no call here asks for truncation or padding)."""

    def __init__(self, model_dir: str, model_id: str):
        self.hf = load_tokenizer(model_dir)
        self.model_id = model_id
        self.vocab_size = len(self.hf)  # once: a fast tokenizer's len() builds its whole vocab dict
        self.hf.encode("")

    def prompt(self, prompt: Union[str, list[int]], param: str = "prompt") -> PromptInput:
        """Text (with the tokenizer's special tokens) or token ids (checked, used as given)."""
        if isinstance(prompt, str):
            ids = self.hf.encode(prompt)
            if not ids:
                raise BadRequest(f"{param} must not be empty", param)
            return PromptInput(ids, prompt)
        self.check_token_ids(prompt, param)
        return PromptInput(list(prompt))

    def chat(self, messages: list[ChatMessage], tools: Sequence[Tool] = (), add_generation_prompt: bool = True,
             add_special_tokens: bool = False, template_kwargs: Optional[dict[str, Any]] = None,
             image_tokens: Optional[tuple[int, int]] = None) -> PromptInput:
        """The conversation (and the tools, if any) rendered by the model's chat template, with
        `template_kwargs` as more template variables. `image_tokens`: (placeholder id, tokens per
        image) of a model that takes images: each image part becomes the placeholder's text, and
        its token is repeated once per image token (as the model's processor expands it)."""
        if not self.hf.chat_template:
            raise BadRequest(f"model {self.model_id!r} has no chat template; use /v1/completions", "messages")
        rendered = [m.template_dict() for m in messages]
        images = sum(len(m.image_urls) for m in messages)
        if images and image_tokens is None:
            raise BadRequest(f"model {self.model_id!r} takes no images; send text only, or a vision-language model",
                             "messages")
        if images:
            placeholder = self.hf.convert_ids_to_tokens(image_tokens[0])
            for message in rendered:
                message["content"] = message["content"].replace(IMAGE_MARKER, placeholder)
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] or None
        try:
            text = self.hf.apply_chat_template(rendered, tools=tool_dicts, tokenize=False,
                                               add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
        except jinja2.TemplateError as exc:
            raise BadRequest(f"the model's chat template rejected the messages: {exc}", "messages") from None
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens)
        if image_tokens is not None:
            token, per_image = image_tokens
            if ids.count(token) != images:
                raise BadRequest(f"the chat template placed {ids.count(token)} images of the {images} sent (or a "
                                 "text part names the image token); send images as image_url parts", "messages")
            ids = [t for i in ids for t in ([i] * per_image if i == token else [i])]
        return PromptInput(ids, rendered=text)

    def check_token_ids(self, ids: Any, param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"{param} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}", param)

    def tokenize(self, request: TokenizeRequest, max_model_len: int) -> TokenizeResponse:
        if request.messages is not None:
            ids = self.chat(request.messages, request.tools, request.add_generation_prompt,
                            bool(request.add_special_tokens)).ids
        else:
            add_special = request.add_special_tokens is not False
            ids = self.hf.encode(request.prompt, add_special_tokens=add_special)
        strs = self.hf.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_token_ids(request.tokens, "tokens")
        return DetokenizeResponse(prompt=self.hf.decode(request.tokens))
