"""Speculative decoding (prompt lookup) against plain decoding, on a workload whose output repeats
its prompt and on one whose output does not.

    .venv/bin/python -m benchmarks.speculative_bench --batch 1,4,8 --new-tokens 256

Work: the default model (SmolLM2-135M-Instruct, fetched into ~/.cache/jax-serve/models on first
use) or `--model DIR`, chat prompts through its chat template, greedy, `batch` requests at once,
`--new-tokens` each (EOS ignored: every run produces as many tokens). Guesses come from prompt
lookup, or with `--draft DIR` from a draft model (`--draft self`: the served model drafting for
itself, every guess kept: what the mechanism costs).

- repetitive: code to edit and return whole, a paragraph to correct and write out, a text to
  quote back: the output copies long runs of the prompt (what prompt lookup is for).
- open: questions answered in free text (guesses are rare and mostly wrong: what speculation
  must not slow down).

Two engines (plain, and `--num-tokens` guesses per row), each warmed up and fully compiled, run
in turn `--repeats` times per batch size and workload; each figure is the median. Prints output
tokens/s of both, the speed-up, the share of guesses kept, tokens per guessed row, and whether
both produced the same tokens (greedy: they should, up to float ties).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

from engine.config import ATTENTION_BACKENDS, EngineConfig, SpeculativeConfig
from engine.generate.engine import LLMEngine
from engine.generate.request import SamplingParams

CODE = '''def moving_average(values, window):
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result


def normalize(values):
    smallest = min(values)
    largest = max(values)
    span = largest - smallest
    if span == 0:
        return [0.0 for _ in values]
    return [(value - smallest) / span for value in values]
'''

PARAGRAPH = ("The city council met on Tuesday evening to discuss the new budget for the public library. "
             "After a long debate, the members agreed to extend the opening hours on weekends, to buy more "
             "books for children and to repair the roof of the main reading room before the winter. The "
             "mayor said that the library is one of the most important places in the city, because it is "
             "open to everyone and costs nothing to use.")

REPETITIVE = [
    f"Rename the function moving_average to rolling_mean and return the complete code.\n\n{CODE}",
    f"Add a docstring to each function and return the complete code.\n\n{CODE}",
    f"Correct any mistakes in this paragraph and write it out in full:\n\n{PARAGRAPH}",
    f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
]
OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold.",
    "Give me ten ideas for a child's birthday party, with a sentence on each.",
    "Describe a walk through a forest in autumn.",
]


def prompts(tokenizer, texts: list[str], batch: int) -> list[list[int]]:
    chats = [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(batch)]
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=True) for chat in chats]


def run(engine: LLMEngine, requests: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds until every request is done, each request's tokens)."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    outputs = {str(i): [] for i in range(len(requests))}
    start = time.perf_counter()
    for i, prompt in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    while engine.has_work():
        for delta in engine.step():
            outputs[delta.request_id] += delta.token_ids
    return time.perf_counter() - start, [outputs[str(i)] for i in range(len(requests))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch", default="1,4,8")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--num-tokens", type=int, default=4, help="guesses per row")
    parser.add_argument("--max-step-tokens", type=int, default=None,
                        help="slots of decoding rows and guesses per step (default: the devices' figure)")
    parser.add_argument("--draft", default=None, help="guess with this draft model (method draft_model) instead of "
                        "prompt lookup; `self`: the served model itself (every guess kept: the cost of the mechanism)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import transformers

    model = args.model or default_model()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    batches = [int(b) for b in args.batch.split(",")]
    workloads = {"repetitive": REPETITIVE, "open": OPEN}
    longest = max(len(p) for texts in workloads.values() for p in prompts(tokenizer, texts, len(texts)))
    common = dict(model=str(model), max_num_seqs=max(batches), max_model_len=longest + args.new_tokens + 16,
                  attention_backend=args.attention_backend)
    method = {} if args.draft is None else {"method": "draft_model",
                                            "model": str(model) if args.draft == "self" else args.draft}
    speculative = SpeculativeConfig(num_tokens=args.num_tokens, max_step_tokens=args.max_step_tokens, **method)
    engines = {"plain": LLMEngine(EngineConfig(**common)),
               "speculative": LLMEngine(EngineConfig(**common, speculative=speculative))}
    for engine in engines.values():
        engine.wait_until_compiled()
    print(f"model {model.name}, {args.new_tokens} new tokens per request, greedy, {args.num_tokens} guesses per row "
          f"from {speculative.model or 'prompt lookup'} "
          f"in {engines['speculative'].max_step_tokens} slots per step at most; "
          f"{engines['plain'].describe()['attention_backend']} backend; medians of {args.repeats}")
    print(f"{'workload':>10} {'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speed-up':>8} {'kept':>6} "
          f"{'tok/row':>7} {'same':>5}")
    for batch in batches:
        for workload, texts in workloads.items():
            requests = prompts(tokenizer, texts, batch)
            seconds: dict[str, list[float]] = {name: [] for name in engines}
            outputs = {}
            before = engines["speculative"].stats()
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    elapsed, outputs[name] = run(engine, requests, args.new_tokens)
                    seconds[name].append(elapsed)
            after = engines["speculative"].stats()
            drafts = after.spec_draft_tokens - before.spec_draft_tokens
            kept = after.spec_accepted_tokens - before.spec_accepted_tokens
            rows = after.spec_drafts - before.spec_drafts
            tokens = batch * args.new_tokens
            plain, spec = (tokens / statistics.median(seconds[name]) for name in ("plain", "speculative"))
            print(f"{workload:>10} {batch:>5} {plain:>11.1f} {spec:>10.1f} {spec / plain:>7.2f}x "
                  f"{kept / max(drafts, 1):>6.1%} {1 + kept / max(rows, 1):>7.2f} "
                  f"{'yes' if outputs['plain'] == outputs['speculative'] else 'no':>5}")


def default_model() -> Path:
    """SmolLM2-135M-Instruct, as the serving layer fetches and converts it (engine.formats.model_sources)."""
    from engine.formats.model_sources import resolve_model

    return resolve_model("smollm2-135m-instruct")


if __name__ == "__main__":
    main()
