"""Compiled plans for TPU pods, made here without a TPU: per-chip memory of the paper-scale agent's programs.

    python -m mgrpo_jax.bench.plan                      # the small size's five programs on a 4-chip v5e (minutes)
    python -m mgrpo_jax.bench.plan --full               # the paper preset (Qwen3-30B-A3B) on v5p-64, v5p-128,
                                                        # v6e-64, v6e-256 (the default before issue 37; an hour+)
    python -m mgrpo_jax.bench.plan --size=paper --topologies=v5p-64   # the paper preset on one topology
    python -m mgrpo_jax.bench.plan --size=paper_dense   # the dense 8B preset on v5p-128, v5e-64, v6e-64, v6e-256
    python -m mgrpo_jax.bench.plan --size=small         # a tiny model on a 4-chip v5e, for CI (seconds)
    python -m mgrpo_jax.bench.plan --size=small_moe     # the same with 8 experts over a 2-way expert axis
    python -m mgrpo_jax.bench.plan --quick              # --size=small --programs=decode: one compile, seconds
    python -m mgrpo_jax.bench.plan --topologies=v5p-64 --programs=slots,paged   # episodes per chip, paged vs slots
    python -m mgrpo_jax.bench.plan --lora               # the paper_lora preset's agent (the 8B with LoRA) on v5e-64,
                                                        # v6e-64, v5p-64

Needs libtpu (`pip install -r requirements-tpu.txt`); jax itself keeps running on the CPU. For each pod
topology, `jax.experimental.topologies.get_topology_desc` gives the slice's abstract TPU devices, the agent's
mesh is built over them from the config (`mesh`, sharding rules of mgrpo_jax/model/sharding.py), and three
programs are lowered with abstract arrays (`jax.ShapeDtypeStruct`s carrying shardings: no weights exist) and
compiled by the TPU compiler itself:

  train    the agent's jitted policy step (mgrpo_jax/agent/step.py) on its RL batch at the full context
           (every row `context_tokens` long), micro-batched as the config says, state donated;
  prefill  the sampler's prefill: prompts of `context_tokens - max_turn_tokens` tokens into a donated KV cache;
  decode   one decode step of the sampler over that cache (the body of its decode loop);
  slots    the rollout engine's decode program (mgrpo_jax/sampling/slots.py): a chunk of decode steps over
           decode slots, each holding a cache of the whole `context_tokens`; planned with the sampler's batch of
           slots and again with twice as many, the difference gives the bytes per slot, and so how many slots fit
           (`<prefix>_slots_fit_<topology>`, `_slots_fit_per_chip_`: that many over the chips).
  paged    the same chunk on paged KV (mgrpo_jax/sampling/paged.py, blocks of `PAGED_BLOCK` tokens): each step attends
           over the block tables with JAX's Pallas paged-attention kernel (`--paged_attention=pallas`, per shard;
           where the kernel does not compile, the gather path is planned and the error reported as
           `<prefix>_paged_pallas_error_`). Planned with the slots program's rows and a store of their mean blocks
           under `EpisodeLengths` (a stated assumption: the paper gives no lengths), and again with twice both: the
           difference gives one episode's bytes, and so how many episodes fit (`<prefix>_paged_episodes_fit_`,
           `_paged_episodes_per_chip_`, against the slots: `_paged_vs_slots_`). The command plans it by default;
           `plan_topology`'s default programs are the first four.

Per-chip bytes come from `compiled.memory_analysis()`: arguments + outputs - aliased (donated) + temporaries
+ code. A program "fits" when that is at most `--fit_fraction` (default 0.9) of the chip's HBM, leaving the
rest for the runtime, fragmentation and the other programs' buffers; `margin` is the unused fraction of HBM.
Where a program needs more than HBM the TPU compiler refuses it (RESOURCE_EXHAUSTED) and says what it had
counted: the table shows that as a lower bound (">20.92").

The `paper` preset's agents are Qwen3-30B-A3B (mixture of experts: 48 layers, 128 experts, 8 per token), its
experts split over the mesh's `expert` axis (mgrpo_jax/model/moe.py); its JSON keys start `paper_moe_`
(`paper_moe_train_gib_per_chip_v5p64`, `paper_moe_fits_v5p64`: v5p-64 is 32 chips, the paper's 32 GPUs per agent).
`paper_dense` is the dense 8B shape (keys `paper_dense_`). The sub-agent is the larger of the two (Q*K*D = 128
rows per RL step against the main agent's Q*K = 16), so its shapes are planned; the main agent's micro-batches
have the same shape (16 rows). The vocabulary is the checkpoint's own (151,936 for Qwen3-8B and Qwen3-30B-A3B,
what `init_from` a real checkpoint gives). Where a
topology has more row shards than the config's micro-batches give rows, the micro-batch count is lowered to
one row per shard (the `micro` column); where it has more row shards than the batch has rows, factors of fsdp go
to the tensor axis (`mesh_for_rows`). Last line: one JSON object.

`--agent=shared` plans one model serving both roles (the `shared_mgrpo` mode: MATPO's one model, M-GRPO's
credit): the preset's model (built from `main`, as mgrpo_jax/rl/system.py builds it) with one optimizer, its
train program on the pooled batch of the main agent's Q*K rows and the sub-agent's Q*K*D rows (16 + 128 = 144 at
the `paper` preset; `rl_batch_rows` of the shared mode), its slots program holding both roles' decode slots (16 +
128) on that one model, its prefill and decode programs at the larger role's batch (the lock-step sampler calls
each role apart). 144 rows do not split over 32 row shards: `mesh_for_rows` hands fsdp's factors to `tensor` until
the row shards divide the rows (16 on 32 chips: fsdp 2 x tensor 2 x expert 8) and `micro_for` takes one row per
row shard per micro-batch (9 micro-batches on v5p-64; the `micro` column, `<prefix>_shared_train_micro_batches_`).
Its keys start `<prefix>_shared_` (`paper_moe_shared_train_gib_per_chip_v5p64`, `paper_moe_shared_fits_v5p64`).
Beside it the same run plans the two-model setup on the same topologies (`--no-two_models` skips it): the main
agent and the sub-agent, each on its own slice (keys `<prefix>_main_`, `<prefix>_sub_`), and compares the chips and
per-chip GiB: `<prefix>_two_models_chips_v5p64` (64: two v5p-64 slices) against `<prefix>_shared_chips_v5p64` (32),
`<prefix>_two_models_fits_`, `<prefix>_two_models_max_gib_per_chip_`. At the small sizes the pair is the small
model as the sub-agent and a main agent with a quarter of its rows.

`--lora` plans the `paper_lora` preset's agent instead (LoRA rank 64 on every projection, the frozen base in
bfloat16): its train step holds the base, the adapters and their optimizer state (`lora_train_state`); its sampler
programs run the merged weights, a plain model in the base's dtype (`Learner.publish` merges once per update).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding

from mgrpo_jax.agent.optim import make_optimizer
from mgrpo_jax.agent.state import abstract_agent_state, abstract_lora_agent_state
from mgrpo_jax.agent.step import POLICY_KEYS, batch_sharding, batch_shards, make_logprob_fn, make_policy_step
from mgrpo_jax.bench.common import emit
from mgrpo_jax.config import get_config, rl_batch_rows
from mgrpo_jax.model import DEFAULT_RULES, MeshRules, abstract_model, get_model_config, get_rules
from mgrpo_jax.model.lora import lora_spec
from mgrpo_jax.model.sharding import resolve_mesh_shape
from mgrpo_jax.model.transformer import cache_shape, cache_shardings
from mgrpo_jax.sampling.paged import STORE_AXES, blocks_for, paged_decode, pallas_decode, store_shape
from mgrpo_jax.sampling.slots import SLOT_CHUNK, STOP_WIDTH, slot_decode

GIB = 1024**3
HBM_GIB = {"v5p": 95.0, "v5e": 16.0, "v6e": 32.0, "v4": 32.0}
# name -> topology as get_topology_desc spells it (v5p counts TensorCores in its name: v5p-128 = 64 chips).
PAPER_TOPOLOGIES = {"v5p-64": "v5p:4x4x2", "v5p-128": "v5p:4x4x4", "v6e-64": "v6e:8x8", "v6e-256": "v6e:16x16"}
PAPER_DENSE_TOPOLOGIES = {"v5p-128": "v5p:4x4x4", "v5e-64": "v5e:8x8", "v6e-64": "v6e:8x8", "v6e-256": "v6e:16x16"}
SMALL_TOPOLOGIES = {"v5e-4": "v5e:2x2"}
# --size -> (topologies, prefix of its JSON keys)
SIZES = {"paper": (PAPER_TOPOLOGIES, "paper_moe"), "paper_dense": (PAPER_DENSE_TOPOLOGIES, "paper_dense"),
         "small": (SMALL_TOPOLOGIES, "small"), "small_moe": (SMALL_TOPOLOGIES, "small_moe")}
LORA_TOPOLOGIES = {"v5e-64": "v5e:8x8", "v6e-64": "v6e:8x8", "v5p-64": "v5p:4x4x2"}
PROGRAMS = ("train", "prefill", "decode", "slots")
ALL_PROGRAMS = PROGRAMS + ("paged",)  # the command's default; `plan_topology`'s is PROGRAMS
PAGED_BLOCK = 32  # tokens per KV block of the paged program


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one agent runs: the model, its mesh (axis -> size, one may be -1) and the batch shapes."""

    model: object
    mesh: dict
    optim: object
    loss: str
    loss_hparams: dict
    train_rows: int
    micro_batches: int
    seq_len: int
    sample_rows: int
    max_new: int
    rules: tuple = DEFAULT_RULES  # the sharding rule set (`agent.sharding_rules`)
    lora: object = None  # a LoraSpec (mgrpo_jax/model/lora.py): the train step trains adapters over a frozen base
    slots: int = 0  # decode slots of the slots program (0: `sample_rows`); a shared model's holds both roles'


