"""serve_app.text.reasoning: thinking split from the answer, streamed and not, for any split of the
text; where the prompt opened the block; the default parser of a chat template."""

from __future__ import annotations

import json
import random

import pytest

from serve_app.text.reasoning import (
    ReasoningStream,
    Thought,
    after_thinking,
    default_parser,
    opened_by,
    split_reasoning,
)
from tests.support.harmony_models import HARMONY_TEMPLATE

CASES = [
    # (output, the prompt opened the block, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "\nLet me see.\n", "\n\nParis."),
    ("Let me see.</think>Paris.", True, "Let me see.", "Paris."),
    ("\n<think>a < b and </th is not a tag</think>yes", False, "a < b and </th is not a tag", "yes"),
    ("Paris.", False, None, "Paris."),
    ("Paris <think> is not thinking here", False, None, "Paris <think> is not thinking here"),
    ("<think>cut off mid-thought", False, "cut off mid-thought", ""),
    ("cut off mid-thought", True, "cut off mid-thought", ""),
    ("<think>ends on a partial tag </thi", False, "ends on a partial tag </thi", ""),
    ("<think></think>Paris.", False, "", "Paris."),
    ("<think>one</think>two</think>three", False, "one", "two</think>three"),
]


@pytest.mark.parametrize("text,inside,thought,content", CASES)
def test_whole_outputs(text, inside, thought, content):
    assert split_reasoning(text, inside) == (thought, content)


def streamed(text: str, inside: bool, cuts: list[int]) -> tuple[str, str]:
    stream, events, start = ReasoningStream(inside), [], 0
    for cut in [*cuts, len(text)]:
        events += stream.push(text[start:cut])
        start = cut
    events += stream.finish()
    assert all(e.text if isinstance(e, Thought) else e for e in events), "no empty events"
    return "".join(e.text for e in events if isinstance(e, Thought)), "".join(e for e in events if isinstance(e, str))


@pytest.mark.parametrize("text,inside,thought,content", CASES)
def test_every_split_gives_the_whole_result(text, inside, thought, content):
    for cut in range(len(text) + 1):
        assert streamed(text, inside, [cut]) == (thought or "", content), cut
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(5, len(text))))
        assert streamed(text, inside, cuts) == (thought or "", content), cuts
    assert streamed(text, inside, list(range(1, len(text)))) == (thought or "", content)  # a character at a time


def test_only_a_possible_tag_is_held_back():
    stream = ReasoningStream(inside=False)
    assert stream.push("  <thi") == []  # whitespace and an opening tag still arriving
    assert stream.push("nk>abc </") == [Thought("abc ")]
    assert stream.push("think>\n\nOK") == ["\n\nOK"]
    assert stream.push(" more") == [" more"] and stream.answering


@pytest.mark.parametrize("prompt,inside", [
    ("<|im_start|>assistant\n", False),
    ("<|User|>hi<|Assistant|><think>\n", True),  # DeepSeek-R1's generation prompt
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with enable_thinking false
    ("<|im_start|>assistant\n<think>a</think>b<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
])
def test_the_prompt_says_whether_the_output_starts_inside(prompt, inside):
    assert opened_by(prompt) is inside


@pytest.mark.parametrize("template,parser", [
    ("{{ messages }}", None),
    ("{%- if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}", "qwen3"),
    ("<|Assistant|><think>\n", None),  # never closes a block: not a reasoning template
    (HARMONY_TEMPLATE, "harmony"),  # gpt-oss's format: its analysis channel (serve_app.text.harmony)
])
def test_default_parser(template, parser):
    assert default_parser(template) == parser


# ---- structured output after thinking: the composed grammar on llguidance and a real tokenizer ----

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}


@pytest.fixture(scope="module")
def compiler(llama_dir):
    from engine.formats.transformers_files import load_tokenizer
    from engine.generate.grammar import GrammarCompiler

    tokenizer = load_tokenizer(str(llama_dir))
    return GrammarCompiler(llama_dir, len(tokenizer), (tokenizer.eos_token_id,)), tokenizer


def accepts(compiler, grammar, text: str) -> tuple[bool, bool]:
    """(whether the grammar takes every token of `text`, whether it is then complete)."""
    compiler, tokenizer = compiler
    state = compiler.state(grammar)
    ok = all(state.matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok, ok and state.complete


@pytest.mark.parametrize("prompt,inside,text,verdict", [
    ("<|im_start|>assistant\n<think>\n", True, 'Paris or Oslo? </thi no.</think>\n\n{"city": "Oslo"}', (True, True)),
    ("<|im_start|>assistant\n<think>\n", True, '{"city": "Oslo"}', (True, False)),  # JSON as thinking: unclosed
    ("<|im_start|>assistant\n", False, '<think>hmm</think>{"city": "Paris"}', (True, True)),
    ("<|im_start|>assistant\n", False, '{"city": "Paris"}', (True, True)),  # answering without thinking
    ("<|im_start|>assistant\n", False, "<think>hmm</think>Paris", (False, False)),  # the answer is constrained
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False, '<think>', (False, False)),  # thinking disabled
])
def test_a_json_schema_constrains_the_answer_after_the_thinking(compiler, prompt, inside, text, verdict):
    from engine.generate.request import Grammar

    grammar, starts_inside = after_thinking(Grammar("json_schema", json.dumps(SCHEMA)), prompt)
    assert starts_inside is inside
    assert accepts(compiler, grammar, text) == verdict


def test_a_regex_follows_thinking_and_a_lark_grammar_applies_from_the_first_token(compiler):
    from engine.generate.request import Grammar

    regex, _ = after_thinking(Grammar("regex", r"(yes|no)/maybe"), "<think>\n")
    assert accepts(compiler, regex, "a/b</think>no/maybe") == (True, True)
    lark = Grammar("lark", 'start: "yes" | "no"', "structured_outputs")
    assert after_thinking(lark, "<think>\n") == (lark, False)  # the forced answer is no thinking
    assert after_thinking(None, "<think>\n") == (None, True)
