"""The audio front end of the speech-to-text endpoint: uploaded bytes to Whisper's log-mel input.

This module owns two steps, both pure numpy + PyAV (no jax, torch or transformers here):

- `decode_audio`: any file ffmpeg reads (wav, flac, mp3, ogg/vorbis, ogg/opus, webm, m4a/aac, ...)
  to float32 mono samples at `SAMPLE_RATE` (the mean of the channels), finite and in [-1, 1].
  Invariants: a PyAV/ffmpeg exception never escapes, every failure caused by the upload is a
  `BadRequest` with param "file"; the container is closed on every path; decoding stops as soon as
  the audio passes `max_seconds`, so memory and time are bounded by the limit, not by the file.
  Like ffmpeg's command line it keeps what decodes: damaged packets are skipped, a truncated file
  gives its head, and a mid-stream change of rate or channels (concatenated files) is followed.
- `log_mel` / `mel_filters`: Whisper's log-mel spectrogram (the engine cuts it into 30 s windows,
  engine.transcribe.decoding.window), numerically the numpy path of
  transformers' `WhisperFeatureExtractor` (`_np_extract_fbank_features`): the same float64 STFT and
  filter bank, the same complex64 storage of the STFT, the same float32 log-mel and clamping.
  Invariant: `log_mel(x, n, p).shape == (n, (len(x) + p) // HOP_LENGTH)`, C-contiguous.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Iterator

import av
import av.error
import numpy as np

from serve_app.errors import BadRequest

SAMPLE_RATE = 16_000  # Hz, what Whisper takes
HOP_LENGTH = 160  # samples per mel frame
N_FFT = 400
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480_000: one 30 s window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000: mel frames of one window

ACCEPTED_FORMATS = "wav, flac, mp3, ogg (vorbis or opus), webm, m4a/mp4 (aac)"
# Samples per resampled chunk (1 s): big chunks keep the per-chunk Python work negligible, small
# ones keep the max_seconds check prompt.
_CHUNK_SAMPLES = SAMPLE_RATE
# Frames per STFT block in `log_mel`: bounds its scratch memory (~40 MB) whatever the audio length.
_STFT_BLOCK_FRAMES = 4096
# The slaney mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above.
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = 15.0
_LOGSTEP = 27.0 / np.log(6.4)  # mels per natural-log unit of Hz above 1 kHz
# Everything PyAV raises for a file it cannot read (InvalidDataError is both FFmpegError and
# ValueError; odd containers also surface as ValueError or IndexError).
_DECODE_ERRORS = (av.error.FFmpegError, ValueError, IndexError)


def decode_audio(data: bytes, max_seconds: float) -> np.ndarray:
    """float32 mono samples at SAMPLE_RATE in [-1, 1] of an audio file in any container/codec ffmpeg reads.

    Raises BadRequest (param "file") for bytes that are not audio, a file with no audio stream, a file
    that decodes to no samples, or audio longer than `max_seconds`.
    """
    max_samples = math.floor(max_seconds * SAMPLE_RATE)
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except _DECODE_ERRORS as e:
        raise _not_audio(e) from e
    try:
        stream = _audio_stream(container)
        chunks = _decode_stream(container, stream, max_samples, max_seconds)
    except _DECODE_ERRORS as e:
        raise _not_audio(e) from e
    finally:
        container.close()
    if not chunks:
        raise BadRequest(
            "the uploaded audio file contains no samples; send a file with at least some audio in it", "file"
        )
    samples = np.concatenate(chunks)
    # Float codecs (pcm_f32le, ...) can carry NaN or inf; they would poison the whole log-mel.
    np.nan_to_num(samples, copy=False, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.clip(samples, -1.0, 1.0, out=samples)


def _audio_stream(container: av.container.InputContainer) -> av.AudioStream:
    """The first audio stream, which has a decoder."""
    if not container.streams.audio:
        raise BadRequest(
            f"the uploaded file has no audio stream; send an audio file ({ACCEPTED_FORMATS})", "file"
        )
    stream = container.streams.audio[0]
    if stream.codec_context is None:  # no decoder for its codec id: PyAV segfaults decoding it
        raise BadRequest(
            f"the uploaded file's audio codec is unknown or unsupported; send an audio file in a common "
            f"format ({ACCEPTED_FORMATS})",
            "file",
        )
    return stream


def _decode_stream(
    container: av.container.InputContainer, stream: av.AudioStream, max_samples: int, max_seconds: float
) -> list[np.ndarray]:
    """Non-empty float32 mono chunks at SAMPLE_RATE; raises BadRequest once they pass max_samples."""
    chunks: list[np.ndarray] = []
    total = 0  # invariant: total == sum(len(c) for c in chunks) <= max_samples
    for frame in _resampled(_decoded_frames(container, stream)):
        chunk = _to_mono(frame)
        total += len(chunk)
        if total > max_samples:
            raise _too_long(container, stream, total, max_seconds)
        if len(chunk):
            chunks.append(chunk)
    return chunks


def _decoded_frames(
    container: av.container.InputContainer, stream: av.AudioStream
) -> Iterator[av.AudioFrame]:
    """The decoded frames of `stream`, as tolerant as ffmpeg's command line.

    A packet that fails to decode is skipped and a read error ends the input, so a truncated or
    slightly damaged upload keeps the audio it has; the first error is raised if no frame decodes.
    """
    first_error: Exception | None = None
    decoded_any = False
    packets = container.demux(stream)  # ends with empty packets, which flush the decoder
    while True:
        try:
            packet = next(packets)
        except StopIteration:
            break
        except _DECODE_ERRORS as e:  # unreadable from here on: flush the decoder (packet None), stop
            first_error = first_error or e
            packet = None
        try:
            frames = stream.decode(packet)
        except _DECODE_ERRORS as e:
            first_error = first_error or e
            frames = []
        decoded_any = decoded_any or bool(frames)
        yield from frames
        if packet is None:
            break
    if first_error is not None and not decoded_any:
        raise first_error


def _resampled(frames: Iterator[av.AudioFrame]) -> Iterator[av.AudioFrame]:
    """`frames` as packed float32 ("flt") at SAMPLE_RATE, their channels kept.

    A change of sample format, layout or rate mid-stream (concatenated files have them) starts a
    new resampler: one PyAV resampler takes one input setup only.
    """
    resampler: av.AudioResampler | None = None
    setup: tuple[str, str, int] | None = None
    for frame in frames:
        frame_setup = (frame.format.name, frame.layout.name, frame.sample_rate)
        if frame_setup != setup:
            yield from _flushed(resampler)
            # Channels are kept: ffmpeg's own downmix to mono in float sums stereo at 1/sqrt(2) per
            # channel (a sqrt(2) gain that clips loud correlated stereo); `_to_mono` averages, as
            # Whisper's reference loader (ffmpeg to s16 mono) does.
            resampler = av.AudioResampler(
                format="flt", layout=None, rate=SAMPLE_RATE, frame_size=_CHUNK_SAMPLES
            )
            setup = frame_setup
        yield from resampler.resample(frame)
    yield from _flushed(resampler)


def _flushed(resampler: av.AudioResampler | None) -> list[av.AudioFrame]:
    """The frames a resampler still holds."""
    if resampler is None:
        return []
    # PyAV answers a flush with [None] when it passes frames through (not with a frame_size set).
    return [frame for frame in resampler.resample(None) if frame is not None]


def _to_mono(frame: av.AudioFrame) -> np.ndarray:
    """float32 [samples]: the mean over channels of a packed "flt" frame."""
    channels = frame.layout.nb_channels
    interleaved = frame.to_ndarray().reshape(-1, channels)  # packed: shape (1, samples * channels)
    if channels == 1:
        return interleaved[:, 0]
    mono = interleaved[:, 0].copy()
    for channel in range(1, channels):  # one strided add per channel: faster than .mean(axis=1)
        mono += interleaved[:, channel]
    mono *= np.float32(1.0 / channels)
    return mono


def _not_audio(error: Exception) -> BadRequest:
    reason = error.strerror if isinstance(error, av.error.FFmpegError) and error.strerror else str(error)
    return BadRequest(
        f"could not decode the uploaded file as audio ({reason}); send an audio file in a format "
        f"ffmpeg reads: {ACCEPTED_FORMATS}, ...",
        "file",
    )


def _too_long(
    container: av.container.InputContainer, stream: av.AudioStream, decoded: int, max_seconds: float
) -> BadRequest:
    """The duration in the message is the container's if it declares one, else what was decoded so far."""
    declared = _declared_seconds(container, stream)
    if declared is not None and declared * SAMPLE_RATE > decoded:
        found = f"{declared:.1f} s long"
    else:
        found = f"longer than {decoded / SAMPLE_RATE:.1f} s"
    return BadRequest(
        f"the uploaded audio is {found}, over this server's limit of {max_seconds:g} s; send a shorter "
        "file, or split the audio into parts under the limit",
        "file",
    )