SHARED_MODE = "shared_mgrpo"  # the shared-policy mode of `--agent=shared` (config.SHARED_MODES; M-GRPO's credit)


def paper_plan(agent: str = "sub", preset: str = "paper") -> Plan:
    """The `paper` (or `paper_dense`, `paper_lora`) preset's agent (default: the sub-agent, the larger batch) with
    the checkpoint's vocabulary; "shared": `shared_plan`."""
    if agent == "shared":
        return shared_plan(preset)
    return _config_plan(get_config("xbench", preset), agent)


def shared_of(main: Plan, sub: Plan) -> Plan:
    """One model serving both roles: `main`'s model, mesh and optimizer (the shared model is built from `main`), its
    train step on the pooled batch (main rows + sub rows), its slots program holding both roles' slots, its prefill
    and decode at the larger role's sampler batch (each role's sampler call on its own)."""
    return dataclasses.replace(main, train_rows=main.train_rows + sub.train_rows,
                               sample_rows=max(main.sample_rows, sub.sample_rows),
                               slots=(main.slots or main.sample_rows) + (sub.slots or sub.sample_rows))


def shared_plan(preset: str = "paper") -> Plan:
    """The preset's model serving both roles (mode `shared_mgrpo`): `shared_of` its two agents, with the shared
    config's micro-batches; its rows are the shared mode's `rl_batch_rows` (checked)."""
    c = get_config("xbench", f"{preset},{SHARED_MODE}")
    plan = shared_of(paper_plan("main", preset), paper_plan("sub", preset))
    if plan.train_rows != rl_batch_rows(c, "main"):
        raise ValueError(f"pooled rows {plan.train_rows} != the shared mode's batch {rl_batch_rows(c, 'main')}")
    return dataclasses.replace(plan, micro_batches=c.main.micro_batches)


