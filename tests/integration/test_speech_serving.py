"""/v1/audio/transcriptions and /v1/audio/translations through the official `openai` client, against
the app in this process over a real speech engine (a tiny random Whisper): every response format
field by field against transformers' long-form generate, streaming, windows of a 5-minute file,
and the 400s of bad requests."""

from __future__ import annotations

import io
import json
import wave
from typing import Any, Callable, NamedTuple

import numpy as np
import openai
import pytest
import torch

from serve_app.config import AppConfig
from serve_app.media import audio
from serve_app.replicas.transcribe import SpeechServer

MODEL = "tiny-whisper"


def wav_bytes(samples: np.ndarray, rate: int = 16000) -> bytes:
    """16-bit mono WAV of float samples in [-1, 1]."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def noise(seconds: float, seed: int) -> np.ndarray:
    return (np.random.RandomState(seed).randn(int(16000 * seconds)) * 0.1).astype(np.float32)


@pytest.fixture(scope="module")
def app(whisper_dir):
    from fastapi.testclient import TestClient

    from serve_app.http.backends import LocalBackend
    from serve_app.http.ingress import create_app

    config = AppConfig.from_args({"model": str(whisper_dir), "model_id": MODEL, "warmup": False, "max_num_seqs": 4,
                                  "max_audio_seconds": 400, "transcription_fallback": None})
    assert config.models[0].task == "transcribe"
    server = SpeechServer(config.models[0])
    try:
        with TestClient(create_app({MODEL: LocalBackend(server)})) as http:
            yield server, http, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
    finally:
        server.driver.shutdown()


class Reference(NamedTuple):
    samples: np.ndarray
    segments: list
    """(start, end, tokens) of each segment."""
    text: Callable
    """token ids -> text."""
    token_timestamps: list
    """Each segment's tokens' timestamps (generate's return_token_timestamps)."""
    tokenizer: Any


@pytest.fixture(scope="module")
def reference(whisper_dir) -> Reference:
    """transformers' long-form answer for 40 s of audio."""
    import transformers

    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(whisper_dir)
    samples = noise(40, seed=3)
    pcm = np.frombuffer(wav_bytes(samples)[44:], "<i2").astype(np.float32) / 32768  # what the server decodes
    mel = audio.log_mel(pcm, 80)
    with torch.no_grad():
        out = model.generate(torch.tensor(mel[None]), attention_mask=torch.ones((1, mel.shape[1]), dtype=torch.long),
                             language="en", task="transcribe", return_timestamps=True, return_segments=True,
                             return_token_timestamps=True)
    segments = [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in out["segments"][0]]
    token_timestamps = [s["token_timestamps"].tolist() for s in out["segments"][0]]
    eot = model.generation_config.eos_token_id

    def text(tokens):
        return tokenizer.decode([t for t in tokens if t < eot])

    return Reference(samples, segments, text, token_timestamps, tokenizer)


def test_verbose_json_equals_transformers_segments(app, reference):
    _, _, client = app
    samples, segments, text, *_ = reference
    answer = client.audio.transcriptions.create(model=MODEL, file=("speech.wav", wav_bytes(samples)), language="en",
                                                response_format="verbose_json")
    expected = [s for s in segments if text(s[2]).strip()]
    assert answer.language == "english" and answer.duration == 40.0
    assert answer.text == text([t for s in segments for t in s[2]]).strip()
    assert [(s.id, s.start, s.end, s.text, s.tokens) for s in answer.segments] == [
        (i, round(min(start, 40.0), 2), round(min(end, 40.0), 2), text(tokens), tokens)
        for i, (start, end, tokens) in enumerate(expected)]
    for segment in answer.segments:
        assert segment.temperature == 0.0 and segment.avg_logprob < 0
        assert 0.0 <= segment.no_speech_prob <= 1.0
        data = segment.text.encode()
        assert segment.compression_ratio == pytest.approx(len(data) / len(__import__("zlib").compress(data)))
    assert answer.usage.seconds == 40


def hf_words(reference) -> list[dict]:
    """transformers' words for the reference: per segment, its text tokens grouped by the tokenizer's
    `_combine_tokens_into_words`, each token timed from the end of the token before it in its window
    (the window's start for the first) to its own end, as its ASR pipeline times words."""
    from transformers.models.whisper.tokenization_whisper import (
        _combine_tokens_into_words,
    )

    _, segments, text, *_ = reference
    tokenizer = reference.tokenizer
    eot, begin = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|notimestamps|>") + 1
    words, window, last_end = [], None, 0.0
    for (start, _, tokens), ends in zip(segments, reference.token_timestamps):
        window_start = round(start - (tokens[0] - begin) * 0.02, 2)  # a segment opens with its timestamp
        if window_start != window:
            window, last_end = window_start, window_start
        spans = []
        for token, end in zip(tokens, ends):
            spans.append((token, last_end, end))
            last_end = end
        spans = [span for span in spans if span[0] < eot]
        if not text([t for t, _, _ in spans]).strip():
            continue
        grouped, _, indices = _combine_tokens_into_words(tokenizer, [t for t, _, _ in spans], "english")
        for word, index in zip(grouped, indices):
            words.append({"word": word.strip(), "start": round(min(spans[index[0]][1], 40.0), 2),
                          "end": round(min(spans[index[-1]][2], 40.0), 2)})
    return words


@pytest.mark.parametrize("text, language", [
    (" Hello, world! (Yes) “quoted” -- wait... ok? 'fine' [x] ¿qué? café", "en"),
    (" 你好，世界。我们走吧！", "zh"),
    (" こんにちは、世界", "ja"),
    (" A", "en"),
])
def test_words_group_as_transformers_groups_them(text, language):
    """serve_app.media.words against the tokenizer's `_combine_tokens_into_words` (byte-level tokens: a
    character may take several), each word timed from its first token's start to its last's end."""
    from transformers.models.whisper.tokenization_whisper import (
        LANGUAGES,
        _combine_tokens_into_words,
    )

    from serve_app.media.words import group_words
    from tests.support import tiny_models

    tokenizer = tiny_models.make_whisper_tokenizer()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    times = [(i * 0.5, i * 0.5 + 0.4) for i in range(len(tokens))]
    words = group_words(tokenizer.decode, tokens, times, language)
    expected, _, indices = _combine_tokens_into_words(tokenizer, tokens, LANGUAGES[language])
    assert [w.text for w in words] == expected
    assert [(w.start, w.end) for w in words] == [(times[i[0]][0], times[i[-1]][1]) for i in indices]
    assert "".join(w.text for w in words) == tokenizer.decode(tokens)


def test_word_timestamps_equal_transformers(app, reference):
    """timestamp_granularities word and segment: the words are transformers' (its tokenizer's grouping
    of its generate's token timestamps); word alone answers words without segments."""
    _, _, client = app
    samples, segments, text, *_ = reference
    file = ("speech.wav", wav_bytes(samples))
    both = client.audio.transcriptions.create(model=MODEL, file=file, language="en", response_format="verbose_json",
                                              timestamp_granularities=["word", "segment"])
    assert [w.model_dump() for w in both.words] == hf_words(reference)
    assert both.words and both.segments
    assert "".join(w.word for w in both.words) == "".join(both.text.split())
    words_only = client.audio.transcriptions.create(model=MODEL, file=file, language="en",
                                                    response_format="verbose_json", timestamp_granularities=["word"])
    assert words_only.segments is None and words_only.words == both.words and words_only.text == both.text


def test_json_text_srt_vtt_agree(app, reference):
    _, http, client = app
    samples, segments, text, *_ = reference
    file = ("speech.wav", wav_bytes(samples))
    verbose = client.audio.transcriptions.create(model=MODEL, file=file, language="en", response_format="verbose_json")
    plain = client.audio.transcriptions.create(model=MODEL, file=file, language="en", response_format="json")
    assert plain.text == verbose.text and plain.usage.seconds == 40 and plain.usage.type == "duration"
    body = http.post("/v1/audio/transcriptions", files={"file": file},
                     data={"model": MODEL, "language": "en", "response_format": "text"})
    assert body.headers["content-type"].startswith("text/plain") and body.text == verbose.text + "\n"

    def clock(seconds, sep):
        ms = round(seconds * 1000)
        return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"

    srt = http.post("/v1/audio/transcriptions", files={"file": file},
                    data={"model": MODEL, "language": "en", "response_format": "srt"})
    assert srt.text == "".join(f"{s.id + 1}\n{clock(s.start, ',')} --> {clock(s.end, ',')}\n{s.text.strip()}\n\n"
                               for s in verbose.segments)
    vtt = http.post("/v1/audio/transcriptions", files={"file": file},
                    data={"model": MODEL, "language": "en", "response_format": "vtt"})
    assert vtt.headers["content-type"].startswith("text/vtt")
    assert vtt.text == "WEBVTT\n\n" + "".join(f"{clock(s.start, '.')} --> {clock(s.end, '.')}\n{s.text.strip()}\n\n"
                                              for s in verbose.segments)


def test_stream_deltas_add_up_to_the_text(app, reference):
    _, _, client = app
    samples, *_ = reference
    file = ("speech.wav", wav_bytes(samples))
    events = list(client.audio.transcriptions.create(model=MODEL, file=file, language="en", stream=True))
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1)
    done = events[-1]
    assert done.type == "transcript.text.done" and done.usage.seconds == 40
    assert "".join(e.delta for e in events[:-1]) == done.text
    assert done.text == client.audio.transcriptions.create(model=MODEL, file=file, language="en").text