def _declared_seconds(container: av.container.InputContainer, stream: av.AudioStream) -> float | None:
    """The duration the file's headers claim (may be an estimate), or None if they claim none."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def log_mel(samples: np.ndarray, n_mels: int, padding: int = 0) -> np.ndarray:
    """float32 [n_mels, frames]: Whisper's log-mel spectrogram of `samples` followed by `padding` zeros.

    frames = (len(samples) + padding) // HOP_LENGTH. Numerically transformers' WhisperFeatureExtractor
    (numpy path): periodic Hann window, centered STFT with reflect padding, power spectrum,
    slaney mel filters, log10(max(x, 1e-10)), last frame dropped, clamped to max - 8, (x + 4) / 4.
    """
    # The extractor pads its float32 input with zeros, then promotes to float64 for the STFT.
    waveform = np.concatenate([np.asarray(samples, dtype=np.float32), np.zeros(padding, np.float32)])
    n_frames = len(waveform) // HOP_LENGTH  # the centered STFT has one more; Whisper drops it
    if n_frames == 0:
        return np.zeros((n_mels, 0), np.float32)
    padded = np.pad(waveform, N_FFT // 2, mode="reflect").astype(np.float64)
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH][:n_frames]
    filters = mel_filters(n_mels)
    log_spec = np.empty((n_mels, n_frames), np.float32)
    for start in range(0, n_frames, _STFT_BLOCK_FRAMES):
        block = frames[start : start + _STFT_BLOCK_FRAMES]
        log_spec[:, start : start + len(block)] = _log_mel_block(block, filters).T
    # float32 from here on, as in the extractor.
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def _log_mel_block(frames: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """float32 [len(frames), n_mels]: log10 of the mel power of float64 frames [len(frames), N_FFT]."""
    # The extractor stores the float64 rfft as complex64, then takes |.|**2 in float64.
    spectrum = np.fft.rfft(frames * _hann_window(), axis=-1).astype(np.complex64)
    power = np.abs(spectrum, dtype=np.float64) ** 2
    mel = np.maximum(1e-10, power @ filters)
    return np.log10(mel).astype(np.float32)


@functools.lru_cache(maxsize=1)
def _hann_window() -> np.ndarray:
    """float64 [N_FFT]: the periodic Hann window (read-only: it is shared)."""
    hann = np.hanning(N_FFT + 1)[:-1]
    hann.flags.writeable = False
    return hann


@functools.lru_cache(maxsize=8)
def mel_filters(n_mels: int) -> np.ndarray:
    """float64 [N_FFT // 2 + 1, n_mels]: slaney-scale, slaney-normalised triangular filters over 0..8000 Hz.

    Computed as transformers' `mel_filter_bank(1 + N_FFT // 2, n_mels, 0.0, 8000.0, SAMPLE_RATE,
    norm="slaney", mel_scale="slaney")`. Read-only: the cached array is shared.
    """
    mel_points = np.linspace(_hz_to_mel(0.0), _hz_to_mel(8000.0), n_mels + 2)
    filter_hz = _mel_to_hz(mel_points)
    fft_hz = np.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
    slopes = filter_hz[np.newaxis, :] - fft_hz[:, np.newaxis]
    widths = np.diff(filter_hz)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(np.zeros(1), np.minimum(down, up))
    # Slaney normalisation: each filter has about the same area (energy per channel).
    filters *= (2.0 / (filter_hz[2 : n_mels + 2] - filter_hz[:n_mels]))[np.newaxis, :]
    filters.flags.writeable = False
    return filters


def _hz_to_mel(hz: float) -> float:
    if hz >= _MIN_LOG_HZ:
        return _MIN_LOG_MEL + np.log(hz / _MIN_LOG_HZ) * _LOGSTEP
    return 3.0 * hz / 200.0


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    hz = 200.0 * mels / 3.0
    log_region = mels >= _MIN_LOG_MEL
    hz[log_region] = _MIN_LOG_HZ * np.exp((np.log(6.4) / 27.0) * (mels[log_region] - _MIN_LOG_MEL))
    return hz
