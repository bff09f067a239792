"""Cache-aware routing's pure parts (serve_app.http.routing): the text a request is keyed by, chained
chunk hashes, and the per-replica history that picks the replica holding the longest prefix. The
router itself runs in the Ray Serve integration tests (tests/integration/serving/test_serving_text.py)."""

from __future__ import annotations

from serve_app.http.routing import (
    CHUNK,
    MAX_CHUNKS,
    PrefixHistory,
    prefix_hashes,
    prompt_text,
)
from serve_app.protocol.chat import ChatCompletionRequest
from serve_app.protocol.completions import CompletionRequest

SYSTEM = "You are a careful assistant who answers questions about the engine in detail. " * 3


def chat(*contents: str) -> ChatCompletionRequest:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return ChatCompletionRequest(model="m", messages=[{"role": r, "content": c} for r, c in zip(roles, contents)])


def test_requests_are_keyed_by_their_prompts_text():
    assert prompt_text(chat("sys", "hi")) == "<|system|>sys<|user|>hi"
    parts = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                     {"type": "text", "text": "b"}]}])
    assert prompt_text(parts) == "<|user|>a\nb"
    assert prompt_text(CompletionRequest(model="m", prompt="Once upon")) == "Once upon"
    assert prompt_text(CompletionRequest(model="m", prompt=["first", "second"])) == "first"
    assert prompt_text(CompletionRequest(model="m", prompt=[5, 17, 3])) == "5 17 3"
    assert prompt_text(CompletionRequest(model="m", prompt=[[5, 17], [3]])) == "5 17"


def test_a_conversations_next_turn_shares_the_hashes_of_its_earlier_turns():
    first = prefix_hashes(prompt_text(chat(SYSTEM, "What is a page?")))
    second = prefix_hashes(prompt_text(chat(SYSTEM, "What is a page?", "A page holds 16 tokens.", "And a slot?")))
    assert len(first) == len(prompt_text(chat(SYSTEM, "What is a page?"))) // CHUNK
    assert second[: len(first)] == first and len(second) > len(first)
    other = prefix_hashes(prompt_text(chat(SYSTEM.upper(), "What is a page?")))
    assert not set(other) & set(first)  # chained: one differing chunk changes every hash after it
    assert prefix_hashes("x" * 10) == [] and len(prefix_hashes("x" * CHUNK * (MAX_CHUNKS + 5))) == MAX_CHUNKS


def test_the_replica_that_was_given_the_longest_prefix_wins():
    history = PrefixHistory(capacity=100)
    short, long = prefix_hashes("a" * CHUNK * 2), prefix_hashes("a" * CHUNK * 5)
    assert history.match(long, ["r1", "r2"]) == (None, 0)
    history.add("r1", short)
    history.add("r2", long)
    assert history.match(long, ["r1", "r2"]) == ("r2", 5)
    assert history.match(long, ["r1"]) == ("r1", 2)  # only the candidates count
    assert history.match(short, ["r1", "r2"]) == ("r1", 2)  # a tie: the first candidate
    history.forget("r2")
    assert history.match(long, ["r1", "r2"]) == ("r1", 2)
    history.add("r3", long)
    history.keep_only(["r3"])  # r1 scaled down
    assert history.match(short, ["r1", "r3"]) == ("r3", 2) and history.match(short, ["r1"]) == (None, 0)


def test_the_history_forgets_the_least_recently_routed_prefixes_first():
    history = PrefixHistory(capacity=3)
    old, new = prefix_hashes("o" * CHUNK * 2), prefix_hashes("n" * CHUNK * 2)
    history.add("r", old)
    history.add("r", new)
    assert history.match(new, ["r"]) == ("r", 2)
    assert history.match(old, ["r"]) == (None, 0)  # its first chunk was dropped
