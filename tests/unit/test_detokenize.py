"""serve_app.text.detokenize: incremental text that never splits a character, stop strings across token
boundaries with the minimal hold-back, per-token offsets and token bytes."""

from __future__ import annotations

import pytest
from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

from serve_app.text.detokenize import (
    IncrementalDetokenizer,
    StopMatcher,
    TextStream,
    TokenStrings,
)
from tests.support.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: the worst case for splitting characters."""
    to_char = bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([to_char[b] for b in text.encode("utf-8")])


def push_all(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.push(i) for i in ids]


def test_each_multibyte_character_comes_out_whole_when_split_over_byte_tokens(tokenizer):
    text = "a🚀b中文é!"
    ids = byte_token_ids(tokenizer, text)
    pieces = push_all(IncrementalDetokenizer(tokenizer), ids)
    # 🚀 is 4 bytes, 中 and 文 3, é 2: the pieces of their first bytes are empty.
    assert [p for p in pieces if p] == ["a", "🚀", "b", "中", "文", "é", "!"]
    assert len(pieces) == len(text.encode("utf-8"))
    assert "".join(pieces) == text


def test_real_tokenization_splits_a_character_and_it_is_still_whole(tokenizer):
    ids = tokenizer.encode("emoji 🚀🔥 中文")
    assert tokenizer.convert_ids_to_tokens(ids)[-2:] == ["æĸ", "ĩ"]  # 文 is split over two tokens
    pieces = push_all(IncrementalDetokenizer(tokenizer), ids)
    assert pieces[-2:] == ["", "文"]
    assert "".join(pieces) == "emoji 🚀🔥 中文"


def test_flush_emits_an_incomplete_character_as_replacement(tokenizer):
    ids = byte_token_ids(tokenizer, "x🚀")[:3]  # "x" and two of the rocket's four bytes
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert push_all(detokenizer, ids) == ["x", "", ""]
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.flush() == ""


def test_special_tokens_are_skipped(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("Hello") + [im_end]
    assert push_all(IncrementalDetokenizer(tokenizer), ids) == ["Hello", ""]


def test_context_ids_are_not_emitted(tokenizer):
    prompt = tokenizer.encode("Hello")
    detokenizer = IncrementalDetokenizer(tokenizer, context_ids=prompt)
    assert push_all(detokenizer, tokenizer.encode(" world")) == [" world"]


def test_stop_string_inside_one_piece_is_cut_with_what_follows():
    stops = StopMatcher(["STOP"])
    assert stops.push("abcSTOPdef") == "abc"
    assert stops.stopped
    assert stops.push("more") == ""


def test_stop_string_split_over_pieces_is_found_and_never_emitted():
    stops = StopMatcher(["world"])
    assert stops.push("hello wor") == "hello "  # "wor" could begin "world": held back
    assert not stops.stopped
    assert stops.push("l") == ""
    assert stops.push("d!") == ""
    assert stops.stopped


def test_hold_back_is_only_a_possible_stop_prefix():
    stops = StopMatcher(["lo"])
    assert stops.push("Hel") == "He"
    assert stops.push("p") == "lp"
    assert stops.push("xyz") == "xyz"
    assert stops.flush() == ""


def test_held_text_is_flushed_when_no_stop_comes():
    stops = StopMatcher(["abc"])
    assert stops.push("xxab") == "xx"
    assert stops.flush() == "ab"


def test_earliest_completed_stop_wins_among_several():
    stops = StopMatcher(["cd", "b"])
    assert stops.push("abcd") == "a"
    stops = StopMatcher(["zzz", "\n\n"])
    assert stops.push("one\n") == "one"
    assert stops.push("\ntwo") == ""
    assert stops.stopped


def test_no_stops_emits_everything():
    stops = StopMatcher([])
    assert stops.push("anything") == "anything"
    assert not stops.stopped


def test_text_stream_offsets_and_stop_across_tokens(tokenizer):
    ids = tokenizer.encode("Hello world")  # ["Hello", " world"]
    stream = TextStream(tokenizer, stops=["o w"], start_offset=3)
    text, offsets = stream.push(ids)
    assert (text, offsets) == ("Hell", [3, 8])
    assert stream.stopped


def test_text_stream_finish_flushes_held_text(tokenizer):
    stream = TextStream(tokenizer, stops=["world!"])
    assert stream.push(tokenizer.encode("Hello world")) == ("Hello ", [0, 5])
    assert stream.finish() == "world"
    assert not stream.stopped


def test_token_strings_give_raw_bytes_of_partial_characters(tokenizer):
    strings = TokenStrings(tokenizer)
    first, second = tokenizer.encode("emoji 🚀🔥 中文")[-2:]
    assert strings.text(first) == "\ufffd"
    assert strings.bytes(first) == list("文".encode("utf-8")[:2])
    assert strings.bytes(second) == list("文".encode("utf-8")[2:])
    hello = tokenizer.encode(" world")[0]
    assert (strings.text(hello), strings.bytes(hello)) == (" world", list(b" world"))
