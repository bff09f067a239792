"""Constrained decoding in the engine, on a tiny RANDOM checkpoint: its free text is garbage, so
only the grammar can make the output valid JSON. The engine is the tight one (4 slots, chunked
prompts, a small page pool), so constrained sequences queue, chunk, are preempted and share
cached prompt prefixes."""

from __future__ import annotations

import json

import jax.numpy as jnp
import jsonschema
import llguidance.numpy
import numpy as np
import pytest
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.generate.engine import LLMEngine
from engine.generate.grammar import JSON_DEFAULTS, GrammarCompiler, mask_words
from engine.generate.request import FinishReason, Grammar, SamplingParams
from engine.generate.runner import sampler
from tests.support.parity import (
    TIGHT,
    assert_all_pages_free,
    make_prompts,
    run_to_completion,
    tokens_of,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "member"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineConfig(model=str(llama_dir), **TIGHT))


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(str(llama_dir))


def constrained(seed: int, schema: dict = PERSON, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 80), temperature=1.0, seed=seed,
                          grammar=Grammar("json_schema", json.dumps(schema)), **kwargs)


def texts(deltas: dict, tokenizer) -> dict[str, str]:
    return {rid: tokenizer.decode(tokens_of(ds), skip_special_tokens=True) for rid, ds in deltas.items()}


def test_outputs_match_the_schema_for_every_seed(engine, tokenizer):
    """12 sampled requests, three on each of four prompts (n=3 style: shared prefixes)."""
    prompts = make_prompts([21, 9, 30, 5], seed=7)
    hits_before = engine.stats().prefix_cache_hits
    requests = {f"p{p}-{i}": (prompts[p], constrained(seed=100 * p + i)) for p in range(4) for i in range(3)}
    deltas = run_to_completion(engine, requests)
    for rid, text in texts(deltas, tokenizer).items():
        assert deltas[rid][-1].finish_reason is FinishReason.STOP, (rid, text)
        jsonschema.validate(json.loads(text), PERSON)
        assert text == json.dumps(json.loads(text), ensure_ascii=False)  # json.dumps' separators, no free spaces
    assert len(set(texts(deltas, tokenizer).values())) > 6  # seeds differ, outputs differ
    assert engine.stats().prefix_cache_hits > hits_before
    assert_all_pages_free(engine)


def test_seeded_constrained_output_is_reproducible_and_async_scheduling_changes_nothing(llama_dir, engine,
                                                                                         monkeypatch):
    """With async scheduling the masks are made while the next forward pass runs (its sampling
    launched afterwards); one step at a time they are made before: the same tokens either way."""
    prompt = make_prompts([13], seed=8)[0]
    deferred = []
    sample = engine.executor.sample
    monkeypatch.setattr(engine.executor, "sample", lambda handle, allowed: deferred.append(sample(handle, allowed)))
    first = tokens_of(run_to_completion(engine, {"a": (prompt, constrained(seed=5))})["a"])
    assert len(deferred) >= len(first) - 2  # every decode step but the first sampled after its masks
    again = tokens_of(run_to_completion(engine, {"a": (prompt, constrained(seed=5))})["a"])
    serial = LLMEngine(EngineConfig(model=str(llama_dir), **{**TIGHT, "async_scheduling": False}))
    assert first == again == tokens_of(run_to_completion(serial, {"a": (prompt, constrained(seed=5))})["a"])


