"""Helpers shared by the engine tests: the tight engine configuration that forces queueing,
chunking and preemption, prompts, running an engine to completion, and transformers' answers (the
reference implementation) for the same prompts."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

from engine.generate.engine import LLMEngine
from engine.generate.request import FinishReason, SamplingParams

PROMPT_LENGTHS = [3, 7, 12, 24, 33, 50, 9, 17]
"""Shorter than, equal to and longer than TIGHT's step budget."""
NEW_TOKENS = 32

TIGHT = dict(max_num_seqs=4, max_num_batched_tokens=24, page_size=4, num_pages=40, max_model_len=128, warmup=False)


def make_prompts(lengths=PROMPT_LENGTHS, seed=0, vocab=400) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, size=n)] for n in lengths]


def run_to_completion(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Add every request, step until idle; returns {id: list of deltas}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    deltas = {rid: [] for rid in requests}
    while engine.has_work():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    return deltas


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def assert_all_pages_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_pages == stats.num_pages
    assert stats.kv_cache_usage == 0.0


def hf_greedy(model_dir, prompt: list[int], new_tokens: int, **generate_kwargs):
    """transformers' greedy tokens and the log-softmax logprob of each."""
    model = hf_model(str(model_dir))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True, **generate_kwargs)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


HF_MODELS: dict[str, transformers.PreTrainedModel] = {}


def hf_model(path: str):
    """transformers' model of `path` in float32; Gemma's with eager attention, the one that soft-caps
    the scores (its default, SDPA, does not)."""
    if path not in HF_MODELS:
        config = transformers.AutoConfig.from_pretrained(path)
        eager = {"attn_implementation": "eager"} if config.model_type in ("gemma2", "gemma3_text") else {}
        HF_MODELS[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **eager).eval()
    return HF_MODELS[path]


def assert_greedy_parity(engine: LLMEngine, model_dir) -> None:
    """9 prompts queue (4 slots), share steps with decodes, chunk (a budget below the longest
    prompts), preempt (a small pool) and hit the prefix cache (the last extends the 50-token one);
    every greedy token equals transformers', every logprob within 1e-3, all pages return."""
    prompts = make_prompts()
    prompts.append(prompts[5][:30] + make_prompts([5], seed=99)[0])
    stats = _assert_prompts_answer_as_transformers(engine, model_dir, prompts, NEW_TOKENS)
    assert stats.num_preemptions >= 1, "the page pool was meant to force a preemption"


def assert_ragged_parity(engine: LLMEngine, model_dir, new_tokens: int = 8) -> None:
    """assert_greedy_parity's steps without its length, for backends slow on a CPU (a Pallas
    kernel interpreted): 5 prompts queue (4 slots); the 33- and 50-token ones chunk, sharing steps
    with decodes and with each other; the last extends the 50-token one (a prefix hit);
    `new_tokens` each, greedy tokens and logprobs as transformers', all pages return."""
    every = make_prompts()
    prompts = [every[i] for i in (4, 0, 5, 2)]
    prompts.append(prompts[2][:30] + make_prompts([5], seed=99)[0])
    _assert_prompts_answer_as_transformers(engine, model_dir, prompts, new_tokens)


def _assert_prompts_answer_as_transformers(engine: LLMEngine, model_dir, prompts, new_tokens: int):
    """Runs `prompts` to `new_tokens` each; returns the engine's stats after checking every answer."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    deltas = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})

    stats = engine.stats()
    assert stats.prefix_cache_hits > 0, "the last prompt was meant to reuse an earlier one's pages"
    assert stats.max_batch_size == 4
    for i, prompt in enumerate(prompts):
        want_tokens, want_logprobs = hf_greedy(model_dir, prompt, new_tokens)
        got = deltas[str(i)]
        assert tokens_of(got) == want_tokens, f"prompt {i} (length {len(prompt)})"
        got_logprobs = [lp.logprob for d in got for lp in d.logprobs]
        np.testing.assert_allclose(got_logprobs, want_logprobs, atol=1e-3)
        assert got[-1].finish_reason is FinishReason.LENGTH
        assert [d.finish_reason for d in got[:-1]] == [None] * (new_tokens - 1)
        assert got[0].num_prompt_tokens == len(prompt)
    assert_all_pages_free(engine)
    return stats


def peft_greedy(model_dir, adapter_dir, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers + peft's greedy tokens for `prompt` with the LoRA adapter at `adapter_dir`."""
    from tests.support.tiny_models import peft_model

    out = peft_model(model_dir, adapter_dir).generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens,
                                                      do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def png_data_uri(seed: int):
    """(a data: URI of a random 52 x 40 PNG, the PIL image)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    picture = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 52, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode(), picture


def llava_greedy(checkpoint, messages: list[dict], images: list, new_tokens: int) -> tuple[str, int]:
    """(transformers' greedy answer text, prompt tokens) of a LLaVA chat whose messages mark each
    image as "<image>": rendered by the checkpoint's template, each placeholder repeated once per
    image token, pixels from its CLIPImageProcessor."""
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    model = HF_MODELS.get(str(checkpoint)) or transformers.LlavaForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32).eval()
    HF_MODELS[str(checkpoint)] = model
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    vision = config.vision_config
    per_image = (vision.image_size // vision.patch_size) ** 2
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = [t for i in tokenizer.encode(text) for t in ([i] * per_image if i == config.image_token_id else [i])]
    pixels = transformers.CLIPImageProcessor.from_pretrained(checkpoint)(images, return_tensors="pt").pixel_values
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), pixel_values=pixels, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    return tokenizer.decode(out), len(ids)


def dequantized_copy(model_dir: Path, out: Path) -> Path:
    """A copy of the checkpoint whose float weights are the ones int8 serves: every matrix but a
    router's rounded to 127 steps of its row's largest |w| (HF rows are output channels, experts'
    included, and vocabulary rows), as `quantize` rounds them."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(model_dir, out)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name, w in tensors.items():
            if w.ndim == 2 and not name.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight")):
                scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
                scale = np.where(scale > 0, scale, np.float32(1))
                tensors[name] = (np.clip(np.round(w / scale), -127, 127) * scale).astype(w.dtype)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return out
