"""Words of a transcript with their times: Whisper's text tokens grouped into words, each word timed
from its first token's start to its last token's end (OpenAI whisper's `split_to_word_tokens` and
`merge_punctuations`, as transformers' tokenizer groups them for `return_timestamps="word"`).

Tokens are first cut where their text decodes to whole characters (a character may take several
byte-level tokens); in languages written without spaces each such piece is a word, otherwise a
piece that starts with a space or is punctuation starts a new word. Opening punctuation then joins
the word after it, closing punctuation the word before it.
"""

from __future__ import annotations

import string
from typing import Callable, NamedTuple, Sequence

UNSPACED_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})
"""Languages written without spaces between words (Whisper's codes)."""
PREPEND_PUNCTUATION = "\"'“¡¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"


class Word(NamedTuple):
    text: str
    """As decoded, with its leading space."""
    start: float
    end: float


def group_words(decode: Callable[[list[int]], str], tokens: Sequence[int], times: Sequence[tuple[float, float]],
                language: str | None) -> list[Word]:
    """The words of text `tokens`, each timed (its first token's start, its last token's end) from
    `times` (one (start, end) per token). `decode`: token ids -> text."""
    pieces = _characters(decode, list(tokens))
    if language not in UNSPACED_LANGUAGES:
        pieces = _spaced(pieces)
    pieces = _merge_punctuation(pieces)
    return [Word(text, times[indices[0]][0], times[indices[-1]][1]) for text, indices in pieces]


def _characters(decode: Callable[[list[int]], str], tokens: list[int]) -> list[tuple[str, list[int]]]:
    """(text, token indices) pieces cut where the tokens so far decode to whole characters."""
    full = decode(tokens)
    pieces, current, offset = [], [], 0
    for index in range(len(tokens)):
        current.append(index)
        text = decode([tokens[i] for i in current])
        # a replacement character that the whole text also has there is part of the text
        if "\ufffd" not in text or full[offset + text.index("\ufffd")] == "\ufffd":
            pieces.append((text, current))
            current, offset = [], offset + len(text)
    return pieces


def _spaced(pieces: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """Pieces joined into words: a new word at a leading space or at punctuation."""
    words: list[tuple[str, list[int]]] = []
    for text, indices in pieces:
        if not words or text.startswith(" ") or text.strip() in string.punctuation:
            words.append((text, list(indices)))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + indices)
    return words


def _merge_punctuation(words: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    texts, indices = [w[0] for w in words], [list(w[1]) for w in words]
    following = len(texts) - 1  # opening punctuation joins the next word (right to left)
    for i in range(len(texts) - 2, -1, -1):
        if texts[i].startswith(" ") and texts[i].strip() in PREPEND_PUNCTUATION:
            texts[following], indices[following] = texts[i] + texts[following], indices[i] + indices[following]
            texts[i], indices[i] = "", []
        else:
            following = i
    previous = 0  # closing punctuation joins the word before (left to right)
    for j in range(1, len(texts)):
        if not texts[previous].endswith(" ") and texts[j] in APPEND_PUNCTUATION:
            texts[previous], indices[previous] = texts[previous] + texts[j], indices[previous] + indices[j]
            texts[j], indices[j] = "", []
        else:
            previous = j
    return [(text, index) for text, index in zip(texts, indices) if text and index]
