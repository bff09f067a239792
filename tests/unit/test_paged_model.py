"""RoPE (engine.layers.rope) against transformers' own: the inverse frequencies and attention factor
of each type from config.json, and the rotation with cos and sin computed once per step."""

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.layers.rope import Rope, rotate

BASE = dict(hidden_size=128, num_attention_heads=8, max_position_embeddings=4096)


@pytest.mark.parametrize("theta, scaling", [
    (10000.0, None),
    (10000.0, {"rope_type": "linear", "factor": 2.0}),
    (500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
    (1000000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    (10000.0, {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2, "mscale": 0.707,
               "mscale_all_dim": 0.707, "original_max_position_embeddings": 512}),
    (10000.0, {"type": "yarn", "factor": 2.0, "attention_factor": 1.25, "truncate": False}),
], ids=["default", "linear", "llama3", "yarn", "yarn-mscale", "yarn-attention-factor"])
def test_frequencies_and_attention_factor_equal_transformers(theta, scaling):
    hf = transformers.LlamaConfig(**BASE, rope_theta=theta, rope_scaling=scaling)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"))
    rope = Rope.from_hf_config({**BASE, "rope_theta": theta, "rope_scaling": scaling}, head_dim=16)
    np.testing.assert_allclose(rope.inv_freq, want_freq.numpy(), rtol=1e-6)
    assert rope.attention_factor == pytest.approx(want_factor, rel=1e-9)


def test_rotating_with_the_steps_tables_equals_transformers():
    """Positions far apart and repeated (a ragged batch), two head axes, yarn's attention factor."""
    config = {**BASE, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 1024}}
    rope = Rope.from_hf_config(config, head_dim=16)
    Pos, Heads, Group = hax.Axis("position", 7), hax.Axis("kv_head", 2), hax.Axis("group", 3)
    positions = hax.named(jnp.array([0, 1, 2, 2, 63, 500, 4095], jnp.int32), Pos)
    x = hax.random.normal(jax.random.PRNGKey(0), (Pos, Heads, Group, rope.Head))
    got = jax.jit(lambda x, p: rotate(x, rope.tables(p), rope.Head))(x, positions)

    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        transformers.LlamaConfig(**{k: v for k, v in config.items()}))
    q = torch.tensor(np.asarray(x.array)).permute(1, 2, 0, 3).reshape(1, 6, 7, 16)  # (batch, heads, position, d)
    cos, sin = hf_rope(q, torch.tensor(np.asarray(positions.array))[None])
    want = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)[0]
    want = want.reshape(2, 3, 7, 16).permute(2, 0, 1, 3).numpy()
    assert got.axes == x.axes
    # float32 angles: at position 4095 one ulp of the angle is 2.4e-4 rad, in either implementation
    np.testing.assert_allclose(np.asarray(got.array)[:6], want[:6], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.array)[6], want[6], atol=5e-4)


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_longrope_with_half_rotated_heads_rotates_as_transformers_phi3(long):
    """Phi-3's longrope (Phi-4-mini's partial_rotary_factor 0.5: 8 of 16 dims rotated, the rest
    passed through): the short factors for a sequence within original_max_position_embeddings, the
    long ones past it, both scaled by the attention factor of 4096 / 512."""
    scaling = {"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.5, 3.0, 6.0, 12.0]}
    config = {**BASE, "num_attention_heads": 8, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "original_max_position_embeddings": 512, "rope_scaling": scaling}
    rope = Rope.from_hf_config(config, head_dim=16)
    Pos, Heads, Head = hax.Axis("position", 4), hax.Axis("heads", 2), hax.Axis("head_size", 16)
    positions = hax.named(jnp.array([0, 7, 300, 511] if not long else [0, 7, 600, 2000], jnp.int32), Pos)
    x = hax.random.normal(jax.random.PRNGKey(1), (Pos, Heads, Head))
    got = jax.jit(lambda x, p: rotate(x, rope.tables(p, jnp.full(4, long)), Head))(x, positions)

    hf = transformers.Phi3Config(hidden_size=128, num_attention_heads=8, max_position_embeddings=4096,
                                 rope_theta=10000.0, partial_rotary_factor=0.5, original_max_position_embeddings=512,
                                 rope_scaling=scaling)
    hf_rope = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf)
    q = torch.tensor(np.asarray(x.array)).permute(1, 0, 2)[None]  # (batch, heads, position, d)
    cos, sin = hf_rope(q, torch.tensor(np.asarray(positions.array))[None])
    want = transformers.models.phi3.modeling_phi3.apply_rotary_pos_emb(q, q, cos, sin)[0][0].permute(1, 0, 2)
    np.testing.assert_allclose(np.asarray(got.array), want.numpy(), rtol=1e-5, atol=1e-5)
    assert np.asarray(got.array)[:, :, 8:].tolist() == np.asarray(x.array)[:, :, 8:].tolist()