def test_translation_and_detected_language(app, whisper_dir):
    _, _, client = app
    file = ("speech.wav", wav_bytes(noise(6, seed=8)))
    translated = client.audio.translations.create(model=MODEL, file=file, response_format="verbose_json")
    assert translated.task == "translate" and translated.duration == 6.0
    detected = client.audio.transcriptions.create(model=MODEL, file=file, response_format="verbose_json")
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    assert detected.language in LANGUAGES.values() and detected.task == "transcribe"


def test_five_minutes_in_windows(app):
    """A 5-minute file is read in many 30-second windows, each starting where the last ended."""
    _, _, client = app
    answer = client.audio.transcriptions.create(model=MODEL, file=("long.wav", wav_bytes(noise(300, seed=9))),
                                                language="en", response_format="verbose_json")
    assert answer.duration == 300.0 and answer.usage.seconds == 300
    seeks = sorted({s.seek for s in answer.segments})
    assert len(seeks) >= 10 and seeks[0] == 0 and seeks[-1] > 27000
    assert all(s.start <= s.end <= 300.0 for s in answer.segments)
    assert [s.start for s in answer.segments] == sorted(s.start for s in answer.segments)


def test_models_lists_the_speech_model(app):
    _, http, _ = app
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card["task"] == "transcribe" and card["state"] == "ready"


