"""The template of a quantized checkpoint's model: which of its layers keep the checkpoint's low-bit
bytes (engine.layers.fp8, engine.layers.mxfp4), found by their checkpoint names as haliax's
state-dict loader names them, so that the loader fills each from the checkpoint's own tensors."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import equinox as eqx
import haliax.nn as hnn
import jax
from haliax.nn.scan import BlockSeq, Stacked
from haliax.state_dict import ModuleWithStateDictSerialization, with_prefix

from engine.formats.checkpoint_quantization import CheckpointQuantization
from engine.layers.fp8 import Fp8Linear, Fp8MoELinear
from engine.layers.moe import ExpertMlps, MoE
from engine.layers.mxfp4 import Mxfp4MoELinear


def with_quantized_layers(model, quantization: CheckpointQuantization, quantized: Callable[[str], bool],
                          parts: Optional[dict[str, int]] = None):
    """`model` (a template: call under `eqx.filter_eval_shape`) with every layer that `quantized(its
    checkpoint name)` says the checkpoint holds quantized made the module that keeps its bytes, and
    the set of those names: FP8 linear layers and expert stacks (`Fp8Linear`, `Fp8MoELinear`), MXFP4
    expert stacks (`Mxfp4MoELinear`). An expert stack goes by its checkpoint name (stacked) or its
    first expert's. Routers stay float (a flipped choice costs more than their few bytes save). The
    layers of a stack must agree. `parts`: how many parts the serving layout splits each axis into
    (FP8 scales are never split within a block: engine.layers.fp8.scale_axes)."""
    names: set[str] = set()

    def linear(module, name):
        if isinstance(module, hnn.Linear) and quantization.method != "mxfp4" and quantized(name):
            names.add(name)
            return Fp8Linear.like(module, quantization, parts)
        return module

    def experts(mlps: ExpertMlps, prefix):
        stacks = [getattr(mlps, field) for field in ("gate_proj", "up_proj", "down_proj")]
        count = mlps.gate_proj.Experts.size
        for i, name in enumerate(mlps.names):
            if quantized(with_prefix(prefix, name)):
                names.add(with_prefix(prefix, name))
            elif quantized(with_prefix(prefix, f"0.{name}")):
                names.update(with_prefix(prefix, f"{e}.{name}") for e in range(count))
            else:
                continue
            mxfp4 = quantization.method == "mxfp4"
            stacks[i] = Mxfp4MoELinear.like(stacks[i]) if mxfp4 else Fp8MoELinear.like(stacks[i], quantization, parts)
        return _replaced(mlps, dict(zip(("gate_proj", "up_proj", "down_proj"), stacks)))

    def walk(tree, prefix):
        if isinstance(tree, hnn.Linear):
            return linear(tree, prefix)
        if isinstance(tree, MoE):
            return _replaced(tree, {"experts": experts(tree.experts, with_prefix(prefix, "experts")),
                                    "shared": walk(tree.shared, with_prefix(prefix, "shared_experts"))})
        if isinstance(tree, Stacked):
            layers = [walk(tree.stacked, with_prefix(prefix, str(i))) for i in range(tree.Block.size)]
            if len({jax.tree_util.tree_structure(layer) for layer in layers}) > 1:
                raise ValueError(f"the layers under {prefix} differ in which weights are FP8; this loader needs "
                                 "every layer of a stack alike")
            return _replaced(tree, {"stacked": layers[0]})
        if isinstance(tree, BlockSeq):
            blocks = [walk(block, with_prefix(prefix, str(i))) for i, block in enumerate(tree.blocks)]
            return _replaced(tree, {"blocks": blocks})
        if isinstance(tree, (list, tuple)):
            return type(tree)(walk(item, with_prefix(prefix, str(i))) for i, item in enumerate(tree))
        if isinstance(tree, eqx.Module):
            keys = tree._state_dict_key_map() if isinstance(tree, ModuleWithStateDictSerialization) else {}
            fields = [f.name for f in dataclasses.fields(tree) if not f.metadata.get("static", False)]
            return _replaced(tree, {f: walk(getattr(tree, f), with_prefix(prefix, keys.get(f, f))) for f in fields})
        return tree

    return walk(model, None), names


def _replaced(module, fields: dict):
    """`module` with the `fields` that changed replaced (equinox's tree_at: no __init__ runs)."""
    changed = {name: value for name, value in fields.items() if value is not getattr(module, name)}
    if not changed:
        return module
    return eqx.tree_at(lambda m: [getattr(m, name) for name in changed], module, list(changed.values()))
