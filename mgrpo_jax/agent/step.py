"""Jitted train steps for one agent: policy-gradient (any registered loss), supervised (SFT), log-probs.

Every step is ``step(state, batch) -> (new_state, metrics)``, jitted ONCE per batch shape with explicit
in/out shardings on the agent's mesh (state by its ``state_sharding``, batch rows over the mesh's
``('data', 'fsdp')`` axes, metrics replicated) and the input state donated (its buffers are reused for
the new state; do not touch the old state after the call).

**Batch contract** (a dict of fixed-shape arrays; ``B`` rows, ``T`` tokens)::

    tokens          [B, T] int32    the full trajectory (prompt, generated turns, tool responses)
    positions       [B, T] int32    RoPE positions
    attention_mask  [B, T] bool     True on real tokens (False = padding)
    loss_mask       [B, T] float32  1 on tokens this policy generated (trained tokens); it is multiplied
                                    by attention_mask, and column 0 is never trained (it has no context)
    old_logprobs    [B, T] float32  behaviour log-probs, aligned like ``token_logprobs``:
                                    old_logprobs[:, t] = log q(tokens[:, t] | tokens[:, :t]); column 0 is 0
    advantages      [B]    float32  one advantage per row (broadcast over its trained tokens)
    weights         [B]    float32  alignment weight per row (0 = padding row: contributes nothing)
    temperature     [B]    float32  the sampling temperature each row's ``old_logprobs`` were recorded at
                                    (0 = greedy); optional, a missing key means 1 for every row
    ref_logprobs    [B, T] float32  optional, same alignment; used by the loss's KL term

The SFT step needs only ``tokens, positions, attention_mask, loss_mask`` (``weights`` optional). ``B`` must
be a multiple of ``micro_batches x (data x fsdp mesh size)``.

**The policy's log-probs are those of the behaviour distribution.** The sampler records ``log q(token)``
under ``softmax(filter(logits / temperature))`` (:mod:`mgrpo_jax.sampling.sampler`: top-k then top-p,
fixed per sampler; temperature per row; greedy rows: the unfiltered temperature-1 log-prob). The policy
step recomputes its log-probs from the same function (:func:`policy_logits`: each row at its own
``temperature``, the step's static ``top_k`` / ``top_p``), so an on-policy batch has importance ratios of
exactly 1 up to float rounding, whatever the temperature and filters. Temperature-1 rows without filters
give the model's own ``log_softmax(logits)``, as before. A token that falls outside the top-k / top-p set
after an update gets the large negative finite logit ``EXCLUDED_LOGIT`` instead of ``-inf``: its log-prob
is about -1e9, its ratio 0 and every gradient finite (the clipped surrogate sends no gradient through a
ratio of 0). The SFT step and :func:`make_logprob_fn`'s default are the model's own temperature-1,
unfiltered log-probs.

**Exact gradient accumulation.** Losses return ``(loss_sum, denominator, metrics)``
(:mod:`mgrpo_jax.core.losses`). The batch is cut into ``micro_batches`` micro-batches (row ``r`` goes to
micro-batch ``r % micro_batches``) run under ``lax.scan``; the step accumulates the gradients of
``loss_sum`` and the denominators (which do not depend on the parameters) and divides once at the end, so
the update is that of ``sum(loss_sum) / sum(denominator)`` over the whole batch, for any number of
micro-batches, up to float rounding. A batch with no trained tokens (denominator 0), or whose gradient is
not finite, leaves params and optimizer state unchanged (``metrics['skipped'] = 1``; ``step`` still
advances).

**Metrics** (replicated float32 scalars): ``loss`` (the objective), ``grad_norm`` (before clipping),
``lr`` (of this update; NaN for optimizers without an injected schedule), ``param_norm``, ``skipped``,
``loss_denominator``, and the loss's own metrics combined over micro-batches token-weighted (``tokens``
summed; ``*_min`` / ``*_max`` by min / max).

**Mixture-of-experts models** add the router's load-balancing loss (HF ``load_balancing_loss_func`` over the
real tokens, :func:`mgrpo_jax.model.moe.load_balancing_loss`) times ``router_aux_loss_coef`` (default: the
model config's) to each micro-batch's objective, weighted like it by its denominator, and log
``router_aux_loss``, each expert's share of the routed assignments (``router_share_e{i}``) and
``router_load_max_over_mean``.

**Several optimisation passes per batch (PPO epochs, the paper's mu).** Nothing special is needed: call
the step again on the same batch; ``old_logprobs`` stay the behaviour log-probs, so the importance ratio
moves away from 1 and the clip acts. With one update per pass the gradient is that of the whole batch,
so row order is irrelevant; ``run_passes(..., minibatches=n, key=...)`` splits each pass into ``n``
updates over freshly shuffled row subsets, the classic PPO schedule (build the step for ``B / n`` rows).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mgrpo_jax.agent.optim import current_lr
from mgrpo_jax.agent.state import AgentState
from mgrpo_jax.core.losses import PolicyLossInputs, get_loss
from mgrpo_jax.model import gather_logprobs
from mgrpo_jax.model.moe import load_balancing_loss, routing_metrics
from mgrpo_jax.sampling.observe import observed
from mgrpo_jax.sampling.sampler import sampling_logits

BATCH_AXES = ("data", "fsdp")
POLICY_KEYS = ("tokens", "positions", "attention_mask", "loss_mask", "old_logprobs", "advantages", "weights",
               "temperature")
SFT_KEYS = ("tokens", "positions", "attention_mask", "loss_mask", "weights")
# The logit a token excluded by top-k / top-p gets in the train step (the sampler uses -inf): exp() of it is
# exactly 0 in float32, so the distribution is the sampler's, but log-probs and gradients stay finite.
EXCLUDED_LOGIT = -1e9


# ---------------------------------------------------------------------------------------------------
# Batch placement


def _batch_axes(mesh: Mesh, batch_axes: Sequence[str]) -> tuple[str, ...]:
    return tuple(a for a in batch_axes if a in mesh.shape)


def batch_sharding(mesh: Mesh, batch_axes: Sequence[str] = BATCH_AXES) -> NamedSharding:
    """Rows over ``batch_axes`` (those the mesh has), everything else replicated."""
    axes = _batch_axes(mesh, batch_axes)
    return NamedSharding(mesh, PartitionSpec(axes if axes else None))


def batch_shards(mesh: Mesh, batch_axes: Sequence[str] = BATCH_AXES) -> int:
    """How many ways the rows are split (B must be a multiple of this times the micro-batch count)."""
    return math.prod(mesh.shape[a] for a in _batch_axes(mesh, batch_axes))


def _place(batch: dict, sharding: NamedSharding) -> dict:
    """Put inputs where the jitted step expects them (a no-op for arrays already there).

    Multi-process: global ``jax.Array``s pass through; host arrays are taken as the whole global batch,
    identical on every process (the trainer's rollouts are), and each process places only the rows of its own
    devices.
    """
    multi = jax.process_count() > 1
    out = {}
    for k, v in batch.items():
        if isinstance(v, jax.Array) and (v.sharding == sharding or (multi and not v.is_fully_addressable)):
            out[k] = v
        elif multi:
            host = np.asarray(v)
            out[k] = jax.make_array_from_callback(host.shape, sharding, lambda index, host=host: host[index])
        else:
            out[k] = jax.device_put(v, sharding)
    return out


def _split_micro(x: jax.Array, micro_batches: int) -> jax.Array:
    """[B, ...] -> [M, B / M, ...], micro-batch m = rows m, m + M, m + 2M, ... (keeps row sharding)."""
    B = x.shape[0]
    x = x.reshape((B // micro_batches, micro_batches) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def _merge_micro(x: jax.Array) -> jax.Array:
    """Inverse of ``_split_micro``."""
    M, R = x.shape[:2]
    return jnp.swapaxes(x, 0, 1).reshape((M * R,) + x.shape[2:])


def _check_rows(B: int, micro_batches: int, shards: int):
    if micro_batches < 1 or B % (micro_batches * shards):
        raise ValueError(f"batch of {B} rows is not a multiple of micro_batches ({micro_batches}) x "
                         f"row shards ({shards})")


# ---------------------------------------------------------------------------------------------------
# Forward pieces


def policy_logits(logits: jax.Array, temperature: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """The behaviour distribution's logits ``[..., V]`` float32 (``temperature`` of the leading shape): the
    sampler's :func:`~mgrpo_jax.sampling.sampler.sampling_logits`, with entries the filters exclude at
    ``EXCLUDED_LOGIT`` (finite) instead of ``-inf``. ``log_softmax`` of it is the log-prob the sampler
    records; temperature 1 without filters gives exactly the model's logits."""
    x = sampling_logits(logits, temperature, top_k, top_p)
    if top_k or top_p < 1.0:
        x = jnp.where(jnp.isneginf(x), EXCLUDED_LOGIT, x)
    return x


def _forward(graphdef, params, mb: dict, with_logits: bool = False, *, behaviour: bool = False, top_k: int = 0,
             top_p: float = 1.0, router_aux_loss_coef: float | None = None, frozen=None):
    """Teacher-forced log-probs [B, T] (``token_logprobs`` convention) and optionally the logits that
    predicted them ([B, T - 1, V]: position t predicts token t + 1).

    ``behaviour=False``: the model's own distribution (temperature 1, unfiltered; the SFT step).
    ``behaviour=True``: the sampling distribution the behaviour log-probs were recorded under
    (:func:`policy_logits`), each row at ``mb['temperature']`` (1 when the batch has no such key), with the
    static ``top_k`` / ``top_p``; the returned logits are then those of that distribution.
    ``frozen``: the rest of the model's state when ``params`` is only its trained part (a LoRA agent's base).

    Third value: an MoE model's ``(weighted router loss, routing metrics)`` (``None`` for a dense model).
    """
    model = nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)
    tokens = mb["tokens"]
    mask = mb["attention_mask"].astype(jnp.bool_)
    logits, _, stats = model(tokens, mb["positions"], attention_mask=mask, router_stats=True)
    router = None
    if stats is not None:
        coef = model.cfg.router_aux_loss_coef if router_aux_loss_coef is None else router_aux_loss_coef
        aux = load_balancing_loss(stats, model.cfg.num_experts)
        router = (coef * aux, {"router_aux_loss": aux, **routing_metrics(stats)})
    logits = logits[:, :-1]
    if behaviour:
        temperature = mb.get("temperature")
        if temperature is None:
            temperature = jnp.ones((tokens.shape[0],), jnp.float32)
        temperature = jnp.broadcast_to(temperature.astype(jnp.float32)[:, None], logits.shape[:2])
        logits = policy_logits(logits, temperature, top_k, top_p)
    lp = gather_logprobs(logits, tokens[:, 1:])
    lp = jnp.concatenate([jnp.zeros((tokens.shape[0], 1), jnp.float32), lp], axis=1)
    lp = jnp.where(mask, lp, 0.0)
    return lp, (logits if with_logits else None), router


