"""serve_app.media.audio: uploads decoded with PyAV, and Whisper's log-mel front end.

Test audio is a 2.5 s sum of sines under a sin^2 envelope (it starts and ends at zero, so codec
edges do not matter), encoded in memory with PyAV. Tolerances are measured with PyAV 15.1.0
(ffmpeg 7.1) and stated where they are asserted.
"""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from serve_app.errors import BadRequest
from serve_app.media import audio
from serve_app.media.audio import (
    HOP_LENGTH,
    N_FRAMES,
    N_SAMPLES,
    SAMPLE_RATE,
    decode_audio,
    log_mel,
    mel_filters,
)

SECONDS = 2.5
N = int(SECONDS * SAMPLE_RATE)  # samples of the test signal at 16 kHz
ONE_LSB = 1 / 32768  # one step of 16-bit PCM


def tone(rate: int, seconds: float = SECONDS) -> np.ndarray:
    """float32 [rate * seconds]: sines at 220, 587, 1500 and 3100 Hz under a sin^2 envelope, peak < 0.75."""
    t = np.arange(round(rate * seconds)) / rate
    envelope = np.sin(np.pi * t / seconds) ** 2
    sines = (
        0.3 * np.sin(2 * np.pi * 220 * t)
        + 0.2 * np.sin(2 * np.pi * 587 * t + 1)
        + 0.15 * np.sin(2 * np.pi * 1500 * t + 2)
        + 0.1 * np.sin(2 * np.pi * 3100 * t)
    )
    return (envelope * sines).astype(np.float32)