def post(http, data=None, files=None, route="transcriptions"):
    return http.post(f"/v1/audio/{route}", data=data, files=files)


@pytest.mark.parametrize("data, files, param, message", [
    ({"model": MODEL}, None, "file", "send the audio as multipart/form-data"),
    ({"model": MODEL}, {"other": ("a.txt", b"x")}, "other", "holds a file"),
    ({"model": MODEL, "response_format": "json"}, {"file": ("a.wav", b"not audio at all")}, "file",
     "could not decode the uploaded file as audio"),
    ({"model": MODEL, "language": "xx"}, "wav", "language", "unknown language 'xx'"),
    ({"model": MODEL, "response_format": "docx"}, "wav", "response_format", "response_format"),
    ({"model": MODEL, "temperature": "2"}, "wav", "temperature", "temperature"),
    ({"model": MODEL, "timestamp_granularities[]": "word", "response_format": "srt"}, "wav",
     "timestamp_granularities", "word timestamps come in verbose_json"),
    ({"model": MODEL, "stream": "true", "response_format": "srt"}, "wav", "stream", "takes response_format json"),
    ({"model": MODEL, "speed": "2"}, "wav", "speed", "'speed' is not a supported field"),
])
def test_bad_requests_are_400s(app, data, files, param, message):
    _, http, _ = app
    if files == "wav":
        files = {"file": ("a.wav", wav_bytes(noise(1, seed=0)))}
    if files is None:
        answer = http.post("/v1/audio/transcriptions", content=json.dumps(data),
                           headers={"content-type": "application/json"})
    else:
        answer = post(http, data, files)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"


def test_translation_refuses_language_and_a_text_model_is_not_speech(app):
    _, http, _ = app
    answer = post(http, {"model": MODEL, "language": "en"}, {"file": ("a.wav", wav_bytes(noise(1, 0)))}, "translations")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "language"
    answer = post(http, {"model": "nope"}, {"file": ("a.wav", wav_bytes(noise(1, 0)))})
    assert answer.status_code == 404


def test_too_long_and_too_short_audio(app):
    _, http, _ = app
    long = post(http, {"model": MODEL}, {"file": ("a.wav", wav_bytes(np.zeros(16000 * 401, np.float32)))})
    assert long.status_code == 400 and "400" in long.json()["error"]["message"]
    short = post(http, {"model": MODEL}, {"file": ("a.wav", wav_bytes(np.zeros(100, np.float32)))})
    assert short.status_code == 400 and "at least 10 ms" in short.json()["error"]["message"]


def test_default_fallback_decodes_unlikely_windows_again(whisper_dir):
    """A replica with the default `transcription_fallback`: the random model's greedy windows are far
    under the -1.0 log-probability threshold, so each is decoded again hotter (the segments say at
    which temperature); with a seed the answer repeats."""
    from fastapi.testclient import TestClient

    from serve_app.http.backends import LocalBackend
    from serve_app.http.ingress import create_app

    config = AppConfig.from_args({"model": str(whisper_dir), "model_id": MODEL, "warmup": False, "max_num_seqs": 2})
    server = SpeechServer(config.models[0])
    try:
        with TestClient(create_app({MODEL: LocalBackend(server)})) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)

            def ask():
                return client.audio.transcriptions.create(
                    model=MODEL, file=("speech.wav", wav_bytes(noise(6, seed=8))), language="en",
                    response_format="verbose_json", extra_body={"seed": 4})

            answer = ask()
            assert answer.segments and answer.segments[0].temperature > 0.0
            for segment in answer.segments:
                assert segment.temperature in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
                assert segment.avg_logprob >= -1.0 or segment.temperature == 1.0
            assert ask().model_dump() == answer.model_dump()
    finally:
        server.driver.shutdown()
