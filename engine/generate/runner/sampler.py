"""Token sampling on device: penalties, bias, temperature, top-k / top-p / min-p, logprobs.

Every row draws its randomness from a key folded from (its request's seed, the position of the
token being sampled), so a seeded request samples the same tokens whatever else is in the batch,
and a preempted request that is recomputed samples them again.

Logprobs are those of the model's own distribution (log-softmax of the raw logits), before
penalties, bias and temperature, as vLLM reports them.

Sampling draws one uniform number per row and inverts the cumulative distribution, which on CPU
costs far less than a Gumbel draw over the whole vocabulary.

Five switches are static (engine.generate.planner.SamplerSwitches), each compiled variant built on
first use (warm-up builds the common ones): `random` (any row samples; otherwise argmax only),
`logprobs` (any row wants logprobs), `penalize` (dense per-row arrays for presence/frequency/
repetition penalties, logit bias and min_tokens) and `filter` (a sort over the vocabulary for
top-k / top-p / min-p), `constrain` (a token bitmask per row from the rows' grammars; every
token not allowed gets -inf, after penalties and before temperature). Greedy tokens come from the
attention backend's `argmax`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from engine.generate.request import MAX_TOP_LOGPROBS
from engine.step.plan import SamplerSwitches, SamplingInputs


class SampleOutput(NamedTuple):
    tokens: jax.Array  # i32[R]
    logprobs: jax.Array  # f32[R] of the chosen token
    top_ids: jax.Array  # i32[R, MAX_TOP_LOGPROBS]
    top_logprobs: jax.Array  # f32[R, MAX_TOP_LOGPROBS]


def sample(logits: jax.Array, inputs: SamplingInputs, switches: SamplerSwitches,
           argmax: Callable[[jax.Array], jax.Array]) -> SampleOutput:
    """Tokens (and logprobs, when switched on) of every row; `argmax` gives greedy tokens."""
    logits = logits.astype(jnp.float32)
    adjusted = _penalize(logits, inputs) if switches.penalize else logits
    if switches.constrain:
        adjusted = _constrain(adjusted, inputs.allowed)
    tokens = argmax(adjusted)
    if switches.random:
        scaled = adjusted / jnp.maximum(inputs.temperature, 1e-5)[:, None]
        uniform = jax.vmap(_uniform)(inputs.seed, inputs.position)
        drawn = _filtered_draw(scaled, uniform, inputs) if switches.filter else _draw(scaled, uniform)
        tokens = jnp.where(inputs.temperature == 0.0, tokens, drawn)
    tokens = tokens.astype(jnp.int32)
    rows = logits.shape[0]
    if not switches.logprobs:
        k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
        return SampleOutput(tokens, jnp.zeros(rows), jnp.zeros((rows, k), jnp.int32), jnp.zeros((rows, k)))
    chosen, top_ids, top_logprobs = token_logprobs(logits, tokens)
    return SampleOutput(tokens, chosen, top_ids, top_logprobs)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprob of `targets` under `logits` (f[N, V]) and the top alternatives (prompt logprobs)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(MAX_TOP_LOGPROBS, logits.shape[-1]))
    return chosen, top_ids.astype(jnp.int32), top_logprobs


def _uniform(seed, position):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), seed), position)
    return jax.random.uniform(key, (), jnp.float32)


def _draw(scaled, uniform):
    """Invert the cumulative distribution of softmax(scaled) at `uniform` (one per row)."""
    cdf = jnp.cumsum(jax.nn.softmax(scaled, axis=-1), axis=-1)
    index = jnp.minimum(jnp.sum(cdf <= (uniform * cdf[:, -1])[:, None], axis=-1), scaled.shape[-1] - 1)
    # a token of probability 0 (masked, filtered) is never drawn, even where rounding points at one
    impossible = jnp.take_along_axis(scaled, index[:, None], axis=-1)[:, 0] == -jnp.inf
    return jnp.where(impossible, jnp.argmax(scaled, axis=-1), index)


def _penalize(logits, inputs: SamplingInputs):
    seen = (inputs.output_counts > 0) | inputs.prompt_mask
    rep = inputs.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - inputs.frequency[:, None] * inputs.output_counts
    logits = logits - inputs.presence[:, None] * (inputs.output_counts > 0)
    return logits + inputs.bias


def _constrain(logits, allowed):
    """-inf for every token whose bit is clear in `allowed` (i32[R, ceil(V / 32)])."""
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    keep = bits.reshape(allowed.shape[0], -1)[:, : logits.shape[-1]].astype(bool)
    return jnp.where(keep, logits, -jnp.inf)


def _filtered_draw(scaled, uniform, inputs: SamplingInputs):
    """Draw among the tokens that survive top-k, top-p and min-p, in sorted order."""
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    rank = jnp.arange(scaled.shape[-1])[None, :]
    keep = (inputs.top_k[:, None] == 0) | (rank < inputs.top_k[:, None])
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < inputs.top_p[:, None]  # the token crossing top_p stays
    keep &= probs >= inputs.min_p[:, None] * probs[:, :1]
    choice = _draw(jnp.where(keep, ranked, -jnp.inf), uniform)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
