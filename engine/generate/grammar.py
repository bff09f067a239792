"""Structured output on the host: compiling a request's grammar and tracking each sequence's place
in it. Pure Python, numpy and llguidance (no jax).

llguidance (a Rust library) holds the model's vocabulary as bytes and, for a matcher at some point
of a grammar, computes the bitmask of the tokens that may come next (bit t of word t // 32). The
engine keeps one `GrammarState` per constrained sequence: the planner fills that sequence's row of
the step's bitmask from it, the device sets every other token's logit to -inf before sampling
(engine.generate.runner.sampler), and the sampled token is fed back with `advance`. Both run over a step's
rows at once on llguidance's thread pool (outside the GIL), writing straight into the step's
bitmask. A sequence whose grammar is complete (nothing but the end may follow) finishes at once
with reason `stop`.

Invariants: a matcher has consumed exactly the sequence's known output tokens (preemption keeps
them, so it needs no rollback); a mask never allows a token outside the grammar, nor one of the
ids the model has beyond the tokenizer's vocabulary.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import threading
import time
from pathlib import Path
from typing import Optional

import llguidance
import llguidance.numpy
import numpy as np

from engine.errors import InvalidRequestError
from engine.generate.request import Grammar

logger = logging.getLogger(__name__)

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON output as `json.dumps` writes it: no free whitespace, so a model cannot pad its output with
newlines until max_tokens. A schema may override these in its `x-guidance` object."""


COMPILED_GRAMMARS = 256
"""Compiled grammars a compiler remembers (the most recently used)."""


def mask_words(vocab_size: int) -> int:
    """32-bit words in one row of a token bitmask."""
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles grammars against one model's tokenizer. Thread-safe: the serving thread validates
    requests while the engine's loop makes matchers.

    The tokenizer's llguidance form is built on a thread of its own from construction (about a
    second for a 50k vocabulary), so a replica does not wait for it before it serves; the first
    constrained request waits for the rest of it. If it cannot be built (e.g. the model has no
    fast tokenizer), structured output is off and every grammar is refused with the reason."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self._executor = llguidance.LLExecutor()  # 80% of the CPUs, at most 32 threads
        self._built: concurrent.futures.Future = concurrent.futures.Future()
        # a request is checked on the serving thread, then its matcher made on the engine's, once per
        # choice: each grammar compiles once (lru_cache is thread-safe; errors are not cached)
        self.compile = functools.lru_cache(maxsize=COMPILED_GRAMMARS)(self._compile)
        threading.Thread(target=self._build, args=(model_dir, eos_token_ids), name="grammar-tokenizer",
                         daemon=True).start()

    def _build(self, model_dir: str | Path, eos_token_ids: tuple[int, ...]) -> None:
        start = time.perf_counter()
        try:
            import llguidance.hf  # imports transformers: here, not where the app is built

            from engine.formats.transformers_files import load_tokenizer

            hf_tokenizer = load_tokenizer(model_dir)
            eos = [t for t in eos_token_ids if t < self.vocab_size] or None
            tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        except BaseException as exc:  # noqa: BLE001 -- structured output is optional; no waiter may hang
            logger.warning("structured output is off for %s: %s", model_dir, exc)
            self._built.set_exception(exc)
            return
        self._built.set_result(tokenizer)
        logger.info("structured output: tokenizer of %d ids ready in %.2f s", self.vocab_size,
                    time.perf_counter() - start)

    def wait(self) -> bool:
        """Wait until the tokenizer is built; whether structured output is on."""
        return self._built.exception() is None

    @property
    def _tokenizer(self) -> llguidance.LLTokenizer:
        return self._built.result()

    def _compile(self, grammar: Grammar) -> str:
        """llguidance's form of `grammar`; InvalidRequestError (naming grammar.param) if it is invalid.
        Called through `compile`, which remembers the latest grammars."""
        if not self.wait():
            raise InvalidRequestError(f"this model cannot constrain its output ({self._built.exception()}); send "
                                      "the request without a response format or tool choice", grammar.param)
        try:
            if grammar.kind == "json_schema":
                text = llguidance.LLMatcher.grammar_from_json_schema(grammar.source, defaults=JSON_DEFAULTS)
            elif grammar.kind == "regex":
                text = llguidance.LLMatcher.grammar_from_regex(grammar.source)
            else:
                text = llguidance.LLMatcher.grammar_from_lark(grammar.source)
        except ValueError as exc:
            raise InvalidRequestError(f"invalid {_what(grammar)}: {exc}", grammar.param) from None
        error = llguidance.LLMatcher.validate_grammar(text, self._tokenizer)
        if error:
            raise InvalidRequestError(f"invalid {_what(grammar)}: {error}", grammar.param)
        return text

    def state(self, grammar: Grammar) -> "GrammarState":
        return GrammarState(llguidance.LLMatcher(self._tokenizer, self.compile(grammar)))

    def fill_masks(self, rows: list[tuple["GrammarState", int]], out: np.ndarray) -> None:
        """Write the bitmask of the tokens each state allows next into its row of `out`
        (i32[R, mask_words(vocab_size)]); other rows are left as they are."""
        if rows:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(s.matcher, i) for s, i in rows], out)

    def advance(self, fed: list[tuple["GrammarState", int]]) -> list[bool]:
        """Feed each state its sampled token; per state, whether its output is over: the grammar
        is complete, or it refused the token (a mask was not applied: logged)."""
        accepted = llguidance.numpy.consume_token_par(self._executor, [(s.matcher, t) for s, t in fed])
        for (state, token), ok in zip(fed, accepted):
            if not ok:
                logger.error("grammar refused token %d: %s", token, state.matcher.get_error())
        return [not ok or state.complete for (state, _), ok in zip(fed, accepted)]


class GrammarState:
    """Where one sequence's output stands in its grammar (its llguidance matcher)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    @property
    def complete(self) -> bool:
        """Nothing but the end of the output may follow (or the matcher failed)."""
        return self.matcher.is_stopped()


def after_prefix(grammar: Grammar, end: str, start: Optional[str] = None) -> Optional[Grammar]:
    """`grammar` applied after a free-text prefix that ends with the string `end` (and any
    whitespace after it): the output is that prefix then an answer `grammar` takes. Without
    `start`, the output begins inside the prefix; with it, the prefix is optional and opens with
    `start` (the output may be answer only). None for a Lark grammar, which cannot be nested."""
    answer = _lark_body(grammar)
    if answer is None:
        return None
    prefix = "thought ws?" if start is None else f"({json.dumps(start)} thought ws?)?"
    source = (f"start: {prefix} answer\n"
              f"thought[stop={json.dumps(end)}]: /(?s:.*)/\n"
              "ws: /[ \\t\\r\\n]+/\n"
              f"answer: {answer}\n")
    return Grammar("lark", source, grammar.param)


def _lark_body(grammar: Grammar) -> Optional[str]:
    """The Lark form of a JSON schema (written as `json.dumps` writes JSON, as `JSON_DEFAULTS`
    asks, unless the schema's own `x-guidance` says otherwise) or of a regular expression; None
    for a Lark grammar."""
    if grammar.kind == "json_schema":
        schema = json.loads(grammar.source)
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**JSON_DEFAULTS, **schema.get("x-guidance", {})}}
        return "%json " + json.dumps(schema)
    if grammar.kind == "regex":
        return "/" + grammar.source.replace("/", "\\/") + "/"
    return None


def _what(grammar: Grammar) -> str:
    return {"json_schema": "JSON schema", "regex": "regular expression", "lark": "grammar"}[grammar.kind]

