"""The draft model of speculative decoding (`speculative: {method: draft_model}`): a small model
of the served model's vocabulary that guesses its next tokens. Device side, driven by the
`ModelRunner`.

Its KV cache has the served model's pages: the same page indices, in a pool of its own shape, so
a sequence's pages hold both models' keys and values and the scheduler allocates for both at
once. Two programs:

- `forward`: every step's tokens through the draft, right after the served model's forward over
  the same inputs (one program per bucket), so the draft's cache always holds what the served
  model's does, prompts and prefix-cache pages included.
- `propose`: from each sequence's last token (not yet in either cache), `num_tokens` greedy decode
  steps of the draft at most (as many as the row taking the most guesses needs), one token per
  row each, writing the draft's keys and values as it goes; returns the guesses. One program per
  rung of the token ladder up to a full batch of decodes (the rows it proposes for), so a lone
  sequence's guesses cost decode steps of one token. The engine gives each sequence the pages
  its guesses stand in first; a write past them lands in the scratch page (a poorer guess after
  it, never a wrong output: every guess is checked).
"""

from __future__ import annotations

import dataclasses
import functools

import haliax as hax
import jax
import jax.numpy as jnp

from engine.backends.base import AttentionBackend
from engine.generate.pages import SCRATCH_PAGE
from engine.models.paged_model import (
    ServingModel,
    forward,
    unembed,
    with_previous_tokens,
)
from engine.step.plan import DraftInputs, StepInputs


@dataclasses.dataclass(frozen=True)
class DraftShape:
    """The static sizes of the propose programs (their rows come with their inputs)."""

    num_tokens: int
    """Guesses per row (decode steps of the draft)."""
    page_size: int


class DraftSteps:
    """The draft's jitted programs over its flat weights (as engine.generate.runner.step_programs.StepPrograms)."""

    def __init__(self, model: ServingModel, backend: AttentionBackend, shape: DraftShape, gathered, cache_sharding):
        self.num_tokens = shape.num_tokens
        self.weights, treedef = jax.tree_util.tree_flatten(model)
        unflatten = functools.partial(jax.tree_util.tree_unflatten, treedef)
        constrain = jax.lax.with_sharding_constraint

        @functools.partial(jax.jit, donate_argnums=(1,))
        def forward_step(weights, cache, inputs: StepInputs, prev_tokens):
            _, cache = forward(unflatten(weights), backend, cache, with_previous_tokens(inputs, prev_tokens))
            return constrain(cache, cache_sharding)

        @functools.partial(jax.jit, donate_argnums=(1,))
        def propose_step(weights, cache, draft: DraftInputs):
            model = unflatten(weights)

            def decode(step, carry):
                cache, tokens, positions, guesses = carry
                hidden, cache = forward(model, backend, cache, _decode_inputs(draft, tokens, positions, shape))
                rows = hax.named(hidden.array[: tokens.shape[0]], ("row", model.Embed))
                tokens = backend.argmax(gathered(unembed(model, rows).array)).astype(jnp.int32)
                return cache, tokens, positions + 1, guesses.at[:, step].set(tokens)

            guesses = jnp.zeros((draft.tokens.shape[0], shape.num_tokens), jnp.int32)
            cache, _, _, guesses = jax.lax.fori_loop(0, jnp.minimum(draft.steps[0], shape.num_tokens), decode,
                                                     (cache, draft.tokens, draft.positions, guesses))
            return guesses, constrain(cache, cache_sharding)

        self._forward, self._propose = forward_step, propose_step

    def forward(self, cache, inputs: StepInputs, prev_tokens):
        """The step's tokens into the draft's cache (donated; the updated cache is returned)."""
        return self._forward(self.weights, cache, inputs, prev_tokens)

    def propose(self, cache, draft: DraftInputs):
        """(guesses i32[S, num_tokens], of which the first `draft.steps` columns are made; the
        updated cache); donates `cache`."""
        return self._propose(self.weights, cache, draft)

    def lower_forward(self, cache, inputs, prev_tokens):
        return self._forward.lower(self.weights, cache, inputs, prev_tokens)

    def lower_propose(self, cache, draft):
        return self._propose.lower(self.weights, cache, draft)


def _decode_inputs(draft: DraftInputs, tokens, positions, shape: DraftShape) -> StepInputs:
    """One decode step of every row in the packed layout (row r's token in slot r, a rung of the
    token ladder: the shapes a backend prepared its matmuls for); positions past the page table
    write to the scratch page."""
    rows, width = draft.page_table.shape
    page_size = shape.page_size
    inside = positions < width * page_size
    at = jnp.minimum(positions, width * page_size - 1)
    page = jnp.take_along_axis(draft.page_table, (at // page_size)[:, None], axis=1)[:, 0]
    index = jnp.arange(rows, dtype=jnp.int32)
    return StepInputs(
        tokens=tokens,
        positions=at,
        kv_dest=jnp.where(inside, page * page_size + at % page_size, SCRATCH_PAGE * page_size),
        prev_slot=jnp.full(rows, -1, jnp.int32),
        token_row=index,
        page_table=draft.page_table,
        kv_lens=at + 1,
        q_start=index,
        q_lens=jnp.ones(rows, jnp.int32),
        sample_index=index,
        adapter=jnp.full(rows, -1, jnp.int32),
        long_rope=jnp.zeros(rows, jnp.bool_),  # a draft model with longrope guesses with its short factors
    )
