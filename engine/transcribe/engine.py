"""The speech engine: Whisper on one device, log-mel windows and token ids in, logits out.

    engine = SpeechEngine(config)
    engine.encode([(slot, mel_window)])                  # a window's encoder pass, into its slot
    engine.decode({slot: Feed(start, tokens, probe)})    # -> {slot: (logits [vocab], log P(nospeech))}
    engine.align(slot, tokens)                           # -> alignment heads' cross-attention (word timings)

The engine holds `num_slots` (= `max_num_seqs`) decoding slots, each with its window's cross-
attention keys and values and a self-attention cache of `max_target_positions` tokens
(engine.models.whisper). A `decode` call runs every slot's feed in one program over all slots:
fresh windows feed their prefix, decoding ones their last token, so windows of different requests
decode together (continuous batching: engine.transcribe.driver decides what each slot does).

Programs: `encode` for 1, 4, 16, ... windows up to `num_slots`; one-token `decode` steps over the
first 1, 4, 16, ... slots up to all (slots are taken lowest first, so a light load runs small
steps); `decode` of 8, 64, ... tokens up to `max_target_positions` over every slot (a window's
prefix); `align` of 8, 64, ... tokens over one slot (word timings, for a checkpoint with
alignment heads). The one-window encode and the one-token step over every slot compile before the
engine serves (with them alone any request runs, a prefix fed token by token); the others compile
in the background, and a call uses the ready ones, cutting a longer feed into pieces (an `align`
asked before its program is ready compiles it then).

Of `EngineConfig` it reads `model`, `dtype`, `max_num_seqs`, `warmup`, `compilation_cache_dir`
and `step_timeout_s` (read by the caller). Not thread-safe; one worker thread drives it.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from engine.compiler import StepCompiler
from engine.config import EngineConfig
from engine.ladder import ladder
from engine.models import whisper
from engine.one_device import OneDeviceEngine
from engine.transcribe.decoding import FRAMES_PER_WINDOW, Feed, WhisperTokens

ROW_BASE = 4
"""Decoding rows (slots 0..rows-1) and encoded windows come in buckets growing by this factor."""
LENGTH_BASE = 8
"""Tokens fed per slot come in buckets growing by this factor: a window's prefix (4 tokens without a
prompt) fits the second; longer feeds than the largest ready bucket are cut into pieces."""


class SpeechEngine(OneDeviceEngine):
    """Whisper's encoder and cached decoder over `num_slots` slots, and their compiled programs."""

    task = "speech"
    programs_key = "programs"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        checkpoint = whisper.read_checkpoint(config.model)
        self.tokens = WhisperTokens.from_generation_config(checkpoint.generation_config(),
                                                           checkpoint.max_target_positions, checkpoint.vocab_size)
        self.num_mel_bins = checkpoint.num_mel_bins
        self.vocab_size = checkpoint.vocab_size
        self.num_slots = config.max_num_seqs
        self.max_positions = checkpoint.max_target_positions
        self.dtype = checkpoint.dtype if config.dtype == "auto" else config.dtype
        model = whisper.load_whisper(checkpoint, self.dtype)
        self._cache, self._cross = whisper.empty_caches(model, self.num_slots, jnp.dtype(self.dtype))
        self._params, self._static = eqx.partition((model, whisper.decoder_layers(model)), eqx.is_array)
        self._encode = jax.jit(self._encode_fn, donate_argnums=(3,))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(5,))
        self._align = jax.jit(self._align_fn)
        self.median_filter_width = checkpoint.median_filter_width
        self.rows = ladder(1, self.num_slots, ROW_BASE)
        self.lengths = ladder(1, self.max_positions, LENGTH_BASE)
        # serving needs a one-token step over every slot and a one-window encode; the rest follow,
        # word timing's passes last (a request asking words before they are ready compiles its own)
        first = [("decode", self.num_slots, 1), ("encode", 1, 0)]
        rest = ([("decode", r, 1) for r in self.rows[:-1]] + [("encode", r, 0) for r in self.rows[1:]]
                + [("decode", self.num_slots, t) for t in self.lengths[1:]])
        aligns = [("align", 1, t) for t in self.lengths[1:]] if self.tokens.alignment_heads else []
        self.compiler = StepCompiler(first + sorted(rest, key=lambda b: (b[1] * max(b[2], 1), b)) + aligns,
                                     self._compile, _describe, first=len(first))
        self._ready(config.warmup)

    # ---- the API ----

    def encode(self, windows: list[tuple[int, np.ndarray]]) -> None:
        """Run the encoder over each (slot, mel [num_mel_bins, FRAMES_PER_WINDOW]) and keep the
        result in that slot (replacing its previous window)."""
        rows = sorted({r for kind, r, _ in self.compiler.ready() if kind == "encode"})
        while windows:
            size = next((r for r in rows if r >= len(windows)), rows[-1])
            batch, windows = windows[:size], windows[size:]
            mel = np.zeros((size, self.num_mel_bins, FRAMES_PER_WINDOW), np.float32)
            slots = np.full(size, self.num_slots, np.int32)  # past the last slot: padding rows are dropped
            for row, (slot, window) in enumerate(batch):
                mel[row], slots[row] = window, slot
            self._cross = self._encode(self._params, mel, slots, self._cross)

    def decode(self, feeds: dict[int, Feed]) -> dict[int, tuple[np.ndarray, float]]:
        """Feed each slot's tokens; {slot: (float32 logits [vocab] after its last token, log
        P(<|nospeech|>) after its probe token, NaN without a probe)}. Slots not in `feeds` idle."""
        ready = [(rows, length) for kind, rows, length in self.compiler.ready() if kind == "decode"]
        done: dict[int, tuple[np.ndarray, float]] = {}
        fed = {slot: 0 for slot in feeds}
        probes: dict[int, float] = {}
        while len(done) < len(feeds):
            longest = max(len(feed.tokens) - fed[slot] for slot, feed in feeds.items() if slot not in done)
            rows, size = _bucket(ready, max(s for s in feeds if s not in done) + 1, longest)
            tokens = np.zeros((rows, size), np.int32)
            starts, counts, probe = (np.zeros(rows, np.int32) for _ in range(3))
            for slot, feed in feeds.items():
                if slot in done:
                    continue
                piece = feed.tokens[fed[slot]: fed[slot] + size]
                tokens[slot, : len(piece)] = piece
                starts[slot], counts[slot] = feed.start + fed[slot], len(piece)
                probe[slot] = feed.probe - fed[slot]
            logits, nospeech, self._cache = self._decode(self._params, tokens, starts, counts, probe, self._cache,
                                                         self._cross)
            logits, nospeech = np.asarray(logits), np.asarray(nospeech)
            for slot, feed in feeds.items():
                if slot in done:
                    continue
                if 0 <= probe[slot] < counts[slot]:
                    probes[slot] = float(nospeech[slot])
                fed[slot] += counts[slot]
                if fed[slot] >= len(feed.tokens):
                    done[slot] = (logits[slot], probes.get(slot, float("nan")))
        return done

    def align(self, slot: int, tokens: list[int]) -> np.ndarray:
        """float32 [alignment heads, len(tokens), source]: the cross-attention weights of the
        checkpoint's alignment heads for `tokens` read afresh against the window in `slot` (a
        finished window's fed tokens: its prefix and all it sampled but the last)."""
        length = next(t for t in self.lengths[1:] if t >= len(tokens))
        padded = np.zeros(length, np.int32)
        padded[: len(tokens)] = tokens
        weights = self._align(self._params, padded, np.int32(slot), self._cross)
        return np.asarray(weights)[:, : len(tokens)]

    def _facts(self) -> dict[str, str]:
        return {
            "slots": str(self.num_slots),
            "max_target_positions": str(self.max_positions),
            "num_mel_bins": str(self.num_mel_bins),
            "multilingual": str(self.tokens.multilingual).lower(),
        }

    # ---- programs ----

    def _encode_fn(self, params, mel, slots, cross):
        model, layers = eqx.combine(params, self._static)
        return whisper.encode(model, layers, mel, slots, cross)

    def _decode_fn(self, params, tokens, starts, counts, probes, cache, cross):
        model, layers = eqx.combine(params, self._static)
        return whisper.decode(model, layers, tokens, starts, counts, probes, self.tokens.nospeech, cache, cross)

    def _align_fn(self, params, tokens, slot, cross):
        model, layers = eqx.combine(params, self._static)
        return whisper.align(model, layers, tokens, slot, self.tokens.alignment_heads, cross)

    def _compile(self, bucket: tuple[str, int, int]) -> None:
        """Compile one program without running it (fills jit's cache)."""
        kind, rows, length = bucket
        if kind == "align":
            self._align.lower(self._params, jax.ShapeDtypeStruct((length,), np.int32),
                              jax.ShapeDtypeStruct((), np.int32), self._cross).compile()
            return
        if kind == "encode":
            mel = jax.ShapeDtypeStruct((rows, self.num_mel_bins, FRAMES_PER_WINDOW), np.float32)
            self._encode.lower(self._params, mel, jax.ShapeDtypeStruct((rows,), np.int32), self._cross).compile()
            return
        vector = jax.ShapeDtypeStruct((rows,), np.int32)
        tokens = jax.ShapeDtypeStruct((rows, length), np.int32)
        self._decode.lower(self._params, tokens, vector, vector, vector, self._cache, self._cross).compile()


def _bucket(ready: list[tuple[int, int]], rows: int, length: int) -> tuple[int, int]:
    """The cheapest ready (rows, tokens) holding `rows` slots and `length` tokens, else the one that
    feeds the most of them (the caller feeds the rest in the next call)."""
    holding = [(r * t, r, t) for r, t in ready if r >= rows and t >= length]
    if holding:
        return min(holding)[1:]
    return max((min(t, length), -r, r, t) for r, t in ready if r >= rows)[2:]


def _describe(bucket: tuple[str, int, int]) -> str:
    kind, rows, length = bucket
    return f"encode({rows})" if kind == "encode" else f"{kind}({rows} x {length})"