def test_unconstrained_neighbours_are_unchanged(engine):
    """Greedy unconstrained requests give the same tokens with constrained requests in their
    batches (and preempting them) as alone."""
    prompts = make_prompts([12, 30, 7, 40], seed=9)
    free = {f"free{i}": (p, SamplingParams(max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts)}
    alone = run_to_completion(engine, free)
    preemptions = engine.stats().num_preemptions
    mixed = run_to_completion(engine, {**free, **{f"c{i}": (p, constrained(seed=i)) for i, p in enumerate(prompts)}})
    assert engine.stats().num_preemptions > preemptions  # the pool is too small for all eight
    for rid in free:
        assert tokens_of(mixed[rid]) == tokens_of(alone[rid])
    assert_all_pages_free(engine)


def test_json_object_is_an_object(engine, tokenizer):
    """Any object: the random model would go on forever, so a bias towards closing brackets
    (applied before the mask, which still decides) lets it finish within max_tokens."""
    closers = {t for t in range(len(tokenizer)) if tokenizer.decode([t]).strip() in ("}", "\"}", "]", "\"]")}
    bias = tuple((t, 6.0) for t in sorted(closers))
    params = [SamplingParams(max_tokens=110, temperature=1.0, seed=s, logit_bias=bias,
                             grammar=Grammar("json_schema", '{"type": "object"}')) for s in range(4)]
    deltas = run_to_completion(engine, {f"o{s}": ([5, 6, 7], p) for s, p in enumerate(params)})
    for rid, text in texts(deltas, tokenizer).items():
        assert deltas[rid][-1].finish_reason is FinishReason.STOP, text
        assert isinstance(json.loads(text), dict)


def test_a_generation_cut_by_max_tokens_ends_with_length_and_is_a_prefix(engine, tokenizer):
    deltas = run_to_completion(engine, {"cut": ([5, 6, 7], constrained(seed=1, max_tokens=6))})["cut"]
    assert deltas[-1].finish_reason is FinishReason.LENGTH
    assert len(tokens_of(deltas)) == 6
    text = tokenizer.decode(tokens_of(deltas))
    assert text.startswith('{"name') and (text.startswith('{"name": "') or '{"name": "'.startswith(text))


@pytest.mark.parametrize("schema,message", [
    ({"type": "objekt"}, "invalid JSON schema: Invalid type: objekt"),
    ({"type": "string", "format": "no-such-format"}, "invalid JSON schema: Unknown format: no-such-format"),
])
def test_invalid_schema_is_refused_naming_the_problem(engine, schema, message):
    with pytest.raises(InvalidRequestError) as info:
        engine.validate([1, 2], SamplingParams(grammar=Grammar("json_schema", json.dumps(schema), "response_format")))
    assert str(info.value) == message and info.value.param == "response_format"
    assert engine.stats().num_waiting == 0


def test_a_model_whose_tokenizer_llguidance_cannot_read_refuses_grammars_with_the_reason(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")  # no tokenizer.json: no fast tokenizer
    compiler = GrammarCompiler(tmp_path, 64, (2,))
    assert compiler.wait() is False
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(Grammar("regex", "[ab]+", "tool_choice"))
    assert str(info.value).startswith("this model cannot constrain its output (")
    assert str(info.value).endswith("); send the request without a response format or tool choice")
    assert info.value.param == "tool_choice"


def test_min_tokens_with_a_grammar_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="min_tokens cannot be combined"):
        engine.validate([1, 2], SamplingParams(min_tokens=3, grammar=Grammar("regex", "[ab]+")))


def test_regex_and_lark_grammars(engine, tokenizer):
    deltas = run_to_completion(engine, {
        "re": ([5, 6], SamplingParams(max_tokens=30, temperature=1.0, seed=3, grammar=Grammar("regex", r"(yes|no)!"))),
        "lark": ([7, 8], SamplingParams(max_tokens=30, temperature=1.0, seed=4,
                                        grammar=Grammar("lark", 'start: "a" ("b" | "c")+ "."'))),
    })
    out = texts(deltas, tokenizer)
    assert out["re"] in ("yes!", "no!")
    assert out["lark"][0] == "a" and out["lark"][-1] == "." and set(out["lark"][1:-1]) <= {"b", "c"}


def test_device_mask_equals_llguidance_reference():
    """The sampler's unpacking of the bitmask, against llguidance's numpy reference."""
    rng = np.random.default_rng(0)
    vocab = 77
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    allowed = rng.integers(-2**31, 2**31 - 1, size=(3, mask_words(vocab)), dtype=np.int64).astype(np.int32)
    expected = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(expected, allowed)
    got = np.asarray(sampler._constrain(jnp.asarray(logits), jnp.asarray(allowed)))
    np.testing.assert_array_equal(got, expected)


def test_draw_never_picks_a_masked_token():
    """Inverse-CDF sampling at the edges of the uniform draw (0 and just below 1)."""
    scaled = jnp.asarray([[-jnp.inf, 1.0, -jnp.inf, 2.0, -jnp.inf]] * 3)
    drawn = np.asarray(sampler._draw(scaled, jnp.asarray([0.0, 0.5, 1.0 - 2**-24])))
    assert set(drawn.tolist()) <= {1, 3}


def test_json_output_has_no_free_whitespace_by_default():
    assert JSON_DEFAULTS == {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def test_aborting_a_constrained_request_mid_generation_frees_everything(engine):
    """Aborted between a deferred forward pass and its sampling's fetch: the step in flight still
    completes, the sequence's row is dropped, its pages return."""
    prompts = make_prompts([10, 20], seed=12)
    engine.add_request("keep", prompts[0], constrained(seed=1))
    engine.add_request("drop", prompts[1], constrained(seed=2))
    made = {"keep": 0, "drop": 0}
    while made["drop"] < 4:
        for delta in engine.step():
            made[delta.request_id] += len(delta.token_ids)
    engine.abort("drop")
    final = {}
    while engine.has_work():
        for delta in engine.step():
            final[delta.request_id] = delta.finish_reason
    assert final["drop"] is FinishReason.ABORT and final["keep"] is FinishReason.STOP
    assert_all_pages_free(engine)


@pytest.mark.parametrize("family", ["mixtral", "olmo2", "gemma2", "gemma3"])
def test_the_newer_families_keep_to_the_schema(checkpoint_factory, family):
    """Structured output is the engine's, whatever the forward pass: routed experts (Mixtral), norms
    after each block (OLMo 2), sliding layers and soft-capped logits (Gemma 2; the 30-token prompt
    runs past its 16-token window), a RoPE per layer type (Gemma 3)."""
    model_dir = checkpoint_factory(family)
    engine = LLMEngine(EngineConfig(model=str(model_dir), **TIGHT))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = make_prompts([30, 9], seed=3)
    deltas = run_to_completion(engine, {f"{p}-{i}": (prompts[p], constrained(seed=10 * p + i))
                                        for p in range(2) for i in range(2)})
    for rid, text in texts(deltas, tokenizer).items():
        assert deltas[rid][-1].finish_reason is FinishReason.STOP, (rid, text)
        jsonschema.validate(json.loads(text), PERSON)
    assert_all_pages_free(engine)
