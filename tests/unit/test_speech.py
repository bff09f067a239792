"""The speech engine against transformers' Whisper `generate`: the same tokens on the same
features (short and long-form, transcribe and translate, with and without timestamps, a detected
language, a prompt), windows of several requests decoding together, and Whisper's rules."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import transformers
from transformers.models.whisper.generation_whisper import (
    WhisperGenerationMixin,
    _dynamic_time_warping,
    _median_filter,
)

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.transcribe import alignment
from engine.transcribe import decoding as rules
from engine.transcribe.decoding import Fallback, TranscriptionOptions
from engine.transcribe.driver import AsyncTranscriber, Done, Language, Segments
from engine.transcribe.engine import SpeechEngine

SLOTS = 4


@pytest.fixture(scope="module")
def hf(whisper_dir):
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper_dir).eval()
    return model, transformers.WhisperFeatureExtractor(feature_size=80)


@pytest.fixture(scope="module")
def transcriber(whisper_dir):
    engine = SpeechEngine(EngineConfig(model=str(whisper_dir), max_num_seqs=SLOTS, compilation_cache_dir=None))
    transcriber = AsyncTranscriber(engine)
    yield transcriber
    transcriber.shutdown()


def noise(seconds: float, seed: int) -> np.ndarray:
    return (np.random.RandomState(seed).randn(int(16000 * seconds)) * 0.1).astype(np.float32)


def short_features(hf, seconds: float, seed: int) -> np.ndarray:
    """[80, 3000]: transformers' features of a clip padded to 30 s."""
    return hf[1](noise(seconds, seed), sampling_rate=16000, return_tensors="np").input_features[0]


async def collect(transcriber, mel, frames, options):
    """(tokens of every segment in order, segments, language event, done event)."""
    segments, language, done = [], None, None
    async for event in transcriber.transcribe(mel, frames, options):
        if isinstance(event, Segments):
            segments += event.segments
        elif isinstance(event, Language):
            language = event
        elif isinstance(event, Done):
            done = event
    return [t for s in segments for t in s.tokens], segments, language, done


def hf_tokens(model, mel, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor(mel[None]), return_segments=True, **kwargs)
    return [t for s in out["segments"][0] for t in s["tokens"].tolist()], out["segments"][0]


@pytest.mark.parametrize("task", ["transcribe", "translate"])
@pytest.mark.parametrize("timestamps", [False, True])
@pytest.mark.parametrize("language", ["en", None])
def test_short_audio_equals_transformers(transcriber, hf, task, timestamps, language):
    """A 7 s clip, padded to 30 s as Whisper's feature extractor pads it: with the window as long as
    the features (3000 frames, as transformers treats a short clip) the tokens are generate's."""
    mel = short_features(hf, 7, seed=1)
    ours, _, lang, _ = asyncio.run(collect(transcriber, mel, 3000, TranscriptionOptions(task, language, timestamps)))
    expected, _ = hf_tokens(hf[0], mel, task=task, language=language, return_timestamps=timestamps)
    assert ours == expected
    assert lang.detected == (language is None)
    if language is None:
        with torch.no_grad():
            detected = hf[0].detect_language(torch.tensor(mel[None])).item()
        assert hf[0].generation_config.lang_to_id[f"<|{lang.code}|>"] == detected


@pytest.mark.parametrize("language", ["en", None])
def test_long_audio_equals_transformers_long_form(transcriber, hf, language):
    """75 s of audio decoded window after window, each starting where the last one's speech ended:
    the same tokens, segments and times as transformers' long-form generate."""
    model, extractor = hf
    features = extractor(noise(75, seed=2), sampling_rate=16000, return_tensors="np", truncation=False,
                         padding="longest", return_attention_mask=True)
    mel = features.input_features[0]
    ours, segments, _, done = asyncio.run(collect(transcriber, mel, mel.shape[1],
                                                  TranscriptionOptions(language=language, timestamps=True)))
    expected, hf_segments = hf_tokens(model, mel, attention_mask=torch.tensor(features.attention_mask),
                                      task="transcribe", language=language, return_timestamps=True)
    assert ours == expected
    assert [(round(s.start, 2), round(s.end, 2)) for s in segments] == [
        (round(float(s["start"]), 2), round(float(s["end"]), 2)) for s in hf_segments]
    assert done.windows >= 3
    assert segments[-1].seek > 3000  # later windows started past the first