def small_main(plan: Plan) -> Plan:
    """The main agent of a small pair whose sub-agent is `plan`: a quarter of its rows."""
    return dataclasses.replace(plan, train_rows=plan.train_rows // 4, sample_rows=plan.sample_rows // 4)


def _config_plan(c, agent: str) -> Plan:
    a = c[agent]
    model = get_model_config(a.model, **a.model_overrides.to_dict())
    rows = rl_batch_rows(c, agent)
    return Plan(model, a.mesh.to_dict(), a.optim, a.loss, dict(a.loss_hparams), rows, a.micro_batches,
                a.context_tokens, rows, c.rollout.max_turn_tokens, tuple(get_rules(a.sharding_rules)),
                lora_spec(a.get("lora")))


def small_plan() -> Plan:
    """A tiny Qwen3-style model and short context: the same programs, compiled in seconds."""
    c = get_config("xbench", "paper")
    a = c.sub
    model = get_model_config("qwen3-8b", vocab_size=2048, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=64, mlp_dim=512, remat=True, dtype="bfloat16", attn_chunk=128)
    return Plan(model, {"data": 1, "fsdp": -1, "tensor": 2}, a.optim, a.loss, dict(a.loss_hparams), 8, 2, 512,
                8, 64)


def small_moe_plan() -> Plan:
    """``small_plan`` with every MLP a mixture of 8 experts (2 per token) split over a 2-way ``expert`` axis."""
    plan = small_plan()
    model = get_model_config("qwen3-30b-a3b", vocab_size=2048, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                             attn_chunk=128)
    return dataclasses.replace(plan, model=model, mesh={"data": 1, "fsdp": -1, "tensor": 1, "expert": 2})


def topology_devices(topology: str) -> list:
    # Compiling needs no TPU, so no exclusive hold on one: several processes may plan at once (test workers).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def mesh_for_rows(shape: dict, n_devices: int, rows: int) -> dict:
    """The config's mesh (axis -> size, one may be -1) resolved for ``n_devices``. Where its row shards (data x
    fsdp x expert) outnumber the RL batch's ``rows`` (the 30B-A3B's 8-way expert axis on a 256-chip v6e: 256
    shards, 128 rows) or do not divide them (a shared model's 144 rows on 32 shards), fsdp hands factors of 2 to
    ``tensor`` until they do: the mesh a user would set for that slice."""
    sizes = resolve_mesh_shape(shape, n_devices)
    while rows % math.prod(sizes.get(a, 1) for a in ("data", "fsdp", "expert")) and sizes.get("fsdp", 1) % 2 == 0:
        sizes["fsdp"] //= 2
        sizes["tensor"] = sizes.get("tensor", 1) * 2
    return sizes


def build_mesh(shape: dict, devices: list) -> Mesh:
    """The config's mesh over abstract devices, topology-aware when the axis sizes map onto the torus."""
    resolved = resolve_mesh_shape(shape, len(devices))
    names, sizes = tuple(resolved), list(resolved.values())
    from jax.experimental import mesh_utils

    try:
        grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
    except (NotImplementedError, ValueError, AssertionError):
        grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _abstract(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def lora_train_state(plan: Plan, mesh: Mesh, optimizer):
    """(graphdef, abstract adapter state, its sharding, abstract frozen base) of a LoRA plan's train step."""
    graphdef, abs_state, sharding, base_sharding = abstract_lora_agent_state(plan.model, plan.lora, optimizer, mesh,
                                                                             plan.rules)
    _, abs_base = abstract_model(plan.model, mesh, plan.rules)
    return graphdef, abs_state, sharding, jax.tree.map(lambda a, s: _abstract(a.shape, a.dtype, s), abs_base,
                                                       base_sharding)


def lower_train(plan: Plan, mesh: Mesh, micro_batches: int):
    optimizer = make_optimizer(plan.optim)
    if plan.lora is None:
        graphdef, abs_state, sharding = abstract_agent_state(plan.model, optimizer, mesh, plan.rules)
        frozen = None
    else:
        graphdef, abs_state, sharding, frozen = lora_train_state(plan, mesh, optimizer)
    step = make_policy_step(graphdef, optimizer, plan.loss, plan.loss_hparams, sharding, mesh, micro_batches,
                            frozen=frozen)
    bshard = batch_sharding(mesh)
    B, T = plan.train_rows, plan.seq_len
    dtypes = {"tokens": jnp.int32, "positions": jnp.int32, "attention_mask": jnp.bool_, "loss_mask": jnp.float32,
              "old_logprobs": jnp.float32, "advantages": jnp.float32, "weights": jnp.float32,
              "temperature": jnp.float32}
    per_row = ("advantages", "weights", "temperature")
    batch = {k: _abstract((B,) if k in per_row else (B, T), dtypes[k], bshard) for k in POLICY_KEYS}
    extra = () if frozen is None else (frozen,)  # a LoRA agent's base
    if not float(plan.loss_hparams.get("kl_coef") or 0.0) > 0 or frozen is not None:
        # (A LoRA agent's KL reference is its base with the adapters off: already an argument; the reference's
        # forward is not planned then.)
        return step.jitted.lower(abs_state, batch, *extra)
    # With a KL term the agent also holds its frozen reference (the policy's shapes and shardings, agent/learner.py)
    # and runs it on every batch for `ref_logprobs`: planned as one program, so both count.
    logprob = make_logprob_fn(graphdef, sharding, mesh, micro_batches=micro_batches)

    def with_reference(state, reference, batch):
        ref = logprob.jitted(reference, batch["tokens"], batch["positions"], batch["attention_mask"],
                             batch["temperature"])
        return step.jitted(state, {**batch, "ref_logprobs": ref})

    return jax.jit(with_reference, donate_argnums=(0,)).lower(abs_state, abs_state.params, batch)


def _sampler_inputs(plan: Plan, mesh: Mesh, rows: int | None = None):
    optimizer = make_optimizer(plan.optim)
    graphdef, abs_state, _ = abstract_agent_state(plan.model, optimizer, mesh, plan.rules)
    mr = MeshRules(mesh, tuple(plan.rules))
    B, S = rows or plan.sample_rows, plan.seq_len
    shapes = cache_shape(plan.model, B, S)
    shards = cache_shardings(plan.model, B, S, mr)
    cache = jax.tree.map(lambda s, sh: _abstract(s.shape, s.dtype, sh), shapes, shards)
    return graphdef, abs_state.params, cache, mr


def lower_prefill(plan: Plan, mesh: Mesh):
    graphdef, params, cache, mr = _sampler_inputs(plan, mesh)
    B, P = plan.sample_rows, plan.seq_len - plan.max_new
    rows = mr.sharding(("act_batch", "act_seq"), (B, P))

    def prefill(params, cache, prompts, lengths):
        # As Sampler's prefill: every prompt slot at once, then each row's logits at its last prompt token.
        model = nnx.merge(graphdef, params)
        pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (B, P))
        logits, cache = model(prompts, pos, attention_mask=pos < lengths[:, None], cache=cache,
                              cache_index=jnp.int32(0), logits_at=lengths - 1)
        return logits[:, 0], cache

    lengths = _abstract((B,), jnp.int32, mr.sharding(("act_batch",), (B,)))
    return jax.jit(prefill, donate_argnums=(1,)).lower(params, cache, _abstract((B, P), jnp.int32, rows), lengths)


def lower_decode(plan: Plan, mesh: Mesh):
    graphdef, params, cache, mr = _sampler_inputs(plan, mesh)
    B = plan.sample_rows
    one = mr.sharding(("act_batch",), (B,))

    def decode(params, cache, prev, positions, slot):
        # One iteration of Sampler's decode loop: the previous token of every row into the cache at `slot`.
        model = nnx.merge(graphdef, params)
        logits, cache = model(prev[:, None], positions[:, None], attention_mask=jnp.ones((B, 1), jnp.bool_),
                              cache=cache, cache_index=slot)
        return logits[:, 0], cache

    scalar = NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(decode, donate_argnums=(1,)).lower(
        params, cache, _abstract((B,), jnp.int32, one), _abstract((B,), jnp.int32, one),
        _abstract((), jnp.int32, scalar))


def lower_slots(plan: Plan, mesh: Mesh, n_slots: int):
    """The rollout engine's decode program (mgrpo_jax/sampling/slots.py): one chunk of `SLOT_CHUNK` steps over
    `n_slots` slots, each with a cache of the whole context budget, the cache donated."""
    graphdef, params, cache, mr = _sampler_inputs(plan, mesh, n_slots)

    def decode(params, cache, prev, positions, live, budgets, seeds, offsets, temperature, stops):
        return slot_decode(nnx.merge(graphdef, params), cache, prev, positions, live, budgets, seeds, offsets,
                           temperature, stops, steps=SLOT_CHUNK)

    return jax.jit(decode, donate_argnums=(1,)).lower(params, cache, *_row_inputs(mr, n_slots))


@dataclasses.dataclass(frozen=True)
class EpisodeLengths:
    """Episode lengths (tokens at an episode's end) that the paged plan counts. An episode is a prompt, then
    `tool_turns` tool turns (uniform) and an answer turn; each turn samples a log-uniform number of tokens in
    `turn_tokens` (up to the plan's tokens per turn), each tool response adds a log-uniform number in
    `response_tokens`, each turn and response `overhead` tokens of headers and tags; capped at the context.

    The paper gives no lengths (no tables; the paper notes), so the default is a stated assumption: the
    shape of `bench.rollout --workload=long`'s paper-shaped episodes (9-14 tool turns, responses of 100-1,000 tokens,
    turns log-uniform from 16 tokens) with the `paper` preset's limits (the released code's: 1,024 new tokens per
    turn, a 32,768-token context) and a 1,024-token prompt (system prompt with the tools' descriptions, and the
    task). Mean 8,637 tokens (median 8,554, 90th percentile 10,835, none at the context). `scaled` keeps the shape
    for a shorter context (the small plans)."""

    prompt: int = 1024
    tool_turns: tuple[int, int] = (9, 14)
    turn_tokens: tuple[int, int] = (16, 1024)
    response_tokens: tuple[int, int] = (100, 1000)
    overhead: int = 4
    context: int = 32_768

    def sample(self, n: int, seed: int = 0) -> np.ndarray:
        """`n` episode lengths (int64), drawn with `seed`."""
        rng = np.random.default_rng(seed)

        def log_uniform(bounds, size):
            return np.exp(rng.uniform(np.log(bounds[0]), np.log(bounds[1] + 1), size)).astype(np.int64)

        turns = rng.integers(self.tool_turns[0], self.tool_turns[1], size=n, endpoint=True)
        length = np.full(n, self.prompt, np.int64)
        for t in range(self.tool_turns[1] + 1):  # tool turns, then the answer turn
            length += np.where(t <= turns, log_uniform(self.turn_tokens, n) + self.overhead, 0)
            length += np.where(t < turns, log_uniform(self.response_tokens, n) + self.overhead, 0)
        return np.minimum(length, self.context)

    def scaled(self, context: int, max_turn: int) -> EpisodeLengths:
        """The same shape for a context of `context` tokens and turns of at most `max_turn`."""
        f = context / self.context
        size = lambda x: max(1, int(x * f))  # noqa: E731
        return dataclasses.replace(self, prompt=size(self.prompt), context=context,
                                   turn_tokens=(min(size(self.turn_tokens[0]), max_turn), max_turn),
                                   response_tokens=tuple(size(x) for x in self.response_tokens))


PAPER_LENGTHS = EpisodeLengths()


def episode_blocks(plan: Plan, block_size: int, lengths: EpisodeLengths = PAPER_LENGTHS, n: int = 100_000) -> dict:
    """KV blocks an episode holds under the paged engine, by `lengths` (scaled to the plan's context): at most its
    final length plus one turn's budget (a turn reserves its budget while it runs), in whole blocks. Counted without
    shared prompt blocks (a query's K rollouts would hold their prompt once)."""
    drawn = lengths.scaled(plan.seq_len, plan.max_new).sample(n)
    held = -(-np.minimum(drawn + plan.max_new, plan.seq_len) // block_size)
    return {"mean_tokens": float(drawn.mean()), "p50_tokens": float(np.median(drawn)),
            "p90_tokens": float(np.quantile(drawn, 0.9)), "at_context": float(np.mean(drawn >= plan.seq_len)),
            "blocks": float(held.mean())}


def lower_paged(plan: Plan, mesh: Mesh, rows: int, blocks: int, block_size: int = PAGED_BLOCK,
                attention: str = "pallas"):
    """The paged engine's decode program (mgrpo_jax/sampling/paged.py): one chunk of `SLOT_CHUNK` steps over `rows`
    episodes whose KV lies in a store of `blocks` blocks of `block_size` tokens, donated; block tables of the whole
    context. "pallas": each step attends over the tables with the Pallas paged-attention kernel (per shard); "gather":
    the chunk gathers the tables' blocks into a contiguous window of the whole context."""
    graphdef, params, _, mr = _sampler_inputs(plan, mesh, rows)
    shapes = store_shape(plan.model, blocks, block_size)
    sharding = mr.sharding(STORE_AXES, shapes["k"][0].shape)
    store = jax.tree.map(lambda s: _abstract(s.shape, s.dtype, sharding), shapes)
    width = blocks_for(plan.seq_len, block_size)
    table = _abstract((rows, width), jnp.int32, mr.sharding(("act_batch", None), (rows, width)))

    def decode(params, store, table, prev, positions, live, budgets, seeds, offsets, temperature, stops):
        model = nnx.merge(graphdef, params)
        args = (prev, positions, live, budgets, seeds, offsets, temperature, stops)
        if attention == "pallas":
            return pallas_decode(model, store, table, *args, steps=SLOT_CHUNK)
        return paged_decode(model, store, table, positions, *args, steps=SLOT_CHUNK)

    return jax.jit(decode, donate_argnums=(1,)).lower(params, store, table, *_row_inputs(mr, rows))


def _row_inputs(mr: MeshRules, rows: int) -> list:
    """The decode programs' per-row arguments (abstract): prev, positions, live, budgets, seeds, offsets,
    temperature, stop tokens."""
    one = mr.sharding(("act_batch",), (rows,))
    row = [_abstract((rows,), dtype, one) for dtype in (jnp.int32, jnp.int32, jnp.bool_, jnp.int32, jnp.int32,
                                                         jnp.int32, jnp.float32)]
    return row + [_abstract((rows, STOP_WIDTH), jnp.int32, mr.sharding(("act_batch", None), (rows, STOP_WIDTH)))]


def paged_fit(plan: Plan, mesh: Mesh, first: dict, rows: int, shards: int, hbm: float, fit_fraction: float, *,
              blocks: int, attention: str, footprint: dict, failed: str = "", block_size: int = PAGED_BLOCK) -> dict:
    """How many episodes fit under the paged engine: the paged program compiled again with twice the rows and
    blocks gives the bytes of one episode (a decode row and its mean blocks; the store grows linearly, the weights
    stay); the most episodes, in whole shards, within `fit_fraction` of HBM."""
    second = per_chip_bytes(lower_paged(plan, mesh, 2 * rows, 2 * blocks, block_size, attention).compile())
    per_episode = (second["total"] - first["total"]) / GIB / rows
    fixed = first["total"] / GIB - per_episode * rows
    most = int((fit_fraction * hbm - fixed) / per_episode) // shards * shards if per_episode > 0 else 0
    return {"paged_rows": rows, "paged_blocks": blocks, "paged_block_size": block_size,
            "paged_attention": attention, "paged_episode_gib_per_chip": per_episode, "paged_fixed_gib": fixed,
            "paged_episodes_fit": most, "paged_episodes_per_chip": most / len(mesh.devices.flat),
            "paged_mean_episode_tokens": footprint["mean_tokens"], "paged_blocks_per_episode": footprint["blocks"]}


def slot_rows(plan: Plan, mesh: Mesh) -> tuple[int, int]:
    """(slots, shards): the slot program is planned with the plan's slots (the sampler's batch: Q*K*D rows for the
    sub-agent; both roles' for a shared model), rounded up to the cache rows' shards."""
    spec = MeshRules(mesh, tuple(plan.rules)).spec(("act_batch",))
    entry = spec[0] if len(spec) else None
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    shards = math.prod(mesh.shape[a] for a in axes)
    return -(-(plan.slots or plan.sample_rows) // shards) * shards, shards


def slots_fit(plan: Plan, mesh: Mesh, first: dict, n_slots: int, shards: int, hbm: float,
              fit_fraction: float) -> dict:
    """How many slots fit: the slot program compiled again at twice the slots gives the per-slot bytes (the caches
    grow linearly, the weights stay); the most slots, in whole shards, within `fit_fraction` of HBM."""
    second = per_chip_bytes(lower_slots(plan, mesh, 2 * n_slots).compile())["total"] / GIB
    per_slot = (second - first["total"] / GIB) / n_slots
    fixed = first["total"] / GIB - per_slot * n_slots
    most = int((fit_fraction * hbm - fixed) / per_slot) // shards * shards if per_slot > 0 else 0
    return {"slots": n_slots, "slot_gib_per_chip": per_slot, "slot_fixed_gib": fixed, "slots_fit": most,
            "slots_fit_per_chip": most / len(mesh.devices.flat)}


def per_chip_bytes(compiled) -> dict:
    m = compiled.memory_analysis()
    args, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
    alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
    code = int(getattr(m, "generated_code_size_in_bytes", 0) or 0)
    return {"arguments": args, "outputs": out, "aliased": alias, "temporaries": temp, "code": code,
            "total": args + out - alias + temp + code}


def micro_for(plan: Plan, mesh: Mesh) -> int:
    """The config's micro-batch count, lowered where the mesh has more row shards than its micro-batches have
    rows (one row per shard then). Row shards: data x fsdp x expert (the model splits the rows over the expert
    axis too, mgrpo_jax/model/moe.py)."""
    shards = batch_shards(mesh, ("data", "fsdp", "expert"))
    micro = plan.micro_batches
    if plan.train_rows % (micro * shards):
        micro = max(1, plan.train_rows // shards)
    if plan.train_rows % (micro * shards):
        raise ValueError(f"{plan.train_rows} rows do not split over {shards} row shards")
    return micro


def plan_topology(plan: Plan, name: str, topology: str, programs=PROGRAMS, fit_fraction: float = 0.9,
                  paged_attention: str = "pallas") -> list:
    devices = topology_devices(topology)
    mesh = build_mesh(mesh_for_rows(plan.mesh, len(devices), plan.train_rows), devices)
    hbm = HBM_GIB[topology.split(":")[0]]
    micro = micro_for(plan, mesh)
    rows = []
    for program in programs:
        start = time.perf_counter()
        paged = {}  # the paged program: its store, attention and any failure of the Pallas kernel
        try:
            compiled, paged = _compile(program, plan, mesh, micro, paged_attention)
            mem, refused = per_chip_bytes(compiled), False
            gib = mem["total"] / GIB
        except jax.errors.JaxRuntimeError as e:
            # The TPU compiler refuses a program whose buffers exceed HBM; its message gives what it needed.
            gib = refused_gib(str(e))
            if gib is None:
                raise
            mem, refused = {}, True
        extra = {"paged_pallas_error": paged["failed"]} if paged.get("failed") else {}
        if program == "slots" and not refused:
            extra = slots_fit(plan, mesh, mem, *slot_rows(plan, mesh), hbm, fit_fraction)
        if program == "paged" and not refused:
            extra.update(paged_fit(plan, mesh, mem, *slot_rows(plan, mesh), hbm, fit_fraction, **paged))
        seconds = time.perf_counter() - start
        rows.append({"topology": name, "chips": len(devices), "mesh": dict(mesh.shape), "program": program,
                     "micro": micro if program == "train" else None, "gib": gib, "hbm_gib": hbm,
                     "fits": not refused and gib <= fit_fraction * hbm, "margin": 1.0 - gib / hbm,
                     "compile_s": seconds, "bytes": mem, "refused": refused, **extra})
    return rows


def _compile(program: str, plan: Plan, mesh: Mesh, micro: int, paged_attention: str):
    """The program compiled for the mesh; for "paged" also {blocks, attention, footprint, failed} (`paged_fit`)."""
    if program == "train":
        return lower_train(plan, mesh, micro).compile(), {}
    if program == "prefill":
        return lower_prefill(plan, mesh).compile(), {}
    if program == "decode":
        return lower_decode(plan, mesh).compile(), {}
    n_slots, shards = slot_rows(plan, mesh)
    if program == "slots":
        return lower_slots(plan, mesh, n_slots).compile(), {}
    # A store of the plan's slots' mean blocks, at least one whole context per shard.
    footprint = episode_blocks(plan, PAGED_BLOCK)
    blocks = shards * max(math.ceil(n_slots * footprint["blocks"] / shards), blocks_for(plan.seq_len, PAGED_BLOCK))
    compiled, attention, failed = _compile_paged(plan, mesh, n_slots, blocks, paged_attention)
    return compiled, {"blocks": blocks, "attention": attention, "footprint": footprint, "failed": failed}


def _compile_paged(plan: Plan, mesh: Mesh, rows: int, blocks: int, attention: str):
    """`lower_paged` with `attention`, compiled; where the Pallas kernel does not lower or compile (other than for
    want of HBM), the gather path, and what failed: (compiled, the attention planned, the error or "")."""
    try:
        return lower_paged(plan, mesh, rows, blocks, PAGED_BLOCK, attention).compile(), attention, ""
    except Exception as e:  # any failure of the kernel is reported, and the plan goes on with the gather path
        if attention != "pallas" or refused_gib(str(e)) is not None:
            raise
        failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(f"the Pallas paged-attention program did not compile ({failed}); planning the gather path", flush=True)
        return lower_paged(plan, mesh, rows, blocks, PAGED_BLOCK, "gather").compile(), "gather", failed


def refused_gib(message: str) -> float | None:
    """GiB named by the compiler's out-of-memory refusal ("... required for HLO temporaries (20.92G) exceeds
    available HBM (15.75G)"): a lower bound of the program's need (what it had counted when it gave up)."""
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    found = re.search(r"\(([0-9.]+)([KMGT])\) exceeds", message)
    if not found:
        return float("nan")
    return float(found.group(1)) * {"K": 2**-20, "M": 2**-10, "G": 1.0, "T": 2**10}[found.group(2)]


def _key(name: str) -> str:
    return name.replace("-", "")


def run_plan(plan: Plan, label: str, prefix: str, names: list, table: dict, programs: tuple,
             fit_fraction: float, paged_attention: str = "pallas") -> tuple[list, dict]:
    """Plans `plan` on each of `names` (topologies of `table`), printing its description and a row per program;
    returns the rows and their figures (keys `<prefix>_<program>_gib_per_chip_<topology>`, ...)."""
    m = plan.model
    experts = f" ({m.num_experts} experts, {m.num_params(active=True) / 1e9:.2f}B active)" if m.num_experts else ""
    slots = f"; slots {plan.slots}" if plan.slots else ""
    print(f"{label}: {m.n_layers} layers, d_model {m.d_model}, {m.num_params() / 1e9:.2f}B parameters{experts} "
          f"(params {m.param_dtype}, compute {m.dtype}, remat {m.remat}, attn_chunk {m.attn_chunk}"
          f"{'' if plan.lora is None else f', LoRA rank {plan.lora.rank} on ' + ','.join(plan.lora.targets)}); train "
          f"{plan.train_rows} rows x {plan.seq_len} tokens; sample {plan.sample_rows} rows, prompt "
          f"{plan.seq_len - plan.max_new} + {plan.max_new} new{slots}; mesh {plan.mesh}; fits = at most "
          f"{fit_fraction:.0%} of HBM", flush=True)
    header = f"{'topology':<9} {'chips':>5} {'mesh (' + ','.join(plan.mesh) + ')':<24} {'program':<8} {'micro':>5} " \
             f"{'GiB/chip':>9} {'HBM':>5} {'fits':>5} {'margin':>7} {'compile s':>9}"
    print(header)
    rows = []
    for name in names:
        for row in plan_topology(plan, name, table[name], programs, fit_fraction, paged_attention):
            rows.append(row)
            mesh = ",".join(str(v) for v in row["mesh"].values())
            gib = (">" if row["refused"] else "") + f"{row['gib']:.2f}"  # ">": the compiler refused (out of HBM)
            print(f"{row['topology']:<9} {row['chips']:>5} {mesh:<24} {row['program']:<8} "
                  f"{row['micro'] if row['micro'] else '':>5} {gib:>9} {row['hbm_gib']:>5.0f} "
                  f"{'yes' if row['fits'] else 'NO':>5} {row['margin']:>7.1%} {row['compile_s']:>9.1f}", flush=True)
            if "slots_fit" in row:
                print(f"{'':<9} slots: {row['slots']} slots plan {row['gib']:.2f} GiB/chip, "
                      f"{row['slot_gib_per_chip'] * 1024:.1f} MiB/chip per slot of {plan.seq_len} tokens -> "
                      f"{row['slots_fit']} slots fit ({row['slots_fit_per_chip']:.1f} per chip)", flush=True)
            if "paged_episodes_fit" in row:
                print(f"{'':<9} paged ({row['paged_attention']}): {row['paged_rows']} episodes in "
                      f"{row['paged_blocks']} blocks of {row['paged_block_size']} tokens plan {row['gib']:.2f} "
                      f"GiB/chip, {row['paged_episode_gib_per_chip'] * 1024:.1f} MiB/chip per episode (mean "
                      f"{row['paged_mean_episode_tokens']:,.0f} tokens, {row['paged_blocks_per_episode']:.1f} blocks "
                      f"held) -> {row['paged_episodes_fit']} episodes fit ({row['paged_episodes_per_chip']:.1f} "
                      f"per chip)", flush=True)

    figures = {}
    for row in rows:
        key = f"{prefix}_{row['program']}_{{}}_{_key(row['topology'])}"
        figures[key.format("gib_per_chip")] = round(row["gib"], 3)
        figures[key.format("fits")] = bool(row["fits"])
        figures[key.format("compile_s")] = round(row["compile_s"], 1)
        figures[key.format("refused")] = row["refused"]
        if row["program"] == "train":
            figures[f"{prefix}_train_micro_batches_{_key(row['topology'])}"] = row["micro"]
        for field in ("slots", "slots_fit", "slots_fit_per_chip", "slot_gib_per_chip", "paged_episodes_fit",
                      "paged_episodes_per_chip", "paged_episode_gib_per_chip", "paged_blocks_per_episode",
                      "paged_mean_episode_tokens", "paged_block_size", "paged_attention", "paged_pallas_error"):
            if field in row:
                value = row[field]
                figures[f"{prefix}_{field}_{_key(row['topology'])}"] = round(value, 4) if isinstance(value, float) \
                    else value
    for topo in names:
        mine = [r for r in rows if r["topology"] == topo]
        figures[f"{prefix}_fits_{_key(topo)}"] = bool(mine) and all(r["fits"] for r in mine)
        slots = next((r["slots_fit"] for r in mine if "slots_fit" in r), 0)
        paged = next((r["paged_episodes_fit"] for r in mine if "paged_episodes_fit" in r), 0)
        if slots and paged:  # concurrent episodes, paged against whole-context slots
            figures[f"{prefix}_paged_vs_slots_{_key(topo)}"] = round(paged / slots, 3)
        figures[f"{prefix}_max_gib_per_chip_{_key(topo)}"] = round(max(r["gib"] for r in mine), 3)
    return rows, figures


def compare_shared(prefix: str, names: list, shared: list, main_rows: list, sub_rows: list) -> dict:
    """One shared model on a slice against two models (main + sub) each on a slice of the same topology: prints
    GiB/chip per program side by side and returns `<prefix>_shared_chips_`, `<prefix>_two_models_chips_`,
    `<prefix>_two_models_fits_` and `<prefix>_two_models_max_gib_per_chip_` per topology."""
    def cell(row):
        if row is None:
            return f"{'':>23}"
        micro = f" micro {row['micro']}" if row["micro"] else ""
        return f"{('>' if row['refused'] else '') + format(row['gib'], '.2f'):>8} {'yes' if row['fits'] else 'NO':>3}" \
               f"{micro:<11}"

    print("one shared model vs two models (GiB/chip, fits; each model on its own slice of the topology)")
    print(f"{'topology':<9} {'program':<8} {'shared':>8}{'':<15} {'main':>8}{'':<15} {'sub':>8}")
    figures = {}
    for topo in names:
        of = {who: [r for r in rows if r["topology"] == topo]
              for who, rows in (("shared", shared), ("main", main_rows), ("sub", sub_rows))}
        for program in dict.fromkeys(r["program"] for r in of["shared"]):
            found = {who: next((r for r in rows if r["program"] == program), None) for who, rows in of.items()}
            print(f"{topo:<9} {program:<8} {cell(found['shared'])} {cell(found['main'])} {cell(found['sub'])}")
        chips = {who: rows[0]["chips"] if rows else 0 for who, rows in of.items()}
        pair = of["main"] + of["sub"]
        two_fits = bool(of["main"]) and bool(of["sub"]) and all(r["fits"] for r in pair)
        shared_fits = bool(of["shared"]) and all(r["fits"] for r in of["shared"])
        t = _key(topo)
        figures[f"{prefix}_shared_chips_{t}"] = chips["shared"]
        figures[f"{prefix}_two_models_chips_{t}"] = chips["main"] + chips["sub"]
        figures[f"{prefix}_two_models_fits_{t}"] = two_fits
        if pair:
            figures[f"{prefix}_two_models_max_gib_per_chip_{t}"] = round(max(r["gib"] for r in pair), 3)
        print(f"{topo:<9} chips: one shared model {chips['shared']} ({'fits' if shared_fits else 'does NOT fit'}); "
              f"two models {chips['main'] + chips['sub']} ({chips['main']} + {chips['sub']}, "
              f"{'fit' if two_fits else 'do NOT fit'})", flush=True)
    return figures


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=tuple(SIZES), default=None,
                        help="default: small (every program of a tiny model on a 4-chip v5e, a few minutes on 2 "
                             "cores); --full: paper (the TPU compiler takes minutes per paper-scale program)")
    parser.add_argument("--full", action="store_true", help="the paper preset on its four topologies")
    parser.add_argument("--topologies", default="", help="comma-separated names (default: all of the size's)")
    parser.add_argument("--programs", default=",".join(ALL_PROGRAMS))
    parser.add_argument("--paged_attention", choices=("pallas", "gather"), default="pallas",
                        help="the paged program's attention (the gather path is planned where Pallas fails)")
    parser.add_argument("--agent", choices=("main", "sub", "shared"), default="sub",
                        help="paper size: which agent's shapes; shared: one model serving both roles, beside the two")
    parser.add_argument("--two_models", action=argparse.BooleanOptionalAction, default=True,
                        help="with --agent=shared: also plan main and sub, each on its own slice, and compare")
    parser.add_argument("--fit_fraction", type=float, default=0.9)
    parser.add_argument("--lora", action="store_true", help="the paper_lora preset (default topologies: "
                        + ", ".join(LORA_TOPOLOGIES) + ")")
    parser.add_argument("--model_overrides", default="", help="e.g. attn_chunk=0,remat=False (ints / bools)")
    parser.add_argument("--quick", action="store_true",
                        help="--size=small --programs=decode: a tiny model's decode step on a 4-chip v5e, seconds")
    args = parser.parse_args(argv)
    args.size = args.size or ("paper" if args.full else "small")
    if args.quick:  # the train and prefill programs take most of the small size's compile time
        args.size, args.programs = "small", "decode"

    table, prefix = SIZES[args.size]
    small = {"small": small_plan, "small_moe": small_moe_plan}
    if args.lora and args.size not in small:
        table, prefix = LORA_TOPOLOGIES, "paper_lora"
    elif args.lora:
        prefix += "_lora"
    names = [n for n in args.topologies.split(",") if n] or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"--topologies {','.join(unknown)}: not a topology of the {prefix} plan (its topologies: "
                     f"{', '.join(table)}); --size=paper or --full plans the paper preset")
    preset = "paper_lora" if args.lora else args.size

    def plan_of(agent: str, pair: bool = False) -> Plan:
        """`agent`'s plan; `pair`: as one of the two models beside a shared one."""
        if args.size in small:  # `--agent` main / sub: the one small model; in a pair main has a quarter of its rows
            plan = small[args.size]()
            if agent == "shared":
                plan = shared_of(small_main(plan), plan)
            elif agent == "main" and pair:
                plan = small_main(plan)
        else:
            plan = paper_plan(agent, preset)
        if args.lora and args.size in small:
            plan = dataclasses.replace(plan, lora=paper_plan(preset="paper_lora").lora)
        if args.model_overrides:
            overrides = dict(item.split("=", 1) for item in args.model_overrides.split(","))
            parsed = {k: v == "True" if v in ("True", "False") else int(v) if v.lstrip("-").isdigit() else v
                      for k, v in overrides.items()}
            plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, **parsed))
        return plan

    plan = plan_of(args.agent)
    programs = tuple(p for p in args.programs.split(",") if p)
    shared = args.agent == "shared"
    label = f"{args.size} shared (one model, both roles: mode {SHARED_MODE})" if shared else args.size
    rows, planned = run_plan(plan, label, f"{prefix}_shared" if shared else prefix, names, table, programs,
                             args.fit_fraction, args.paged_attention)
    m = plan.model
    figures = {"size": args.size, "lora": args.lora, "fit_fraction": args.fit_fraction,
               "params_b": m.num_params() / 1e9,
               "seq_len": plan.seq_len, "train_rows": plan.train_rows}
    figures.update(planned)
    if shared:
        pair = {agent: plan_of(agent, pair=True) for agent in ("main", "sub")}
        figures.update({"agent": "shared", f"{prefix}_shared_main_rows": pair["main"].train_rows,
                        f"{prefix}_shared_sub_rows": pair["sub"].train_rows, f"{prefix}_shared_slots": plan.slots})
        if args.two_models:
            print("two models, each on its own slice:")
            pair_rows = {}
            for agent, p in pair.items():
                pair_rows[agent], planned = run_plan(p, f"{args.size} {agent}", f"{prefix}_{agent}", names, table,
                                                     programs, args.fit_fraction, args.paged_attention)
                figures.update(planned)
            figures.update(compare_shared(prefix, names, rows, pair_rows["main"], pair_rows["sub"]))
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
