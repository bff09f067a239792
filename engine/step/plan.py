"""The step plan: one generation step as plain data, what the device side reads and nothing live.
Pure Python and numpy. engine.generate.planner builds it from the scheduler's decision; the
executors send it to the hosts of a replica (it pickles); the runner, the backends and the model
read it; `StepOutput` is the device side's answer.

Token layout (see engine.step.buckets): row k of `plan.rows` (decodes first, then prompt rows)
owns tokens [q_start[k], q_start[k] + q_lens[k]), packed one after another; `token_row` names each
token's row. Every token writes its key and value to `kv_dest` (page * page_size + slot) before
attention reads the pages, so a row sees its own new tokens. Padding sits at the end only: padding
tokens write to the scratch page and belong to the last row; padding rows start where the tokens
end and have q_lens = kv_lens = 0.

Sampling slots: each row samples from its last token, a row with guesses (speculative decoding:
its own token, then the guesses, engine.generate.speculation) from each of its last 1 + k tokens.
The slots are numbered row after row (`RowSlots.slots` names each row's first); slot j samples
from token `sample_index[j]` at position `sampling.position[j]`, and its token lands in slot j of
the step's output.

A row whose last token is still being sampled by the previous step (async scheduling: a
placeholder on the host) takes it from that step's sampled tokens on the device: `prev_slot[t]`
names the slot, and `reads_step` names the step, so a host that did not run that step refuses.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import NamedTuple, Optional

import numpy as np

from engine.step.buckets import Bucket


class StepInputs(NamedTuple):
    """The model's inputs of one step (numpy on the host; a NamedTuple, flattened by jit in C++)."""

    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    kv_dest: np.ndarray  # i32[T] flat cache slot of each token's key/value; padding -> scratch page
    prev_slot: np.ndarray  # i32[T] slot of the previous step's sampled token that replaces it, or -1
    token_row: np.ndarray  # i32[T] the row each token belongs to (padding tokens: the last row)
    # per row, max_num_seqs rows whatever the bucket (the forward program depends on T alone):
    page_table: np.ndarray  # i32[S, L] pages of each row's sequence over max_model_len (padding -> scratch page 0)
    kv_lens: np.ndarray  # i32[S] tokens in the cache after this step (0 for padding rows)
    q_start: np.ndarray  # i32[S] first token of the row
    q_lens: np.ndarray  # i32[S] tokens of the row in this step (0 for padding rows)
    sample_index: np.ndarray  # i32[N] token each sampling slot samples after (N: max_samples; the head reads [0, R))
    adapter: np.ndarray  # i32[S] LoRA slot of the row's adapter (-1: the base model; padding rows too)
    long_rope: np.ndarray  # bool[S] the row's sequence rotates with longrope's long factors (engine.layers.rope)


class SamplingInputs(NamedTuple):
    """Per sampling slot parameters, f/i[R] (a row's slots share its request's); the dense arrays
    are None unless `penalize`."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray  # u32[R]
    position: np.ndarray  # i32[R] position of the token being sampled
    presence: Optional[np.ndarray] = None
    frequency: Optional[np.ndarray] = None
    repetition: Optional[np.ndarray] = None
    output_counts: Optional[np.ndarray] = None  # f32[R, V] occurrences in the output so far
    prompt_mask: Optional[np.ndarray] = None  # bool[R, V] token occurs in the prompt
    bias: Optional[np.ndarray] = None  # f32[R, V] logit bias; -inf blocks EOS before min_tokens
    allowed: Optional[np.ndarray] = None  # i32[R, ceil(V / 32)] bit t: token t may be sampled (`constrain`)


class SamplerSwitches(NamedTuple):
    """The sampler's static switches (one compiled variant each; see engine.generate.runner.sampler)."""

    random: bool = False
    logprobs: bool = False
    penalize: bool = False
    filter: bool = False
    constrain: bool = False

    @property
    def name(self) -> str:
        """The switches that are on, joined by '+' ('greedy' when none is)."""
        return "+".join(field for field in self._fields if getattr(self, field)) or "greedy"


WARM_SAMPLER_SWITCHES = (SamplerSwitches(), SamplerSwitches(random=True),
                         SamplerSwitches(random=True, logprobs=True), SamplerSwitches(constrain=True),
                         SamplerSwitches(random=True, constrain=True))
"""The variants warm-up compiles (once per distinct row count: a few seconds); penalties and
top-k/p filtering compile on first use."""
FIRST_SAMPLER_SWITCHES = (SamplerSwitches(), SamplerSwitches(random=True))
"""The variants of the first bucket's rows compiled before a replica serves: greedy and random
sampling, what most requests take; its other warm variants are the first background compile."""


class DraftInputs(NamedTuple):
    """What a draft model's propose program reads (engine.generate.runner.draft), per row: rows for a rung
    of the token ladder (one program each), a row that does not propose with token 0 at position
    0 and no pages."""

    tokens: np.ndarray  # i32[S] the sequence's last token (in neither model's cache yet)
    positions: np.ndarray  # i32[S] its position
    page_table: np.ndarray  # i32[S, L] the sequence's pages (past them: the scratch page)
    steps: np.ndarray  # i32[1] decode steps to run: the most guesses a row takes


class PromptLogprobInputs(NamedTuple):
    index: np.ndarray  # i32[P] token whose logits predict the target (P a power of two, padded)
    targets: np.ndarray  # i32[P] the prompt token predicted


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything the device side needs to run one step, and nothing live."""

    step_id: int
    bucket: Bucket
    inputs: StepInputs
    sampling: SamplingInputs
    switches: SamplerSwitches
    prompt_logprobs: Optional[PromptLogprobInputs] = None
    reads_step: Optional[int] = None
    """The step whose sampled tokens `inputs.prev_slot` indexes (None: no token is pending)."""

    @property
    def fingerprint(self) -> int:
        """What every host of a replica must agree on before running the step: its id and every
        static shape and switch (a host that compiled another program would silently compute
        garbage with its peers)."""
        shapes = [a.shape for a in (*self.inputs, *self.sampling) if a is not None]
        prompt = None if self.prompt_logprobs is None else self.prompt_logprobs.index.shape
        text = repr((self.step_id, self.bucket, tuple(self.switches), shapes, prompt, self.reads_step))
        return zlib.crc32(text.encode()) & 0x7FFFFFFF  # fits the int32 a device all-gather carries


class StepOutput(NamedTuple):
    """What a step produced, on the host: the device side's answer to a `StepPlan`."""

    tokens: np.ndarray  # i32[R] sampled token of each sampling slot (padding slots: garbage)
    logprobs: Optional[np.ndarray] = None  # f32[R] of the sampled token, when the switches asked
    top_ids: Optional[np.ndarray] = None  # i32[R, 20]
    top_logprobs: Optional[np.ndarray] = None  # f32[R, 20]
    prompt: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
    """(logprob of each target, top ids, top logprobs) for `StepPlan.prompt_logprobs`."""