def test_long_audio_always_decodes_with_timestamps(transcriber, hf):
    """Without timestamps asked, audio past 30 s still gets them: they place the windows."""
    mel = hf[1](noise(45, seed=3), sampling_rate=16000, return_tensors="np", truncation=False,
                padding="longest").input_features[0]
    with_ts, *_ = asyncio.run(collect(transcriber, mel, mel.shape[1], TranscriptionOptions(language="en",
                                                                                         timestamps=True)))
    without, *_ = asyncio.run(collect(transcriber, mel, mel.shape[1], TranscriptionOptions(language="en")))
    assert without == with_ts


def test_prompt_equals_transformers(transcriber, hf, whisper_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(whisper_dir)
    prompt = tokenizer.encode(" The quick brown fox", add_special_tokens=False)
    mel = short_features(hf, 5, seed=4)
    options = TranscriptionOptions(language="en", timestamps=True, prompt=tuple(prompt))
    ours, *_ = asyncio.run(collect(transcriber, mel, 3000, options))
    prev = hf[0].generation_config.prev_sot_token_id
    expected, _ = hf_tokens(hf[0], mel, language="en", return_timestamps=True,
                            prompt_ids=torch.tensor([prev, *prompt]))
    assert ours == expected


def test_concurrent_requests_batch_and_equal_alone(transcriber, hf):
    """More requests than slots, at once: each gets the tokens it gets alone."""
    mels = [short_features(hf, 3 + i, seed=10 + i) for i in range(SLOTS + 2)]
    options = [TranscriptionOptions(language="en", timestamps=bool(i % 2)) for i in range(len(mels))]
    alone = [asyncio.run(collect(transcriber, m, 3000, o))[0] for m, o in zip(mels, options)]
    steps = transcriber.num_steps

    async def together():
        return await asyncio.gather(*(collect(transcriber, m, 3000, o) for m, o in zip(mels, options)))

    assert [r[0] for r in asyncio.run(together())] == alone
    solo_steps = sum(1 + len(tokens) for tokens in alone)  # at least one step per token alone
    assert transcriber.num_steps - steps < solo_steps  # windows shared steps


def test_seeded_sampling_repeats(transcriber, hf):
    mel = short_features(hf, 4, seed=5)
    options = TranscriptionOptions(language="en", temperature=0.8, seed=7)
    first = asyncio.run(collect(transcriber, mel, 3000, options))[0]
    assert asyncio.run(collect(transcriber, mel, 3000, options))[0] == first
    greedy = asyncio.run(collect(transcriber, mel, 3000, TranscriptionOptions(language="en")))[0]
    assert first != greedy


def long_features(hf, seconds: float, seed: int):
    return hf[1](noise(seconds, seed), sampling_rate=16000, return_tensors="np", truncation=False,
                 padding="longest", return_attention_mask=True)


def test_silent_window_is_dropped_as_transformers_drops_it(transcriber, hf):
    """The no-speech rule with transformers' thresholds: the windows whose P(<|nospeech|>) is over
    the threshold (and whose average log-probability is under its own) give no segments, and the
    next window starts a whole window later. The same tokens and times as `generate`."""
    features = long_features(hf, 75, seed=2)
    mel = features.input_features[0]
    _, greedy, *_ = asyncio.run(collect(transcriber, mel, mel.shape[1], TranscriptionOptions(language="en",
                                                                                          timestamps=True)))
    speech = sorted({s.no_speech_prob for s in greedy})
    assert len(speech) >= 2 and all(s.avg_logprob < -1.0 for s in greedy)
    threshold = (speech[-2] + speech[-1]) / 2  # between the likeliest silence and the next
    fallback = Fallback(temperature_increment=None, compression_ratio_threshold=None, logprob_threshold=-1.0,
                        no_speech_threshold=threshold)
    ours, segments, *_ = asyncio.run(collect(transcriber, mel, mel.shape[1], TranscriptionOptions(
        language="en", timestamps=True, fallback=fallback)))
    expected, hf_segments = hf_tokens(hf[0], mel, attention_mask=torch.tensor(features.attention_mask),
                                      language="en", return_timestamps=True, temperature=(0.0,),
                                      logprob_threshold=-1.0, no_speech_threshold=threshold)
    assert ours == expected
    assert [(round(s.start, 2), round(s.end, 2)) for s in segments] == [
        (round(float(s["start"]), 2), round(float(s["end"]), 2)) for s in hf_segments]
    assert len(segments) < len(greedy)  # a window was dropped
    assert all(s.no_speech_prob < threshold for s in segments)


def test_failing_window_is_decoded_again_hotter(transcriber, hf):
    """A window under the log-probability threshold is decoded again at 0.2, 0.4, ... until one
    passes or 1.0 is reached (that last try is kept); seeded, the outcome repeats. A window that
    passes keeps its greedy tokens."""
    mel = short_features(hf, 6, seed=8)
    greedy, greedy_segments, *_ = asyncio.run(collect(transcriber, mel, 3000, TranscriptionOptions(language="en")))
    assert greedy_segments[0].avg_logprob < -1.0
    strict = TranscriptionOptions(language="en", seed=3, fallback=Fallback(compression_ratio_threshold=None))
    tokens, segments, _, done = asyncio.run(collect(transcriber, mel, 3000, strict))
    assert segments[0].temperature > 0.0
    for segment in segments:  # each window: the first temperature that passed, else the last
        assert segment.temperature in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
        assert segment.avg_logprob >= -1.0 or segment.temperature == 1.0
    assert done.tokens > len(tokens)  # the failed tries' tokens count too
    assert asyncio.run(collect(transcriber, mel, 3000, strict))[0] == tokens
    lowest = min(s.avg_logprob for s in greedy_segments)
    lenient = TranscriptionOptions(language="en", fallback=Fallback(compression_ratio_threshold=None,
                                                                    logprob_threshold=lowest - 1))
    assert asyncio.run(collect(transcriber, mel, 3000, lenient))[0] == greedy


def test_fallback_temperatures_and_verdicts():
    assert Fallback().temperatures(0.0) == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert Fallback().temperatures(0.5) == (0.5, 0.7, 0.9)
    assert Fallback(temperature_increment=None).temperatures(0.3) == (0.3,)
    assert TranscriptionOptions(temperature=0.4).temperatures() == (0.4,)
    repeated = [50365, 440, 2068, 50365, 440, 2068] * 20 + [50257]
    assert rules.token_compression_ratio(repeated, 51866) == WhisperGenerationMixin._retrieve_compression_ratio(
        torch.tensor(repeated), 51866)
    tokens = rules.WhisperTokens(eot=10, sot=11, prev=12, no_timestamps=14, languages={}, tasks={}, suppress=(),
                                 begin_suppress=(), max_initial_timestamp_index=50, max_length=448,
                                 max_target_positions=448, multilingual=False, vocab_size=51866)
    fallback = Fallback()
    assert rules.verdict(tokens, fallback, repeated, -0.5, 0.0) == "retry"  # compression ratio over 1.35
    assert rules.verdict(tokens, fallback, [440, 2068, 10], -0.5, 0.9) == "keep"  # likely enough: not silence
    assert rules.verdict(tokens, fallback, [440, 2068, 10], -1.5, 0.1) == "retry"
    assert rules.verdict(tokens, fallback, [440, 2068, 10], -1.5, 0.9) == "skip"
    assert rules.verdict(tokens, None, repeated, -9.0, 0.9) == "keep"


def test_token_times_equal_transformers(transcriber, hf):
    """Word timings' raw material: each token's end equals transformers' `token_timestamps` (its
    alignment heads' cross-attention through DTW), window after window of 45 s of audio and in a
    30 s window; a token starts where the one before it in its window ended."""
    features = long_features(hf, 45, seed=2)
    cases = [(features.input_features[0], int(features.attention_mask.sum()), torch.tensor(features.attention_mask)),
             (short_features(hf, 7, seed=1), 3000, None)]
    for mel, frames, mask in cases:
        options = TranscriptionOptions(language="en", timestamps=True, word_timestamps=True)
        ours, segments, *_ = asyncio.run(collect(transcriber, mel, frames, options))
        expected, hf_segments = hf_tokens(hf[0], mel, attention_mask=mask, language="en", return_timestamps=True,
                                          return_token_timestamps=True)
        assert ours == expected
        for segment, reference in zip(segments, hf_segments, strict=True):
            ends = [end for _, end in segment.token_times]
            assert ends == pytest.approx(reference["token_timestamps"].tolist(), abs=1e-5)
        by_window = {}
        for segment in segments:
            by_window.setdefault(segment.seek, []).extend(segment.token_times)
        for seek, times in by_window.items():
            assert times[0][0] == pytest.approx(seek / 100)
            assert all(start == end for (_, end), (start, _) in zip(times, times[1:]))


def test_word_timestamps_need_alignment_heads(transcriber, whisper_dir):
    tokens = rules.WhisperTokens(eot=10, sot=11, prev=12, no_timestamps=14, languages={}, tasks={}, suppress=(),
                                 begin_suppress=(), max_initial_timestamp_index=50, max_length=448,
                                 max_target_positions=448, multilingual=False, vocab_size=51864)
    problem, param = rules.check_options(tokens, TranscriptionOptions(word_timestamps=True))
    assert param == "timestamp_granularities" and "no alignment_heads" in problem
    assert transcriber.tokens.alignment_heads == ((0, 1), (1, 0), (1, 3))


def test_dtw_and_median_filter_equal_transformers():
    rng = np.random.default_rng(0)
    for shape in [(1, 1), (1, 9), (7, 3), (12, 40), (30, 200)]:
        for matrix in (rng.standard_normal(shape), rng.integers(0, 3, shape).astype(np.float64)):  # ties too
            ours = alignment.dtw(matrix.astype(np.float32))
            theirs = _dynamic_time_warping(matrix.astype(np.float32).astype(np.float64))
            assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
    values = rng.standard_normal((3, 5, 40)).astype(np.float32)
    for width in (1, 3, 7):
        assert np.array_equal(alignment.median_filter(values, width),
                              _median_filter(torch.tensor(values), width).numpy())
    assert np.array_equal(alignment.median_filter(values[..., :3], 7), values[..., :3])


def test_abandoned_request_frees_its_slot(transcriber, hf):
    mel = hf[1](noise(75, seed=6), sampling_rate=16000, return_tensors="np", truncation=False,
                padding="longest").input_features[0]

    async def abandon():
        events = transcriber.transcribe(mel, mel.shape[1], TranscriptionOptions(language="en"))
        async for event in events:
            if isinstance(event, Segments):
                break
        await events.aclose()

    for _ in range(SLOTS + 1):  # more than the slots: each must have been given back
        asyncio.run(abandon())
    result = asyncio.run(collect(transcriber, short_features(hf, 2, seed=1), 3000, TranscriptionOptions("transcribe")))
    assert result[3] is not None
    deadline = 100
    while transcriber.busy_slots() and deadline:
        asyncio.run(asyncio.sleep(0.05))
        deadline -= 1
    assert transcriber.busy_slots() == 0


@pytest.mark.parametrize("options, param, message", [
    (TranscriptionOptions(language="xx"), "language", "unknown language 'xx'"),
    (TranscriptionOptions(task="summarize"), "task", "task must be transcribe or translate"),
    (TranscriptionOptions(temperature=1.5), "temperature", "between 0 and 1"),
])
def test_unservable_options_are_refused(transcriber, hf, options, param, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        asyncio.run(collect(transcriber, short_features(hf, 1, seed=0), 3000, options))
    assert caught.value.param == param


def test_english_only_model_refuses_translation_and_other_languages():
    tokens = rules.WhisperTokens(eot=10, sot=11, prev=12, no_timestamps=14, languages={}, tasks={}, suppress=(),
                                 begin_suppress=(), max_initial_timestamp_index=50, max_length=448,
                                 max_target_positions=448, multilingual=False, vocab_size=51864)
    assert rules.check_options(tokens, TranscriptionOptions(task="translate"))[1] == "model"
    assert rules.check_options(tokens, TranscriptionOptions(language="fr"))[1] == "language"
    assert rules.check_options(tokens, TranscriptionOptions(language="en")) is None
    assert rules.prefix(tokens, TranscriptionOptions(), None) == [11, 14]  # <|startoftranscript|><|notimestamps|>


def test_split_window_equals_transformers():
    """Every way a window's tokens can end, split as transformers' `_retrieve_segment` splits them."""
    begin = 100
    tokens = rules.WhisperTokens(eot=50, sot=51, prev=52, no_timestamps=begin - 1, languages={}, tasks={},
                                 suppress=(), begin_suppress=(), max_initial_timestamp_index=50, max_length=448,
                                 max_target_positions=448, multilingual=False, vocab_size=51864)
    cases = [
        [begin + 0, 5, 6, begin + 40, begin + 40, 7, begin + 90],  # ends on a single timestamp
        [begin + 0, 5, begin + 40, begin + 41, 7, 8],  # ends mid-segment: seek to the last pair
        [begin + 2, 5, begin + 40, begin + 40, 7, begin + 60, begin + 60],  # ends on a pair
        [5, 6, 7],  # no timestamps
        [5, begin + 30, 6],  # one timestamp, no pair
    ]
    for sampled in cases:
        pieces, consumed = rules.split_window(tokens, sampled, seek=1000, window_frames=2500)
        expected, offset = WhisperGenerationMixin._retrieve_segment(
            torch.tensor(sampled), [{}], torch.tensor([10.0], dtype=torch.float64), begin, torch.tensor([2500]),
            0.02, 0.01, 2, 0, 0, False, torch.zeros((1, 4)))
        assert [(round(s, 6), round(e, 6), t) for s, e, t in pieces] == [
            (round(float(s["start"]), 6), round(float(s["end"]), 6), s["tokens"].tolist()) for s in expected]
        assert consumed == int(offset)


def test_timestamp_rules_pairs_and_order():
    begin, eot = 100, 50
    tokens = rules.WhisperTokens(eot=eot, sot=51, prev=52, no_timestamps=begin - 1, languages={}, tasks={},
                                 suppress=(3,), begin_suppress=(4,), max_initial_timestamp_index=5, max_length=448,
                                 max_target_positions=448, multilingual=False, vocab_size=51864)
    window = rules.WindowRules(tokens, timestamps=True)
    flat = np.zeros(200, np.float32)
    first = window.scores(flat, [])
    assert np.isfinite(first).nonzero()[0].tolist() == list(range(begin, begin + 6))  # a timestamp <= index 5 first
    after_text = window.scores(flat, [begin + 2, 7])  # an open segment closes after its start, never at it
    assert np.isneginf(after_text[begin:begin + 3]).all() and np.isfinite(after_text[begin + 3:]).all()
    assert np.isneginf(after_text[:begin]).all()  # 97 equal timestamps outweigh any one text token
    text_likely = flat.copy()
    text_likely[7] = 10.0
    assert np.isfinite(window.scores(text_likely, [begin + 2, 7])[7])
    after_open = window.scores(flat, [begin + 2, 7, begin + 9])  # a closing timestamp: another or the end
    assert np.isneginf(after_open[:eot]).all()
    after_pair = window.scores(flat, [begin + 2, 7, begin + 9, begin + 9])  # a closed pair: no timestamp next
    assert np.isneginf(after_pair[begin:]).all() and np.isneginf(after_pair[3])


def test_window_slices_and_zero_pads_the_last():
    mel = np.arange(80 * 7501, dtype=np.float32).reshape(80, 7501) + 1  # no zeros of its own
    first = rules.window(mel, 0)
    np.testing.assert_array_equal(first, mel[:, :rules.FRAMES_PER_WINDOW])
    last = rules.window(mel, 2 * rules.FRAMES_PER_WINDOW)  # frames 6000..7500: 1501 real, 1499 of padding
    assert last.shape == (80, rules.FRAMES_PER_WINDOW) and last.dtype == mel.dtype
    np.testing.assert_array_equal(last[:, :1501], mel[:, 6000:])
    np.testing.assert_array_equal(last[:, 1501:], 0)
    assert not np.any(last[:, :1501] == 0)
