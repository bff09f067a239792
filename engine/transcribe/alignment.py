"""Token timings of a decoded Whisper window from its alignment heads' cross-attention: the dynamic
time warping of OpenAI's `find_alignment`, as transformers' `_extract_token_timestamps` runs it.
Pure numpy.

For the rows of the window's sampled tokens (its prefix dropped), the weights are cropped to the
window's audio, normalised per audio position over the rows, smoothed along the audio with a median
filter, averaged over the heads; the cheapest monotonic path through their negation pairs each row
with audio positions, and a row's time is where the path first enters it. Row t reads token t and
predicts the next, so its time is where token t ends. The last sampled token (<|endoftext|>,
never fed) takes the time of the token before it.
"""

from __future__ import annotations

import numpy as np

from engine.transcribe.decoding import FRAMES_PER_TIMESTAMP, TIME_PRECISION


def token_times(weights: np.ndarray, prefix_length: int, sampled: int, frames: int, filter_width: int
                ) -> np.ndarray:
    """float64 seconds from the window's start at which each sampled token ends (`sampled` of them).
    `weights`: float32 [heads, rows, source] for the fed tokens (prefix + sampled but the last:
    rows >= prefix_length + sampled - 1); `frames`: the window's mel frames of real audio."""
    rows = weights[:, prefix_length: prefix_length + sampled - 1, : max(frames // FRAMES_PER_TIMESTAMP, 1)]
    if rows.shape[1] == 0:
        return np.zeros(sampled)
    mean = rows.mean(axis=1, keepdims=True)
    std = rows.std(axis=1, keepdims=True)
    matrix = median_filter((rows - mean) / std, filter_width).mean(axis=0)
    text_indices, time_indices = dtw(-matrix)
    jumps = np.diff(text_indices, prepend=-1).astype(bool)
    times = time_indices[jumps] * TIME_PRECISION
    return np.concatenate([times, times[-1:]])


def median_filter(values: np.ndarray, width: int) -> np.ndarray:
    """The median of each `width` (odd) neighbours along the last axis, edges reflected (unchanged
    where the axis is no longer than width // 2, as transformers leaves it)."""
    pad = width // 2
    if values.shape[-1] <= pad:
        return values
    padded = np.pad(values, [(0, 0)] * (values.ndim - 1) + [(pad, pad)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.sort(windows, axis=-1)[..., pad]


def dtw(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row indices, column indices) of the cheapest monotonic path through `matrix` [rows, cols]
    from its first cell to its last. Cells are filled an anti-diagonal at a time (each depends only
    on the two before); costs accumulate in float32 and ties break diagonal, then up, then left,
    as transformers' `_dynamic_time_warping` breaks them."""
    n, m = matrix.shape
    cost = np.full((n + 1, m + 1), np.inf, np.float32)
    trace = np.full((n + 1, m + 1), -1, np.int8)
    cost[0, 0] = 0
    values = matrix.astype(np.float32)
    for diagonal in range(2, n + m + 1):
        i = np.arange(max(1, diagonal - m), min(n, diagonal - 1) + 1)
        j = diagonal - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        choice = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
        cost[i, j] = values[i - 1, j - 1] + np.choose(choice, (c0, c1, c2))
        trace[i, j] = choice
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        step = trace[i, j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    path.reverse()
    return np.array([p[0] for p in path]), np.array([p[1] for p in path])