def _with_router_loss(loss_sum, denom, metrics: dict, router):
    """The micro-batch objective plus the weighted router loss (scaled by the denominator the step divides by)
    and the routing metrics; unchanged for a dense model."""
    if router is None:
        return loss_sum, metrics
    return loss_sum + router[0] * denom, {**metrics, **router[1]}


def _shifted_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of the distribution each token was predicted from ([B, T - 1, V] logits, as ``_forward``
    returns them), aligned like the log-probs."""
    x = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(x, axis=-1)
    ent = logz - (jax.nn.softmax(x, axis=-1) * x).sum(-1)
    return jnp.concatenate([jnp.zeros((x.shape[0], 1), jnp.float32), ent], axis=1)


def _trained_mask(mb: dict) -> jax.Array:
    mask = mb["loss_mask"].astype(jnp.float32) * mb["attention_mask"].astype(jnp.float32)
    return mask.at[:, 0].set(0.0)


def policy_micro_loss(graphdef, loss_fn: Callable, compute_entropy: bool = False, top_k: int = 0,
                      top_p: float = 1.0, router_aux_loss_coef: float | None = None):
    """``(params, micro_batch) -> (loss_sum, (denominator, metrics))`` for a policy loss bound to its
    hyper-parameters (``get_loss(name, hparams)``), with log-probs (and entropy) of the behaviour distribution
    (``mb['temperature']``, ``top_k``, ``top_p``)."""

    def f(params, mb, frozen=None):
        lp, logits, router = _forward(graphdef, params, mb, with_logits=compute_entropy, behaviour=True,
                                      top_k=top_k, top_p=top_p, router_aux_loss_coef=router_aux_loss_coef,
                                      frozen=frozen)
        entropy = _shifted_entropy(logits) if compute_entropy else None
        inputs = PolicyLossInputs(
            logprobs=lp, old_logprobs=mb["old_logprobs"].astype(jnp.float32),
            advantages=mb["advantages"], mask=_trained_mask(mb), weights=mb["weights"],
            ref_logprobs=mb.get("ref_logprobs"), entropy=entropy)
        loss_sum, denom, metrics = loss_fn(inputs)
        loss_sum, metrics = _with_router_loss(loss_sum, denom, metrics, router)
        return loss_sum, (denom, metrics)

    return f


def sft_micro_loss(graphdef, router_aux_loss_coef: float | None = None):
    """Token-mean cross-entropy on trained tokens (``loss_mask``), rows weighted by ``weights`` if given."""

    def f(params, mb, frozen=None):
        lp, logits, router = _forward(graphdef, params, mb, with_logits=True,
                                      router_aux_loss_coef=router_aux_loss_coef, frozen=frozen)
        mask = _trained_mask(mb)
        w = mb.get("weights")
        w = jnp.ones((mask.shape[0],), jnp.float32) if w is None else w.astype(jnp.float32)
        wm = mask * w[:, None]
        loss_sum = -(lp * wm).sum()
        denom = wm.sum()
        trained = mask * (w[:, None] > 0)
        tokens = trained.sum()
        pred = jnp.argmax(logits, axis=-1)
        hit = jnp.concatenate([jnp.zeros((mask.shape[0], 1), jnp.float32),
                               (pred == mb["tokens"][:, 1:]).astype(jnp.float32)], axis=1)
        metrics = {"tokens": tokens, "accuracy": (hit * trained).sum() / jnp.maximum(tokens, 1.0)}
        loss_sum, metrics = _with_router_loss(loss_sum, denom, metrics, router)
        return loss_sum, (denom, metrics)

    return f


# ---------------------------------------------------------------------------------------------------
# The step machinery


def combine_metrics(stacked: dict) -> dict:
    """Combine per-micro-batch metric arrays [M]: ``tokens`` summed, ``*_min``/``*_max`` by min/max, the
    rest token-weighted means (plain means when there is no ``tokens`` entry)."""
    tokens = stacked.get("tokens")
    total = None if tokens is None else tokens.sum()
    out = {}
    for k, v in stacked.items():
        v = jnp.asarray(v, jnp.float32)
        if k == "tokens":
            out[k] = total
        elif k.endswith("_min"):
            out[k] = v.min()
        elif k.endswith("_max"):
            out[k] = v.max()
        elif tokens is None:
            out[k] = v.mean()
        else:
            out[k] = (v * tokens).sum() / jnp.maximum(total, 1.0)
    return out


class TrainStep:
    """A jitted ``step(state, batch) -> (new_state, metrics)`` (see the module docstring).

    Attributes: ``jitted`` (the ``jax.jit`` function, e.g. for ``.lower``), ``batch_sharding``,
    ``micro_batches``, ``trace_count`` (how many times the step was traced: 1 per batch shape/structure),
    ``frozen`` (what the jitted step takes as its third argument, e.g. a LoRA agent's base; None: two arguments).
    """

    def __init__(self, jitted, sharding: NamedSharding, micro_batches: int, counter: list, frozen=None):
        self.jitted = jitted
        self.frozen = frozen  # the part of the model the step reads but never updates (a LoRA agent's base)
        self.batch_sharding = sharding
        self.micro_batches = micro_batches
        self._counter = counter

    @property
    def trace_count(self) -> int:
        return self._counter[0]

    def __call__(self, state: AgentState, batch: dict):
        """The step on ``batch``, reported as a ``train_step`` call to the observers of
        :mod:`mgrpo_jax.sampling.observe` (benchmarks; with one registered, the call waits for its outputs)."""
        return observed("train_step", lambda: self.trace_count, lambda: self._step(state, batch), block=True)

    def _step(self, state: AgentState, batch: dict):
        if self.frozen is not None:
            return self.jitted(state, _place(batch, self.batch_sharding), self.frozen)
        return self.jitted(state, _place(batch, self.batch_sharding))


def build_step(graphdef, optimizer: optax.GradientTransformation, micro_loss: Callable,
               state_sharding: AgentState, mesh: Mesh, micro_batches: int = 1, *,
               batch_axes: Sequence[str] = BATCH_AXES, donate: bool = True, frozen=None) -> TrainStep:
    """The shared machinery: exact accumulation of ``micro_loss(params, mb) -> (loss_sum, (denom,
    metrics))`` over micro-batches, one optimizer update, jitted with shardings and donation.

    ``frozen``: parameters the loss reads but that are neither differentiated, updated nor donated (a LoRA
    agent's base, :func:`mgrpo_jax.agent.state.create_lora_agent_state`); the step then calls
    ``micro_loss(params, mb, frozen)`` and keeps them in their own shardings."""
    del graphdef  # captured by micro_loss; kept in the signature for symmetry
    micro_batches = int(micro_batches)
    bshard = batch_sharding(mesh, batch_axes)
    shards = batch_shards(mesh, batch_axes)
    replicated = NamedSharding(mesh, PartitionSpec())
    counter = [0]
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def step(state: AgentState, batch: dict, frozen=None):
        counter[0] += 1
        _check_rows(batch["tokens"].shape[0], micro_batches, shards)
        params = state.params

        def one(mb):
            mb = jax.lax.with_sharding_constraint(mb, bshard)
            args = (params, mb) if frozen is None else (params, mb, frozen)
            (loss_sum, (denom, metrics)), grads = grad_fn(*args)
            grads = jax.lax.with_sharding_constraint(grads, state_sharding.params)
            return grads, loss_sum, denom, metrics

        if micro_batches == 1:
            grads, loss_sum, denom, metrics = one(batch)
            stacked = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32)[None], metrics)
        else:
            mbs = jax.tree.map(lambda x: _split_micro(x, micro_batches), batch)

            def body(acc, mb):
                g, ls, dn, m = one(mb)
                return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g), (ls, dn, m)

            # Accumulate in float32 whatever the parameter dtype (bf16 sums of many micro-batches drift).
            zeros = jax.lax.with_sharding_constraint(
                jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), state_sharding.params)
            grads, (ls, dn, stacked) = jax.lax.scan(body, zeros, mbs)
            loss_sum, denom = ls.sum(), dn.sum()

        safe = jnp.where(denom > 0, denom, 1.0).astype(jnp.float32)
        grads = jax.tree.map(lambda g, p: (g.astype(jnp.float32) / safe).astype(p.dtype), grads, params)
        grad_norm = optax.tree.norm(grads)
        ok = (denom > 0) & jnp.isfinite(grad_norm)
        updates, new_opt = optimizer.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)

        def keep(new, old):
            return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)

        new_state = AgentState(step=state.step + 1, params=keep(new_params, params),
                               opt_state=keep(new_opt, state.opt_state))
        out = combine_metrics(stacked)
        out.update(
            loss=(loss_sum / safe).astype(jnp.float32),
            loss_denominator=jnp.asarray(denom, jnp.float32),
            grad_norm=grad_norm.astype(jnp.float32),
            param_norm=optax.tree.norm(new_state.params).astype(jnp.float32),
            lr=current_lr(new_state.opt_state),
            skipped=(~ok).astype(jnp.float32),
        )
        return new_state, out

    in_shardings = (state_sharding, bshard)
    if frozen is not None:
        in_shardings += (jax.tree.map(lambda x: x.sharding, frozen),)
    jitted = jax.jit(step, in_shardings=in_shardings, out_shardings=(state_sharding, replicated),
                     donate_argnums=(0,) if donate else ())
    return TrainStep(jitted, bshard, micro_batches, counter, frozen)


def make_policy_step(graphdef, optimizer: optax.GradientTransformation, loss_name: str,
                     loss_hparams: dict | None, state_sharding: AgentState, mesh: Mesh,
                     micro_batches: int = 1, *, batch_axes: Sequence[str] = BATCH_AXES,
                     compute_entropy: bool = False, donate: bool = True, top_k: int = 0,
                     top_p: float = 1.0, router_aux_loss_coef: float | None = None, frozen=None) -> TrainStep:
    """Policy-gradient step with the registered loss ``loss_name`` (``grpo``, ``dr_grpo``, ``gspo``, ...)
    and its keyword hyper-parameters: the registration's defaults under the ones ``loss_hparams`` sets (None:
    unset; ``resolve_loss_hparams``). ``compute_entropy`` adds the policy's token entropy to the metrics
    (costs a softmax over the vocabulary). ``top_k`` / ``top_p``: the filters of the sampler that recorded
    the batches' behaviour log-probs (its ``Sampler.top_k`` / ``Sampler.top_p``; 0 / 1.0 = off); the
    per-row temperature comes with the batch. ``router_aux_loss_coef``: an MoE model's load-balancing weight
    (``None``: its config's). ``frozen``: a LoRA agent's base (see ``build_step``). See the module docstring for
    the batch and the metrics."""
    micro = policy_micro_loss(graphdef, get_loss(loss_name, loss_hparams), compute_entropy, int(top_k), float(top_p),
                              router_aux_loss_coef)
    return build_step(graphdef, optimizer, micro, state_sharding, mesh, micro_batches,
                      batch_axes=batch_axes, donate=donate, frozen=frozen)


def make_sft_step(graphdef, optimizer: optax.GradientTransformation, state_sharding: AgentState,
                  mesh: Mesh, micro_batches: int = 1, *, batch_axes: Sequence[str] = BATCH_AXES,
                  donate: bool = True, router_aux_loss_coef: float | None = None, frozen=None) -> TrainStep:
    """Supervised step: token-mean cross-entropy over ``loss_mask`` tokens (clones expert transcripts).

    Metrics: ``loss`` (mean NLL per trained token), ``accuracy`` (greedy next-token accuracy), ``tokens``,
    plus the common ones.
    """
    return build_step(graphdef, optimizer, sft_micro_loss(graphdef, router_aux_loss_coef), state_sharding, mesh,
                      micro_batches, batch_axes=batch_axes, donate=donate, frozen=frozen)


def make_logprob_fn(graphdef, state_sharding: AgentState, mesh: Mesh, *, micro_batches: int = 1,
                    batch_axes: Sequence[str] = BATCH_AXES, top_k: int = 0, top_p: float = 1.0):
    """Jitted ``fn(params, tokens, positions, attention_mask, temperature=None) -> [B, T] float32``
    teacher-forced log-probs (``token_logprobs`` convention: column 0 and padding are 0), e.g. to recompute
    old / reference log-probs. ``params`` is ``state.params`` (or a frozen reference's; ``state_sharding``
    may then be the parameters' shardings alone, e.g. a LoRA agent's base). Without
    ``temperature`` and filters they are the model's own log-probs; ``temperature`` [B] (0 = greedy) with
    ``top_k`` / ``top_p`` gives those of the sampling distribution, as the policy step computes them.
    ``micro_batches`` bounds memory (rows are processed in that many chunks under ``lax.map``)."""
    bshard = batch_sharding(mesh, batch_axes)
    shards = batch_shards(mesh, batch_axes)
    micro_batches = int(micro_batches)
    top_k, top_p = int(top_k), float(top_p)

    def fn(params, tokens, positions, attention_mask, temperature):
        _check_rows(tokens.shape[0], micro_batches, shards)
        batch = {"tokens": tokens, "positions": positions, "attention_mask": attention_mask,
                 "temperature": temperature}
        forward = functools.partial(_forward, graphdef, params, behaviour=True, top_k=top_k, top_p=top_p)
        if micro_batches == 1:
            return forward(batch)[0]

        def one(mb):
            mb = jax.lax.with_sharding_constraint(mb, bshard)
            return forward(mb)[0]

        mbs = jax.tree.map(lambda x: _split_micro(x, micro_batches), batch)
        return _merge_micro(jax.lax.map(one, mbs))

    param_sharding = state_sharding.params if isinstance(state_sharding, AgentState) else state_sharding
    jitted = jax.jit(fn, in_shardings=(param_sharding, bshard, bshard, bshard, bshard),
                     out_shardings=bshard)

    def call(params, tokens, positions, attention_mask, temperature=None):
        if temperature is None:
            temperature = np.ones((np.shape(tokens)[0],), np.float32)
        b = _place({"t": tokens, "p": positions, "m": attention_mask, "T": temperature}, bshard)
        return jitted(params, b["t"], b["p"], b["m"], b["T"])

    call.jitted = jitted
    return call


# ---------------------------------------------------------------------------------------------------
# Several passes over one batch


def _reorder(batch: dict, perm: jax.Array, minibatches: int) -> list[dict]:
    rows = batch["tokens"].shape[0]
    size = rows // minibatches
    shuffled = jax.tree.map(lambda x: jnp.take(x, perm, axis=0), batch)
    return [jax.tree.map(lambda x, i=i: x[i * size:(i + 1) * size], shuffled) for i in range(minibatches)]


_reorder_jit = jax.jit(_reorder, static_argnums=(2,))


def run_passes(step: TrainStep, state: AgentState, batch: dict, passes: int, key: jax.Array | None = None,
               minibatches: int = 1) -> tuple[AgentState, list[dict[str, Any]]]:
    """``passes`` optimisation passes (PPO epochs) over one batch; returns the state and every update's
    metrics (device arrays: fetch them when convenient).

    ``minibatches = n`` splits each pass into ``n`` updates over consecutive row blocks of size ``B / n``
    (``step`` must be built for that row count); with ``key`` the rows are reshuffled before every pass
    (``jax.random.permutation``), otherwise taken in order. With ``minibatches = 1`` every update sees the
    whole batch and the shuffle changes nothing, so it is skipped.
    """
    rows = int(batch["tokens"].shape[0])
    if rows % minibatches:
        raise ValueError(f"{rows} rows do not split into {minibatches} minibatches")
    metrics = []
    for _ in range(int(passes)):
        if minibatches == 1:
            parts = [batch]
        else:
            if key is None:
                perm = jnp.arange(rows)
            else:
                key, sub = jax.random.split(key)
                perm = jax.random.permutation(sub, rows)
            parts = _reorder_jit(batch, perm, minibatches)
        for part in parts:
            state, m = step(state, part)
            metrics.append(m)
    return state, metrics
