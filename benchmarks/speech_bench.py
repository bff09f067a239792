"""Speech-to-text benchmark: real-time factor (audio seconds per second) of the speech engine at
concurrency 1 and 8, next to transformers' Whisper `generate` on the same checkpoint and the same
features, and its ASR pipeline (batch_size = the concurrency) on the raw audio.

    .venv/bin/python -m benchmarks.speech_bench                  # a random whisper-tiny-shaped model
    .venv/bin/python -m benchmarks.speech_bench --model DIR      # a real Whisper checkpoint
    .venv/bin/python -m benchmarks.speech_bench --words          # with word timestamps (both sides)

Work: `--clips` clips of `--seconds` of audio (noise for the random model, which decodes the same
whatever it hears) turned into log-mel features once, then transcribed with timestamps (long-form:
windows follow each other) in English. Ours: `AsyncTranscriber` over `SpeechEngine` (features in,
segments out), all clips at once for concurrency 8 (windows of all clips share decode steps) or one
after another for concurrency 1. transformers: `generate` per clip (concurrency 1) and on the batch
of clips with an attention mask (its batched long-form). Compilation is excluded (an untimed round
first); each figure is the median of `--rounds` rounds. Tokens decoded are printed beside the
figures, and ours equal transformers' (`generate` is the parity reference).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def random_checkpoint(out: Path) -> Path:
    """A random model of whisper-tiny's shape and vocabulary (tests/support/tiny_models.py)."""
    from tests.support.tiny_models import make_whisper_checkpoint

    return make_whisper_checkpoint(out, d_model=384, num_layers=4, num_heads=6, ffn_dim=1536,
                                   max_target_positions=448, initializer_range=0.02, text_tokens=50257)


def clips_of(seconds: float, clips: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32) for _ in range(clips)]


def pipeline_run(pipe, audio: list[np.ndarray], concurrency: int, words: bool) -> float:
    """Seconds for transformers' ASR pipeline to transcribe the raw clips (its feature extraction included)."""
    start = time.perf_counter()
    pipe([{"raw": a, "sampling_rate": 16000} for a in audio], batch_size=concurrency,
         return_timestamps="word" if words else True, generate_kwargs={"language": "en", "task": "transcribe"})
    return time.perf_counter() - start


def ours(transcriber, mels: list[np.ndarray], concurrency: int, words: bool) -> tuple[float, list[list[int]], int]:
    """(seconds, each clip's segment tokens, tokens sampled) to transcribe every clip, `concurrency` at a time."""
    from engine.transcribe.decoding import TranscriptionOptions
    from engine.transcribe.driver import Done, Segments

    options = TranscriptionOptions(language="en", timestamps=True, word_timestamps=words)

    async def one(mel) -> tuple[list[int], int]:
        tokens, sampled = [], 0
        async for event in transcriber.transcribe(mel, mel.shape[1], options):
            if isinstance(event, Segments):
                tokens += [t for s in event.segments for t in s.tokens]
            elif isinstance(event, Done):
                sampled = event.tokens
        return tokens, sampled

    async def run() -> list[tuple[list[int], int]]:
        results = []
        for i in range(0, len(mels), concurrency):
            results += await asyncio.gather(*(one(m) for m in mels[i: i + concurrency]))
        return results

    start = time.perf_counter()
    results = asyncio.run(run())
    return time.perf_counter() - start, [r[0] for r in results], sum(r[1] for r in results)


def reference(model, mels: list[np.ndarray], concurrency: int, words: bool) -> tuple[float, list[list[int]]]:
    import torch

    start, tokens = time.perf_counter(), []
    for i in range(0, len(mels), concurrency):
        batch = torch.tensor(np.stack(mels[i: i + concurrency]))
        with torch.no_grad():
            out = model.generate(batch, attention_mask=torch.ones(batch.shape[::2], dtype=torch.long),
                                 language="en", task="transcribe", return_timestamps=True, return_segments=True,
                                 return_token_timestamps=words)
        tokens += [[t for s in clip for t in s["tokens"].tolist()] for clip in out["segments"]]
    return time.perf_counter() - start, tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Whisper checkpoint directory (default: random whisper-tiny)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-reference", action="store_true", help="skip transformers")
    parser.add_argument("--words", action="store_true", help="time tokens for word timestamps (transformers: "
                        "return_token_timestamps)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch
    import transformers

    from engine.config import EngineConfig
    from engine.transcribe.driver import AsyncTranscriber
    from engine.transcribe.engine import SpeechEngine

    scratch = tempfile.TemporaryDirectory()  # the random checkpoint's, removed at the end
    model_dir = Path(args.model) if args.model else random_checkpoint(Path(scratch.name) / "whisper-tiny")
    levels = [int(c) for c in args.concurrency.split(",")]
    engine = SpeechEngine(EngineConfig(model=str(model_dir), dtype=args.dtype, max_num_seqs=max(levels)))
    transcriber = AsyncTranscriber(engine)
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    hf.eval()
    from serve_app.media.audio import log_mel

    audio = clips_of(args.seconds, args.clips)
    mels = [log_mel(a, engine.num_mel_bins) for a in audio]
    pipe = transformers.pipeline("automatic-speech-recognition", model=hf, device="cpu",
                                 tokenizer=transformers.WhisperTokenizerFast.from_pretrained(model_dir),
                                 feature_extractor=transformers.WhisperFeatureExtractor.from_pretrained(model_dir))
    audio_s = args.seconds * args.clips
    print(f"{args.clips} clips x {args.seconds:g} s, model {model_dir.name}, {args.dtype}, "
          f"torch threads {torch.get_num_threads()}{', word timestamps' if args.words else ''}")
    for level in levels:
        ours(transcriber, mels, level, args.words)  # compiles what this level uses
        runs = [ours(transcriber, mels, level, args.words) for _ in range(args.rounds)]
        seconds, kept, sampled = statistics.median(r[0] for r in runs), runs[0][1], runs[0][2]
        print(f"ours          concurrency {level}: RTF {audio_s / seconds:7.1f} audio s/s  ({seconds:.2f} s, "
              f"{sampled} tokens sampled, {sum(map(len, kept))} kept)")
        if args.no_reference:
            continue
        refs = [reference(hf, mels, level, args.words) for _ in range(args.rounds)]
        seconds, expected = statistics.median(r[0] for r in refs), refs[0][1]
        print(f"transformers  concurrency {level}: RTF {audio_s / seconds:7.1f} audio s/s  ({seconds:.2f} s, "
              f"{sum(map(len, expected))} kept; the same tokens as ours: {expected == kept})")
        seconds = statistics.median(pipeline_run(pipe, audio, level, args.words) for _ in range(args.rounds))
        print(f"pipeline      concurrency {level}: RTF {audio_s / seconds:7.1f} audio s/s  ({seconds:.2f} s, "
              "from raw audio: its feature extraction included)")
    transcriber.shutdown()
    scratch.cleanup()


if __name__ == "__main__":
    main()
