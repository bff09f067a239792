"""The engine's vocabulary: what goes in (a prompt and its sampling parameters) and what comes out
(token deltas). Pure Python; the serving layer imports this module and never jax.

The engine speaks token ids only. Text, stop strings, chat templates and OpenAI shapes belong to
the serving layer.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal, Optional

from engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20



def check_request(prompt_ids: list[int], params: "SamplingParams", vocab_size: int, max_model_len: int) -> None:
    """Raise InvalidRequestError if a request can never be served by a model of `vocab_size`
    tokens and `max_model_len` positions: an empty prompt, a token id outside the vocabulary, or
    prompt + max_tokens over the length (the message OpenAI's API gives for it)."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    total = len(prompt_ids) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens} for the completion). "
            "Please reduce the length of the prompt or of max_tokens.",
            "max_tokens",
        )
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"{name} names token id {bad}, outside the vocabulary [0, {vocab_size})", name)
    if params.grammar is not None and params.min_tokens:
        raise InvalidRequestError("min_tokens cannot be combined with a response format or tool choice: the "
                                  "grammar decides where the output ends; remove min_tokens", "min_tokens")



class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens, or the model's length limit
    ABORT = "abort"  # aborted by the caller (client disconnect, stop string matched upstream)


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A constraint the output must match (structured output): each step may only sample tokens
    that keep the output a prefix of a sentence of the grammar, and the output ends (finish reason
    `stop`) when the grammar is complete. Compiled by the engine (engine.generate.grammar); an invalid
    one is an InvalidRequestError naming `param`."""

    kind: Literal["json_schema", "regex", "lark"]
    source: str
    """A JSON schema as JSON text, a regular expression, or a Lark grammar (llguidance's syntax)."""
    param: str = "response_format"
    """The request field the grammar came from, named by errors."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token. Defaults are greedy decoding for 16 tokens."""

    max_tokens: int = 16
    """Number of new tokens to generate at most."""
    min_tokens: int = 0
    """EOS and stop token ids are ignored until this many tokens were generated."""
    temperature: float = 0.0
    """0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to at least top_p."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted once per previous occurrence in the generated tokens (OpenAI semantics)."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens seen in prompt or output (HF semantics)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling."""
    seed: Optional[int] = None
    """Randomness comes from (seed, position): a seeded request samples the same tokens whatever
    else is in the batch. None draws a seed when the request is added."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops (finish reason `stop`) after any of these tokens; it is kept in the output."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS tokens (benchmarks)."""
    logprobs: Optional[int] = None
    """None: no logprobs. k >= 0: the chosen token's logprob plus the k most likely (k <= 20)."""
    prompt_logprobs: Optional[int] = None
    """None: none. k >= 0: logprob of every prompt token given its prefix, plus the top k."""
    grammar: Optional[Grammar] = None
    """The output must match this grammar (None: free text)."""

    def __post_init__(self):
        _check(self.max_tokens >= 1, "max_tokens must be at least 1", "max_tokens")
        _check(self.min_tokens >= 0, "min_tokens must be non-negative", "min_tokens")
        _check(self.min_tokens <= self.max_tokens, "min_tokens must not exceed max_tokens", "min_tokens")
        _check(self.temperature >= 0.0, "temperature must be non-negative", "temperature")
        _check(self.top_k >= 0, "top_k must be non-negative (0 disables it)", "top_k")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]", "presence_penalty")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]", "frequency_penalty")
        _check(self.repetition_penalty > 0.0, "repetition_penalty must be positive", "repetition_penalty")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            _check(
                k is None or 0 <= k <= MAX_TOP_LOGPROBS,
                f"{name} must be between 0 and {MAX_TOP_LOGPROBS}",
                name,
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_filtering(self) -> bool:
        """Whether top-k / top-p / min-p change the distribution (a sort over the vocabulary)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def needs_penalties(self) -> bool:
        """Whether logits depend on the tokens seen so far or on a bias (dense per-row arrays)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """The logprob of one token, with the most likely alternatives at that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, logprob) pairs, most likely first; as many as the request asked for."""


@dataclasses.dataclass
class TokenDelta:
    """New output of one request after one engine step. The first delta of a request carries its
    prompt bookkeeping; the last one has `finish_reason` set."""

    request_id: str
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]] = None
    """One per entry of `token_ids` when the request asked for logprobs."""
    finish_reason: Optional[FinishReason] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (set on the first delta)."""
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    """On the first delta, when asked: one per prompt token; the first is None (no prefix)."""
    scheduled_time: Optional[float] = None
    """On the first delta: when the engine first scheduled the request (time.time()), so that
    its wait for a batch slot and pages can be told from its prefill."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
