"""Token ids to text, one token at a time, and stop strings over the resulting text stream.

`IncrementalDetokenizer` decodes a sliding window of ids and withholds text while it ends in an
incomplete character (U+FFFD), so a multi-byte character split over tokens comes out whole.
`StopMatcher` finds the first stop string in the stream, also across token boundaries, and holds
back exactly the tail that could still begin a stop string. `TextStream` chains the two for one
choice and tracks each token's text offset. `TokenStrings` gives the text and raw
bytes of single tokens for logprobs.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable, Optional

from tokenizers import decoders

if TYPE_CHECKING:  # transformers is imported where a tokenizer is loaded, not by the app's builder
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 4
"""Prompt tokens decoded before the first output token, so it gets the spacing it has mid-text."""


class IncrementalDetokenizer:
    """Invariant: the pieces returned by `push` and `flush` concatenate to the decoding of all
    pushed ids (after the context), and no piece ends inside a multi-byte character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context_ids: Iterable[int] = (),
                 keep_special: frozenset[int] = frozenset()):
        """Special tokens are skipped, except those in `keep_special` (the markup a chat's readers
        read that a model's tokenizer marks special: tool-call and thinking tags, gpt-oss's harmony
        messages), which decode to their text."""
        self._tokenizer = tokenizer
        self._keep = keep_special
        self._drop = special_ids(tokenizer) - keep_special if keep_special else frozenset()
        self._ids = list(context_ids)[-CONTEXT_TOKENS:]
        self._prefix = 0  # ids[_prefix:_read] decode to the text returned last
        self._read = len(self._ids)  # ids[_read:] have not produced text yet

    def push(self, token_id: int) -> str:
        """The new text that `token_id` completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still withheld (an incomplete character decodes to U+FFFD); call at the end."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        done = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(done) or (text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._keep:
            return self._tokenizer.decode([t for t in ids if t not in self._drop], skip_special_tokens=False)
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id that `decode(skip_special_tokens=True)` drops."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}


class StopMatcher:
    """Cuts a text stream at the first stop string.

    Invariant: text that `push` returned never contains a stop string nor ends with a proper prefix
    of one, so a stop string split over several pushes is still found, and cut, whole.
    """

    def __init__(self, stops: Iterable[str]):
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The part of `text` (after what was held back) that is safe to emit; sets `stopped` when
        a stop string matched (the text from the stop string on is dropped)."""
        if self.stopped:
            return ""
        buffer = self._held + text
        hit = self._first_match(buffer)
        if hit is not None:
            self.stopped, self._held = True, ""
            return buffer[:hit]
        keep = self._partial_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """What was held back, once the stream ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> Optional[int]:
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_len(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        for k in range(min(len(buffer), max((len(s) - 1 for s in self._stops), default=0)), 0, -1):
            if any(s.startswith(buffer[-k:]) for s in self._stops if len(s) > k):
                return k
        return 0


class TextStream:
    """The text of one choice: token ids in; text safe to emit and each token's offset out.

    Offsets count characters of the decoded text (before any stop string is cut), from
    `start_offset` on (the length of an echoed prompt).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        context_ids: Iterable[int] = (),
        stops: Iterable[str] = (),
        start_offset: int = 0,
        keep_special: frozenset[int] = frozenset(),
    ):
        self._detokenizer = IncrementalDetokenizer(tokenizer, context_ids, keep_special)
        self._stops = StopMatcher(stops)
        self._length = start_offset

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def push(self, token_ids: Iterable[int]) -> tuple[str, list[int]]:
        offsets, pieces = [], []
        for token_id in token_ids:
            offsets.append(self._length)
            pieces.append(self._detokenizer.push(token_id))
            self._length += len(pieces[-1])
        return self._stops.push("".join(pieces)), offsets

    def finish(self) -> str:
        """The text still withheld, once the engine finished the request."""
        text = self._stops.push(self._detokenizer.flush())
        return text if self._stops.stopped else text + self._stops.flush()


class TokenStrings:
    """Text and raw bytes of single tokens, for logprobs (cached per token id)."""

    _BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self._tokenizer = tokenizer
        self._byte_decoder = _byte_level_decoder(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = (text, self._raw_bytes(token_id, text))
        return self._cache[token_id]

    def _raw_bytes(self, token_id: int, text: str) -> list[int]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if self._byte_decoder is not None and piece is not None and all(c in self._byte_decoder for c in piece):
            return [self._byte_decoder[c] for c in piece]
        byte = self._BYTE_TOKEN.fullmatch(piece or "")
        return [int(byte.group(1), 16)] if byte else list(text.encode("utf-8"))


def _byte_level_decoder(tokenizer: PreTrainedTokenizerBase) -> Optional[dict[str, int]]:
    """GPT-2's unicode-to-byte table when the tokenizer is byte-level BPE, else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    # transformers is heavy: loaded on a replica with its tokenizer, never by the app builder
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}
