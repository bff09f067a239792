"""paged_model's rotary tables (cos and sin computed once per step) against levanter's rotary modules."""

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from levanter.layers.rotary import (DefaultRotaryEmbeddingsConfig, Llama3RotaryEmbeddingsConfig,
                                    YarnRotaryEmbeddingsConfig)

from engine.model.paged_model import rotary_tables, rotate


@pytest.mark.parametrize("config", [
    DefaultRotaryEmbeddingsConfig(theta=10000.0),
    DefaultRotaryEmbeddingsConfig(theta=10000.0, factor=2.0),
    Llama3RotaryEmbeddingsConfig(original_max_position_embeddings=64),
    YarnRotaryEmbeddingsConfig(factor=4.0, original_max_position_embeddings=64),
], ids=["default", "linear", "llama3", "yarn"])
def test_rotate_with_tables_equals_the_levanter_module(config):
    """Positions far apart and repeated (a ragged batch), two head axes; yarn scales cos and sin."""
    Pos, Heads, Group, Head = hax.Axis("position", 7), hax.Axis("kv_head", 2), hax.Axis("group", 3), hax.Axis(
        "head_size", 16)
    rot_embs = config.build(Head)
    positions = hax.named(jnp.array([0, 1, 2, 2, 63, 500, 4095], jnp.int32), Pos)
    x = hax.random.normal(jax.random.PRNGKey(0), (Pos, Heads, Group, Head))

    @jax.jit
    def both(x, positions):
        return rotate(x, rotary_tables(rot_embs, positions), Head), rot_embs(x, positions)

    got, want = both(x, positions)
    assert got.axes == want.axes
    np.testing.assert_allclose(np.asarray(got.array), np.asarray(want.array), rtol=1e-6, atol=1e-6)
