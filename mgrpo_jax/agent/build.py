"""Each agent of a run built from its config section: its devices and mesh, its tokenizer, its model (fresh,
pretrained or LoRA over a pretrained base), train state, sampler, and the `Learner` that holds them. In a
shared-policy mode both agents are one learner, `SHARED`."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import jax
from flax import nnx

from mgrpo_jax.agent import pretrained
from mgrpo_jax.agent.learner import Learner
from mgrpo_jax.agent.state import (
    create_agent_state,
    create_agent_state_from_params,
    create_lora_agent_state,
    merged_params,
    model_from_state,
)
from mgrpo_jax.config import SHARED_MODES, agent_names, rl_batch_rows, trained_section
from mgrpo_jax.env.prompts import MAIN, SUB
from mgrpo_jax.model import abstract_model, get_model_config, get_rules, make_mesh
from mgrpo_jax.model.lora import lora_spec
from mgrpo_jax.sampling import Sampler
from mgrpo_jax.tokenizer import PROTOCOL_TAGS, ChatTokenizer
from mgrpo_jax.tokenizer_hf import load_checkpoint_tokenizer

log = logging.getLogger(__name__)


def _by_process(devices: Sequence) -> list[list]:
    """The devices grouped by owning process, in process order (one group in a single-process job)."""
    groups: dict[int, list] = {}
    for d in devices:
        groups.setdefault(d.process_index, []).append(d)
    return [groups[p] for p in sorted(groups)]


def agent_devices(names: Sequence[str]) -> dict[str, list]:
    """Disjoint device subsets per agent when there are enough devices (colocated mode), else shared.

    Multi-process jobs split every process's own devices, so each agent's mesh spans all processes: every
    process runs every agent's computations (SPMD), which it can only do with devices of its own in them.
    """
    groups = _by_process(jax.devices())
    k = len(names)
    if k > 1 and all(len(g) >= k and len(g) % k == 0 for g in groups):
        return {name: [d for g in groups for d in g[i * (len(g) // k):(i + 1) * (len(g) // k)]]
                for i, name in enumerate(names)}
    return {name: jax.devices() for name in names}


def build_agent(name: str, agent_cfg, tokenizer: ChatTokenizer, devices, seed: int, optim_cfg=None) -> Learner:
    """Agent `name` on `devices`: initialised from `seed`, or from its `init_from` checkpoint (whose own tokenizer
    `tokenizer` then is, see `agent_tokenizer`)."""
    mesh = make_mesh(agent_cfg.mesh.to_dict(), devices)
    rules = get_rules(agent_cfg.get("sharding_rules", "default"))
    optim_cfg = optim_cfg or agent_cfg.optim
    params = None
    if agent_cfg.get("init_from"):
        model_config, params = pretrained.load_pretrained(agent_cfg, tokenizer, mesh, rules)
    else:
        overrides = dict(agent_cfg.model_overrides.to_dict())
        overrides.setdefault("vocab_size", tokenizer.vocab_size)
        model_config = get_model_config(agent_cfg.model, **overrides)
        if model_config.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"{name}: model vocab {model_config.vocab_size} < tokenizer vocab {tokenizer.vocab_size}")
    lora, base = lora_spec(agent_cfg.get("lora")), None
    if lora is not None:
        graphdef, state, sharding, base = create_lora_agent_state(model_config, lora, optim_cfg, mesh, rules,
                                                                  seed=seed, base_params=params)
        policy = nnx.merge(abstract_model(model_config, mesh, rules)[0], merged_params(state.params, base, lora.scale))
    else:
        if params is not None:
            graphdef, state, sharding = create_agent_state_from_params(model_config, params, optim_cfg, mesh, rules)
        else:
            graphdef, state, sharding = create_agent_state(model_config, optim_cfg, mesh, rules, seed=seed)
        policy = model_from_state(graphdef, state)
    sampler = Sampler(policy, pad_id=tokenizer.pad_id, decode_phases=agent_cfg.decode_phases)
    log.info("%s agent: %s, %.2fM parameters%s, mesh %s", name, agent_cfg.get("init_from") or agent_cfg.model,
             model_config.num_params() / 1e6,
             "" if lora is None else f" + LoRA rank {lora.rank} on {','.join(lora.targets)} "
             f"({sum(x.size for x in jax.tree.leaves(state.params)) / 1e6:.2f}M trained)", dict(mesh.shape))
    return Learner(name, agent_cfg, model_config, mesh, graphdef, state, sharding, sampler, rules,
                   tokenizer=tokenizer, base=base, lora=lora)


SHARED = "shared"  # the one learner of a shared-policy mode (config.SHARED_MODES): both agents, built from `main`


def model_sections(mode: str) -> tuple[str, ...]:
    """The config sections a model is built from: one per agent, or `main` alone in a shared-policy mode."""
    return (MAIN,) if mode in SHARED_MODES else agent_names(mode)


def distinct_learners(agents: dict) -> dict:
    """{learner name: learner} of an agent -> learner mapping: each model once (a shared-policy mode's two agents are
    one learner). What owns state (checkpoints, warm start, export) iterates over these, not over agents."""
    return {learner.name: learner for learner in agents.values()}


def batch_rows(config, name: str) -> list[int]:
    """Rows per micro-batch of every batch the agent's train steps see; each must split over its data axes."""
    rl_rows = rl_batch_rows(config, name)
    micro = config[name].micro_batches
    for rows in (config.warmstart.batch_size, rl_rows):
        if rows % micro:
            raise ValueError(f"{name}: a batch of {rows} rows does not split into micro_batches={micro}")
    return [config.warmstart.batch_size // micro, rl_rows // micro]


def fit_devices(devices: list, rows: Sequence[int], fixed_axes: int = 1) -> list:
    """The largest prefix of `devices` whose data-parallel size divides every batch's row count (in a
    multi-process job: the same number of devices from each process, so every process keeps some)."""
    groups = _by_process(devices)
    per = min(len(g) for g in groups)
    for n in range(len(groups) * per, 0, -len(groups)):
        if n % fixed_axes == 0 and all(r % (n // fixed_axes) == 0 for r in rows):
            if n < len(devices):
                log.warning("using %d of %d devices: batches of %s rows do not split over more", n, len(devices),
                            sorted(set(rows)))
            return [d for g in groups for d in g[:n // len(groups)]]
    raise ValueError(f"no device count divides batches of {rows} rows with fixed mesh axes of size {fixed_axes}")


def agent_tokenizer(config, name: str, shared: ChatTokenizer) -> ChatTokenizer:
    """Agent `name`'s tokenizer: the one of its `init_from` checkpoint, else the run's `shared` one. Text that
    crosses between agents (a delegated task, a sub-agent's answer) is tokenized by the agent that reads it. The
    `chat` grammar's tags are made single tokens of a checkpoint's vocabulary (`tokenizer_hf`)."""
    path = config[name].get("init_from", "")
    if not path:
        return shared
    return load_checkpoint_tokenizer(path, PROTOCOL_TAGS if config.env.grammar == "chat" else ())


def rollout_device_count(config) -> int:
    """How many of each agent's devices sample in an asynchronous run (`async_rl.rollout_devices`); 0 otherwise."""
    section = config.get("async_rl")
    return int(section.rollout_devices) if section is not None and section.enabled else 0


def split_rollout_devices(config, devices: dict[str, list]) -> tuple[dict[str, list], dict[str, list]]:
    """({agent: its training devices}, {agent: its sampling devices}) of each agent's share: the last
    `async_rl.rollout_devices` sample (none: the sampler runs on the training devices, the second dict empty)."""
    count = rollout_device_count(config)
    if not count:
        return devices, {}
    for name, own in devices.items():
        if len(own) <= count:
            raise ValueError(f"async_rl.rollout_devices={count}: agent {name} gets only {len(own)} devices, and needs "
                             "at least one more to train on")
    return {n: own[:-count] for n, own in devices.items()}, {n: own[-count:] for n, own in devices.items()}


def agent_rollout_devices(config, only: Sequence[str] | None = None) -> dict[str, list]:
    """{agent (model section): the devices its asynchronous sampler runs on}; empty when they are its learner's."""
    names = model_sections(config.mode)
    return split_rollout_devices(config, agent_devices([n for n in names if only is None or n in only]))[1]


def agent_mesh_devices(config, only: Sequence[str] | None = None) -> dict[str, list]:
    """{agent: the devices its mesh spans} for the agents of `config.mode` (`only`: a subset), less those its
    asynchronous sampler takes (`split_rollout_devices`). A mesh whose axes cannot fit those devices is a ValueError
    naming `<agent>.mesh` and its value."""
    names = model_sections(config.mode)
    devices = split_rollout_devices(config, agent_devices([n for n in names if only is None or n in only]))[0]
    out = {}
    for name in (n for n in names if n in devices):
        shape = config[name].mesh.to_dict()
        fixed = math.prod(size for size in shape.values() if size > 0)
        try:
            out[name] = fit_devices(devices[name], batch_rows(config, name), fixed)
            make_mesh(shape, out[name])  # the axes' sizes fit those devices
        except ValueError as e:
            raise ValueError(f"{name}.mesh={shape}: does not fit the {len(devices[name])} devices this agent gets "
                             f"({e})") from None
    return out


def build_agents(config, tokenizer: ChatTokenizer, only: Sequence[str] | None = None) -> dict[str, Learner]:
    """{agent: its Learner} of the run (`only`: a subset of agents, e.g. one side of the decoupled mode, seeded as in
    the full run); each gets `agent_tokenizer(config, name, tokenizer)` (`Learner.tokenizer`). In a shared-policy
    mode both agents map to one learner, `SHARED`, built from `config.main` with its loss recipe
    (`config.trained_section`)."""
    names, devices = agent_names(config.mode), agent_mesh_devices(config, only)
    if config.mode in SHARED_MODES:
        shared = build_agent(SHARED, trained_section(config, MAIN), agent_tokenizer(config, MAIN, tokenizer),
                             devices[MAIN], config.seed * 100)
        return {name: shared for name in names}
    agents = {}
    for offset, name in enumerate(names):
        if name in devices:
            agents[name] = build_agent(name, config[name], agent_tokenizer(config, name, tokenizer), devices[name],
                                       config.seed * 100 + offset)
    if config.mode == "frozen_sub" and SUB in agents:
        agents[SUB].trainable = False
    return agents
