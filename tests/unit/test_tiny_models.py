"""tests/support/tiny_models.py's options beyond the defaults the other tests use."""

from __future__ import annotations

from tests.support import tiny_models


def test_padded_tokenizer_keeps_tokenization():
    """Filler tokens reach exactly the asked size, change no tokenization and decode to their text."""
    small, padded = tiny_models.make_tokenizer(), tiny_models.make_tokenizer(2000, pad_vocab=True)
    text = "The capital of France is Paris. 🚀 <f3>"
    assert len(padded) == 2000 and padded.encode(text) == small.encode(text)
    assert padded.decode([1999]) == "<f1507>"
