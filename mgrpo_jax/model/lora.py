"""LoRA adapters over the transformer's named projections (native: ``W x + (alpha / rank) B A x``).

A ``Transformer`` built with ``lora=LoraSpec(...)`` holds, beside each targeted stacked projection ``W``
(``q, k, v, o, gate, up, down``), two ``nnx.LoRAParam`` factors (float32 whatever ``param_dtype`` is)::

    {name}_lora_a  [L, *in_axes, rank]   ~ N(0, 1 / fan_in)
    {name}_lora_b  [L, rank, *out_axes]  zeros, so a fresh adapter leaves the model unchanged

``Layers.arrays()`` hands ``block`` the B factor already multiplied by ``alpha / rank``, and ``block`` adds
``dense(dense(x, A), B)`` to the projection: the adapted weight is never materialised in the train step, and
its gradient flows to the small factors only. ``nnx.split(model, nnx.LoRAParam, nnx.Param)`` separates the
adapters (what trains) from the base (a plain ``Transformer``'s state, path for path: the frozen base and
the KL reference, which is the base with the adapters off). ``merge_adapters`` folds them into the base
(the sampler's weights and the exported checkpoint).

Why not qwix: its LoRA provider intercepts ``nnx.Linear`` / einsum / ``dot_general`` calls by module path;
our projections are pure functions (``dense``, a custom-VJP product) over stacked arrays under ``lax.scan``,
all inside one module, so qwix finds only the tied embedding's einsum and none of the projections.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp

# Each adaptable projection and how many leading (after the layer axis) input axes it contracts.
PROJECTIONS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which projections get adapters and their shape: ``rank`` > 0, ``scale = alpha / rank``."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return float(self.alpha) / int(self.rank)


def lora_spec(lora_cfg) -> LoraSpec | None:
    """The spec of an ``agent.lora`` config section, None when ``rank`` is 0 (LoRA off).

    ``target`` is a regular expression searched in each projection's module path ``layers/<name>``
    (``"."``: all of them; ``"layers/(q|v)$"``: queries and values)."""
    if lora_cfg is None or not int(lora_cfg.get("rank", 0) or 0):
        return None
    rank, alpha, target = int(lora_cfg.rank), float(lora_cfg.get("alpha", lora_cfg.rank)), str(lora_cfg.target)
    if rank < 0:
        raise ValueError(f"lora.rank={rank}: must be >= 0 (0 = off)")
    if alpha <= 0:
        raise ValueError(f"lora.alpha={alpha}: must be > 0")
    if float(lora_cfg.get("dropout", 0.0) or 0.0) != 0.0:
        raise ValueError(f"lora.dropout={lora_cfg.dropout}: only 0 is supported (log-probs must be deterministic)")
    try:
        pattern = re.compile(target)
    except re.error as e:
        raise ValueError(f"lora.target={target!r}: not a regular expression ({e})") from None
    targets = tuple(n for n in PROJECTIONS if pattern.search(f"layers/{n}"))
    if not targets:
        raise ValueError(f"lora.target={target!r}: matches none of the projections "
                         f"{[f'layers/{n}' for n in PROJECTIONS]}")
    return LoraSpec(rank, alpha, targets)


def adapter_shapes(shapes: dict, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """Shapes of the adapter factors, by name, for the projections of ``shapes`` (``param_shapes``)."""
    missing = [name for name in spec.targets if name not in shapes]
    if missing:  # e.g. gate/up/down of a model whose every MLP is a mixture of experts
        raise ValueError(f"LoRA targets {missing} are not projections of this model (a mixture-of-experts layer's "
                         "experts take no adapters); narrow lora.target, e.g. 'layers/(q|k|v|o)$'")
    out = {}
    for name in spec.targets:
        shape, n_in = shapes[name], PROJECTIONS[name]
        out[name + SUFFIX_A] = (*shape[:1 + n_in], spec.rank)
        out[name + SUFFIX_B] = (shape[0], spec.rank, *shape[1 + n_in:])
    return out


def adapter_axes(param_axes: dict, name: str) -> tuple:
    """Logical axes of an adapter factor: its projection's, with a replicated rank axis."""
    base = name[:-len(SUFFIX_A)]
    axes, n_in = param_axes[base], PROJECTIONS[base]
    if name.endswith(SUFFIX_A):
        return (*axes[:1 + n_in], None)
    return (axes[0], None, *axes[1 + n_in:])


def init_adapters(shapes: dict, spec: LoraSpec, key: jax.Array) -> dict[str, jax.Array]:
    """A ~ N(0, 1 / fan_in), B = 0 (float32)."""
    out = {}
    for i, (name, shape) in enumerate(sorted(adapter_shapes(shapes, spec).items())):
        if name.endswith(SUFFIX_A):
            fan_in = math.prod(shape[1:-1])
            out[name] = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) / math.sqrt(fan_in)
        else:
            out[name] = jnp.zeros(shape, jnp.float32)
    return out


def lora_delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``scale * A B`` in float32, shaped like the projection (``[L, *in, *out]``)."""
    L, r = a.shape[0], a.shape[-1]
    prod = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r).astype(jnp.float32),
                      b.reshape(L, r, -1).astype(jnp.float32))
    return (scale * prod).reshape(*a.shape[:-1], *b.shape[2:])


def merge_adapters(layers: dict, adapters: dict, scale: float) -> dict:
    """The stacked layer arrays with every adapter folded in: ``W + scale A B`` in ``W``'s dtype."""
    out = dict(layers)
    for name in PROJECTIONS:
        a = adapters.get(name + SUFFIX_A)
        if a is not None:
            w = layers[name]
            out[name] = (w.astype(jnp.float32) + lora_delta(a, adapters[name + SUFFIX_B], scale)).astype(w.dtype)
    return out