def encode(samples: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    """The bytes of `samples` ([n] mono or [channels, n], float) encoded with `codec` in `container`.

    PyAV converts the float frame to the codec's sample format and frame size.
    """
    channels = np.atleast_2d(np.asarray(samples, np.float32))
    layout = "mono" if len(channels) == 1 else "stereo"
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(channels.T.reshape(1, -1).copy(), format="flt", layout=layout)
        frame.rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buffer.getvalue()


def best_lag(decoded: np.ndarray, reference: np.ndarray, max_lag: int) -> tuple[int, float]:
    """(lag, correlation coefficient) of the best match of `reference` at decoded[lag:], 0 <= lag <= max_lag."""
    span = len(reference) - max_lag  # every lag compares the same number of samples
    windows = np.lib.stride_tricks.sliding_window_view(decoded.astype(np.float64), span)[: max_lag + 1]
    ref = reference[:span].astype(np.float64)
    lag = int(np.argmax(windows @ ref))
    return lag, float(np.corrcoef(windows[lag], ref)[0, 1])


# (container, codec, encoder rate, extra samples allowed at 16 kHz, lag at 16 kHz).
# Lossless formats decode to exactly N samples. Lossy codecs: mp3 and opus carry their priming and
# padding in the container (LAME info tag, Ogg/WebM pre-skip) and decode to exactly N (0 extra,
# one codec frame allowed); vorbis decodes 320 samples of end padding (one 1024-sample block
# allowed); in mp4 PyAV's muxing writes no edit list, so AAC's 1024 priming samples stay at the
# start (lag 1024) and the end is padded to a whole 1024-sample frame: 1984 extra, 2048 allowed.
FORMATS = [
    ("wav", "pcm_s16le", SAMPLE_RATE, 0, 0),
    ("wav", "pcm_f32le", SAMPLE_RATE, 0, 0),
    ("flac", "flac", SAMPLE_RATE, 0, 0),
    ("mp3", "libmp3lame", SAMPLE_RATE, 1152, 0),
    ("ogg", "libvorbis", SAMPLE_RATE, 1024, 0),
    ("ogg", "libopus", SAMPLE_RATE, 320, 0),  # ffmpeg decodes opus at 48 kHz: this resamples
    ("webm", "libopus", 48_000, 320, 0),
    ("mp4", "aac", SAMPLE_RATE, 2048, 1024),
]


@pytest.mark.parametrize("container,codec,rate,extra,lag", FORMATS, ids=[f"{f[0]}-{f[1]}" for f in FORMATS])
def test_decode_formats(container: str, codec: str, rate: int, extra: int, lag: int):
    data = encode(tone(rate), rate, container, codec)
    decoded = decode_audio(data, max_seconds=10)
    reference = tone(SAMPLE_RATE)
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    assert N <= len(decoded) <= N + extra
    if codec == "pcm_f32le":  # float in, float out at the same rate: nothing changes
        np.testing.assert_array_equal(decoded, reference)
    elif codec in ("pcm_s16le", "flac"):  # lossless 16-bit: rounding to the nearest step only
        assert np.abs(decoded[:N] - reference).max() <= ONE_LSB / 2 + 1e-7
    else:
        found_lag, correlation = best_lag(decoded, reference, max_lag=extra)
        assert found_lag == lag
        # Measured: mp3 0.999998, vorbis 0.99955, opus 0.99987 (at 16 and 48 kHz), aac 0.999999.
        assert correlation > 0.999
        # A least-squares gain near 1 (LAME scales its input by 0.95: measured 0.950).
        segment = decoded[lag : lag + N].astype(np.float64)
        gain = segment @ reference / (reference.astype(np.float64) @ reference)
        assert 0.9 < gain < 1.05


@pytest.mark.parametrize("container,codec", [("wav", "pcm_s16le"), ("flac", "flac"), ("mp3", "libmp3lame")])
def test_stereo_44k_comes_back_mono_16k(container: str, codec: str):
    # Right at half the left: the mono mix is the mean of the channels, 0.75 x the tone (ffmpeg's
    # own float downmix would give 0.707 x (L + R) = 1.06 x).
    left = tone(44_100)
    decoded = decode_audio(encode(np.stack([left, 0.5 * left]), 44_100, container, codec), max_seconds=10)
    expected = 0.75 * tone(SAMPLE_RATE)
    if codec == "libmp3lame":  # measured: exactly N samples, lag 0, correlation 0.999998, gain 0.95
        assert len(decoded) == N
        lag, correlation = best_lag(decoded, expected, max_lag=1152)
        assert lag == 0
        assert correlation > 0.999
        return
    assert len(decoded) == N
    # Resampling 44.1 -> 16 kHz adds no delay; measured max error 1.55e-5 (16-bit rounding included).
    assert np.abs(decoded - expected).max() < 5e-5


def test_clips_and_cleans_float_samples():
    samples = tone(SAMPLE_RATE)
    samples[100:105] = [1.5, -3.0, np.nan, np.inf, -np.inf]
    decoded = decode_audio(encode(samples, SAMPLE_RATE, "wav", "pcm_f32le"), max_seconds=10)
    np.testing.assert_array_equal(decoded[100:105], [1.0, -1.0, 0.0, 1.0, -1.0])
    np.testing.assert_array_equal(decoded[:100], samples[:100])


def test_truncated_upload_keeps_its_audio():
    data = encode(tone(SAMPLE_RATE), SAMPLE_RATE, "flac", "flac")
    full = decode_audio(data, max_seconds=10)
    cut = decode_audio(data[: len(data) // 2], max_seconds=10)
    assert 0 < len(cut) < N
    np.testing.assert_array_equal(cut, full[: len(cut)])


def test_format_change_mid_stream():
    # Two mp3 streams back to back: 16 kHz mono, then 44.1 kHz stereo. The second's LAME info frame
    # fails to decode and is skipped; each part gets its own resampler.
    first = encode(tone(SAMPLE_RATE), SAMPLE_RATE, "mp3", "libmp3lame")
    second = encode(np.stack([tone(44_100)] * 2), 44_100, "mp3", "libmp3lame")
    alone = decode_audio(first, max_seconds=10)
    both = decode_audio(first + second, max_seconds=10)
    np.testing.assert_array_equal(both[:N], alone)
    # Measured 2 N + 1643: the second part's priming and padding are not trimmed (only a file's
    # first info tag is read); two mp3 frames allowed.
    assert 2 * N <= len(both) <= 2 * N + 2304
    _, correlation = best_lag(both[N:], tone(SAMPLE_RATE), max_lag=len(both) - 2 * N)
    assert correlation > 0.999


def _video_only_mp4() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buffer.getvalue()


def _header_only_wav() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="wav") as out:
        out.add_stream("pcm_s16le", rate=SAMPLE_RATE, layout="mono")
        out.start_encoding()  # writes the header; no packet follows
    return buffer.getvalue()


NOT_AUDIO = ("could not decode the uploaded file as audio", "send an audio file", "wav, flac, mp3")
BAD_INPUTS = [
    ("random", lambda: np.random.default_rng(0).bytes(4096), NOT_AUDIO),
    ("empty", lambda: b"", NOT_AUDIO),
    (
        "truncated_wav_header",
        lambda: encode(tone(SAMPLE_RATE), SAMPLE_RATE, "wav", "pcm_s16le")[:20],
        NOT_AUDIO,
    ),
    ("video_only", _video_only_mp4, ("has no audio stream", "send an audio file", "wav, flac, mp3")),
    ("zero_samples", _header_only_wav, ("contains no samples", "send a file with at least some audio")),
    # A WebM whose codec id names no codec: PyAV gives the stream no decoder (and segfaults on it).
    (
        "unknown_codec",
        lambda: encode(tone(SAMPLE_RATE), SAMPLE_RATE, "webm", "libopus").replace(b"A_OPUS", b"A_QXYZ"),
        ("audio codec is unknown or unsupported", "wav, flac, mp3"),
    ),
]


@pytest.mark.parametrize("make,expected", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(make, expected: tuple[str, ...]):
    with pytest.raises(BadRequest) as caught:
        decode_audio(make(), max_seconds=10)
    assert caught.value.param == "file"
    for part in expected:
        assert part in caught.value.message


def test_too_long_names_duration_and_limit():
    with pytest.raises(BadRequest) as caught:
        decode_audio(encode(tone(SAMPLE_RATE), SAMPLE_RATE, "flac", "flac"), max_seconds=1)
    assert caught.value.param == "file"
    assert "is 2.5 s long, over this server's limit of 1 s" in caught.value.message


def test_too_long_stops_decoding_at_the_limit(monkeypatch):
    decoded = []  # input samples handed to the resampler, i.e. decoded so far
    real = av.AudioResampler

    class CountingResampler:
        def __init__(self, **kwargs):
            self.inner = real(**kwargs)

        def resample(self, frame):
            decoded.append(0 if frame is None else frame.samples)
            return self.inner.resample(frame)

    monkeypatch.setattr(audio.av, "AudioResampler", CountingResampler)
    sixty_seconds = encode(np.zeros(60 * SAMPLE_RATE, np.float32), SAMPLE_RATE, "wav", "pcm_s16le")
    with pytest.raises(BadRequest) as caught:
        decode_audio(sixty_seconds, max_seconds=1)
    assert "is 60.0 s long, over this server's limit of 1 s" in caught.value.message
    # The limit, one 1 s output chunk and a decoder frame at most: far from the 60 s in the file.
    assert 0 < sum(decoded) <= 3 * SAMPLE_RATE


# --- log-mel ---------------------------------------------------------------------------------------


def speech_like(seconds: float) -> np.ndarray:
    """float32: a tone, noise, and a 0.5 s silent gap (so the max - 8 clamp is exercised)."""
    rng = np.random.default_rng(1)
    samples = tone(SAMPLE_RATE, seconds) + 0.05 * rng.standard_normal(round(seconds * SAMPLE_RATE))
    gap = len(samples) // 3
    samples[gap : gap + SAMPLE_RATE // 2] = 0
    return samples.astype(np.float32)


@pytest.fixture(scope="module")
def extractors():
    transformers = pytest.importorskip("transformers")
    return {n: transformers.WhisperFeatureExtractor(feature_size=n) for n in (80, 128)}


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_equal_transformers(n_mels: int, extractors):
    from transformers.audio_utils import mel_filter_bank

    reference = mel_filter_bank(
        num_frequency_bins=201,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=16000,
        norm="slaney",
        mel_scale="slaney",
    )
    assert mel_filters(n_mels).shape == (201, n_mels)
    np.testing.assert_array_equal(mel_filters(n_mels), reference)  # same operations, same order
    np.testing.assert_array_equal(mel_filters(n_mels), extractors[n_mels].mel_filters)


# Measured max abs differences (values lie in about [-1.5, 1.5]):
# - against the extractor's numpy path (`_np_extract_fbank_features`): 0, bit for bit; 1e-6 allowed
#   for BLAS summation order;
# - against `extractor(...)`, which takes its torch path (float32 STFT) when torch is installed:
#   up to 3.0e-5; 1e-4 allowed.
NUMPY_PATH_ATOL = 1e-6
CALL_ATOL = 1e-4


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_short_clip_padded_to_30s(n_mels: int, extractors):
    extractor = extractors[n_mels]
    samples = speech_like(7.3)
    ours = log_mel(samples, n_mels, padding=N_SAMPLES - len(samples))
    assert ours.shape == (n_mels, N_FRAMES) and ours.dtype == np.float32
    called = extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    np.testing.assert_allclose(ours, called, rtol=0, atol=CALL_ATOL)
    padded = np.concatenate([samples, np.zeros(N_SAMPLES - len(samples), np.float32)])
    numpy_path = extractor._np_extract_fbank_features(padded[None], "cpu")[0]
    np.testing.assert_allclose(ours, numpy_path, rtol=0, atol=NUMPY_PATH_ATOL)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_long_clip_unpadded(n_mels: int, extractors):
    extractor = extractors[n_mels]
    samples = speech_like(75.01)  # 1_200_160 samples: not a multiple of 30 s
    ours = log_mel(samples, n_mels)
    assert ours.shape == (n_mels, len(samples) // HOP_LENGTH) == (n_mels, 7501)
    assert ours.flags.c_contiguous
    called = extractor(
        samples, sampling_rate=SAMPLE_RATE, return_tensors="np", truncation=False, padding="longest"
    ).input_features[0]
    np.testing.assert_allclose(ours, called, rtol=0, atol=CALL_ATOL)
    numpy_path = extractor._np_extract_fbank_features(samples[None], "cpu")[0]
    np.testing.assert_allclose(ours, numpy_path, rtol=0, atol=NUMPY_PATH_ATOL)


def test_log_mel_frames_and_range():
    samples = speech_like(1.0)
    for padding in (0, 1, 159, 160, 1000):
        assert log_mel(samples, 80, padding=padding).shape == (80, (len(samples) + padding) // HOP_LENGTH)
    mel = log_mel(samples, 80)
    # The clamp: nothing below the max - 8 (in log10), i.e. 2 after (x + 4) / 4.
    assert mel.max() - mel.min() == pytest.approx(2.0, abs=1e-6)
    assert log_mel(samples[: HOP_LENGTH - 1], 80).shape == (80, 0)
