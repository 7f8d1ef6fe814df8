"""The sampler's layout of a model's weights for its decode loop (same values, laid out once per call).

The model's call has one path, :func:`mgrpo_jax.model.forward` over plain arrays
(``Transformer.arrays()``); the decode loop calls it once per token on the arrays this module lays out
once per sampler call, outside the loop:

- ``layers`` as a list of per-layer dicts (``unstack_layers``): an unrolled forward slices each layer's
  weights out of the stacked arrays, and XLA does not hoist those copies out of a ``while`` loop by itself.
- ``out_major``: the MLP matrices transposed to ``[out, in]`` (``gate_t`` / ``up_t`` / ``down_t``, which
  ``mgrpo_jax.model.transformer.block`` reads), and the LM head as ``lm_head_t [vocab, d_model]`` (a tied
  head already is: the embedding). A decode step multiplies a few rows by each matrix, so the matrix streams
  from memory once per token; XLA:CPU's matmul (YNNPACK) reads an ``[out, in]`` matrix row by row,
  contiguously. At the bench shape a decode call is 5-8% faster with the MLP out-major, 2-3% more with the
  head (``mgrpo_jax.bench.model``). Costs one copy of those weights for the call. The attention projections
  gained nothing measurable and stay as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from mgrpo_jax.model import unstack_layers

OUT_MAJOR_MATRICES = ("gate", "up", "down")  # the [in, out] layer matrices ``out_major`` transposes


def decode_layout(params: Mapping[str, Any], *, out_major: bool = False,
                  moe_layers: tuple[bool, ...] | None = None) -> dict[str, Any]:
    """``params`` (``Transformer.arrays()``) with the layers as a per-layer list and, with ``out_major``, the
    MLP matrices and an untied LM head transposed to ``[out, in]`` (module docstring). ``forward`` gives the
    same values on either. ``moe_layers``: the config's (needed where dense and MoE layers mix)."""
    layers = params["layers"]
    layers = unstack_layers(layers, moe_layers) if isinstance(layers, Mapping) else [dict(lp) for lp in layers]
    out = dict(params, layers=layers)
    if out_major:
        for lp in layers:
            for name in OUT_MAJOR_MATRICES:
                if name in lp:
                    lp[name + "_t"] = jnp.transpose(lp.pop(name))
        if "lm_head" in out:
            out["lm_head_t"] = jnp.transpose(out.pop("lm_head"))
    return out
