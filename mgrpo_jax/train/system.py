"""Assembles a run from its config: the environment, the tokenizer, each agent's `Learner` (model, mesh, train
state, sampler, train steps) and the rollout engine. The trainer and the notebooks start here."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence

import jax
import ml_collections
from etils import epath
from flax import nnx

from mgrpo_jax.config import SHARED_MODES, rl_batch_rows
from mgrpo_jax.env.compact import CompactEnvironment, CompactNoise, CompactWorldConfig, build_compact_environment
from mgrpo_jax.env.environment import OfflineEnvironment, build_offline_environment
from mgrpo_jax.env.experts import NoiseConfig
from mgrpo_jax.env.grammar import get_grammar
from mgrpo_jax.env.judges import HttpJudge, RewardJudge, RuleJudge
from mgrpo_jax.env.prompts import MAIN, SINGLE, SUB, system_prompt
from mgrpo_jax.env.protocol import ToolCall
from mgrpo_jax.env.questions import QuestionSetSizes
from mgrpo_jax.env.scoring import answer_prompt
from mgrpo_jax.env.services import ChatEndpoint, ServiceClient, api_key_from_env
from mgrpo_jax.env.tools import (
    HttpPageBackend,
    HttpSearchBackend,
    SplitBackend,
    WorldBackend,
    main_agent_toolbox,
    single_agent_toolbox,
    sub_agent_toolbox,
)
from mgrpo_jax.env.world import CHARS_PER_TOKEN, WorldConfig
from mgrpo_jax.model import abstract_model, get_model_config, get_rules, make_mesh
from mgrpo_jax.model.lora import lora_spec
from mgrpo_jax.rollout.engine import DELEGATE, AgentRuntime, RolloutEngine, RolloutLimits
from mgrpo_jax.sampling import Sampler
from mgrpo_jax.store.retry import RetryPolicy
from mgrpo_jax.tokenizer import PROTOCOL_TAGS, ChatTokenizer, Tokenizer
from mgrpo_jax.tokenizer_hf import load_checkpoint_tokenizer
from mgrpo_jax.train import pretrained
from mgrpo_jax.train.learner import Learner
from mgrpo_jax.train.state import (
    create_agent_state,
    create_agent_state_from_params,
    create_lora_agent_state,
    merged_params,
    model_from_state,
)

log = logging.getLogger(__name__)


def build_environment(config: ml_collections.ConfigDict) -> OfflineEnvironment | CompactEnvironment:
    """The world of `config.env.grammar`: the offline world of pages (`chat`) or the compact world."""
    env_cfg = config.env
    get_grammar(env_cfg.grammar)  # a clear error for an unknown grammar
    if env_cfg.grammar == "compact":
        return build_compact_environment(env_cfg.seed, QuestionSetSizes(**env_cfg.sizes.to_dict()),
                                         CompactWorldConfig(**env_cfg.compact.to_dict()))
    world = WorldConfig(n_entities=env_cfg.n_entities, background_sentences=env_cfg.background_sentences)
    sizes = QuestionSetSizes(**env_cfg.sizes.to_dict())
    env = build_offline_environment(env_cfg.seed, env_cfg.n_entities, sizes, world)
    backend = WorldBackend(env.world, snippet_chars=env_cfg.snippet_chars)
    return dataclasses.replace(env, backend=backend)


def service_settings(config) -> dict:
    """Timeout and retries of every real service's requests (env.http_*), as `ServiceClient` keyword arguments."""
    attempts, timeout_s, longest = int(config.env.http_max_attempts), float(config.env.http_timeout_s), 16.0
    retry = RetryPolicy(max_attempts=attempts, initial_s=float(config.env.http_backoff_s), max_delay_s=longest,
                        deadline_s=attempts * (timeout_s + longest))
    return {"timeout_s": timeout_s, "retry": retry}


def web_backend(config, env: OfflineEnvironment):
    """The offline world's BM25 backend, or the real search API and page reader the config names."""
    e = config.env
    searcher = env.backend
    if e.search_url:
        searcher = HttpSearchBackend(e.search_url, api_key=api_key_from_env(e.search_api_key_env),
                                     **service_settings(config))
    if not e.visit_url:
        return searcher
    reader = HttpPageBackend(e.visit_url, api_key=api_key_from_env(e.visit_api_key_env), **service_settings(config))
    return SplitBackend(searcher, reader)


def page_chars(config, agent: str) -> int | None:
    """How much of a page read from `env.visit_url` the agent sees (None: the offline world's pages, whole)."""
    if not config.env.visit_url:
        return None
    return int(config.env.visit_max_chars) or int(config[agent].context_tokens) * CHARS_PER_TOKEN


def judge_endpoint(config) -> ChatEndpoint | None:
    """The LLM at `env.judge_url` (None when unset): what rewards and evaluation are judged by."""
    e = config.env
    if not e.judge_url:
        return None
    client = ServiceClient("judge endpoint", api_key=api_key_from_env(e.judge_api_key_env), **service_settings(config))
    return ChatEndpoint(e.judge_url, e.judge_model, client, int(e.judge_max_tokens))


def reward_judge(config, env: OfflineEnvironment | CompactEnvironment) -> RewardJudge:
    """The judge of r_correct and r_expert: the world's rule-based judges, or the LLM at `env.judge_url`. Built per
    step (cheap: no connection is kept), so its `metrics()` are the step's."""
    endpoint = judge_endpoint(config)
    if endpoint is None:
        return RuleJudge(env.judge.score)
    return HttpJudge(endpoint, answer_prompt(config.benchmark), concurrency=int(config.env.judge_concurrency))


def noise_config(config) -> NoiseConfig | CompactNoise:
    if config.env.grammar == "compact":
        return CompactNoise(**{"seed": config.env.seed, **config.env.compact_noise.to_dict()})
    return NoiseConfig(**{"seed": config.env.seed, **config.env.noise.to_dict()})


def tokenizer_corpus(env: OfflineEnvironment | CompactEnvironment, config, limit_questions: int = 200) -> list[str]:
    """Page texts (or the compact world's words), prompts and expert transcripts: everything the agents will read
    or write."""
    if isinstance(env, CompactEnvironment):
        texts = [" ".join(env.world.vocabulary())]
        experts = env.experts(noise_config(config))
        for question in list(env.questions.stage1[:limit_questions]) + list(env.questions.stage2[:limit_questions]):
            for transcript in (experts.main_agent(question), experts.single_agent(question)):
                for episode in (transcript.top, *transcript.subs):
                    texts.extend(message.text for message in episode.messages)
        return texts
    texts = [page.text for page in env.world.pages.values()]
    experts = env.experts(noise_config(config))
    # Every episode starts with its agent's system prompt, so it is as frequent as the episodes themselves;
    # weighting it so lets BPE merge it into a few dozen tokens instead of hundreds.
    for agent, tools in ((MAIN, main_agent_toolbox()), (SUB, sub_agent_toolbox(env.backend)),
                         (SINGLE, single_agent_toolbox(env.backend))):
        texts.extend([system_prompt(agent, tools.specs)] * limit_questions)
    half = limit_questions // 2
    for question in list(env.questions.stage1[:half]) + list(env.questions.stage2[:half]):
        for transcript in (experts.main_agent(question), experts.single_agent(question)):
            for episode in (transcript.top, *transcript.subs):
                texts.extend(message.text for message in episode.messages)
    return texts


def build_tokenizer(config, env: OfflineEnvironment, workdir: str | None) -> Tokenizer:
    """The configured `.model`, else the one saved in the workdir, else the one of the run named by
    `config.init_checkpoint` (its agents' ids), else a new one trained on the world."""
    if config.tokenizer.path:
        return Tokenizer.load(config.tokenizer.path)
    path = epath.Path(workdir) / "tokenizer.model" if workdir else None  # local or gs://
    if path and path.exists():
        return Tokenizer.load(path)
    inherited = epath.Path(config.init_checkpoint) / "tokenizer.model" if config.init_checkpoint else None
    if inherited and inherited.exists():
        tokenizer = Tokenizer.load(inherited)
    elif isinstance(env, CompactEnvironment):
        tokenizer = train_word_tokenizer(env, config)
    else:
        tokenizer = Tokenizer.train(tokenizer_corpus(env, config), config.tokenizer.vocab_size,
                                    **config.tokenizer.trainer_kwargs.to_dict())
    if path and jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(path)
    return tokenizer


def train_word_tokenizer(env: CompactEnvironment, config) -> Tokenizer:
    """The compact world's word-level SentencePiece model: every tag, name, value and handle is a user symbol, so
    each is exactly one piece (a few hundred words beside the 256 byte pieces, which only malformed text uses)."""
    symbols = env.tokenizer_symbols()
    # The word trainer needs room beyond the user symbols; without a hard limit it keeps only what it uses.
    vocab_size = max(config.tokenizer.vocab_size, 4 + 256 + 2 * len(symbols) + 64)
    return Tokenizer.train(tokenizer_corpus(env, config), vocab_size, model_type="word", extra_symbols=symbols)


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


def agent_names(mode: str) -> tuple[str, ...]:
    """The roles of `mode`'s rollouts (the engine's agents): the single agent, or the main agent and its sub-agent."""
    return (SINGLE,) if mode == "single_agent" else (MAIN, SUB)


SHARED = "shared"  # the one learner of a shared-policy mode (config.SHARED_MODES): both roles, built from `main`


def model_sections(mode: str) -> tuple[str, ...]:
    """The config sections a model is built from: one per role, or `main` alone in a shared-policy mode."""
    return (MAIN,) if mode in SHARED_MODES else agent_names(mode)


def distinct_learners(agents: dict) -> dict:
    """{learner name: learner} of a role -> learner mapping: each model once (a shared-policy mode's two roles are
    one learner). What owns state (checkpoints, warm start, export) iterates over these, not over roles."""
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


def agent_mesh_devices(config, only: Sequence[str] | None = None) -> dict[str, list]:
    """{agent: the devices its mesh spans} for the agents of `config.mode` (`only`: a subset). A mesh whose axes
    cannot fit those devices is a ValueError naming `<agent>.mesh` and its value."""
    names = model_sections(config.mode)
    devices = agent_devices([n for n in names if only is None or n in only])
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
    """{role: its Learner} of the run (`only`: a subset of roles, e.g. one side of the decoupled mode, seeded as in
    the full run); each gets `agent_tokenizer(config, name, tokenizer)` (`Learner.tokenizer`). In a shared-policy
    mode both roles map to one learner, `SHARED`, built from `config.main`."""
    names, devices = agent_names(config.mode), agent_mesh_devices(config, only)
    if config.mode in SHARED_MODES:
        shared = build_agent(SHARED, config[MAIN], agent_tokenizer(config, MAIN, tokenizer), devices[MAIN],
                             config.seed * 100)
        return {name: shared for name in names}
    agents = {}
    for offset, name in enumerate(names):
        if name in devices:
            agents[name] = build_agent(name, config[name], agent_tokenizer(config, name, tokenizer), devices[name],
                                       config.seed * 100 + offset)
    if config.mode == "frozen_sub" and SUB in agents:
        agents[SUB].trainable = False
    return agents


def build_engine(config, tokenizer: ChatTokenizer, env: OfflineEnvironment | CompactEnvironment,
                 agents: dict[str, Learner], sub_executor=None, blind: bool = False) -> RolloutEngine:
    """The rollout engine, each agent with its own tokenizer; an agent missing from `agents` (the other job's, in
    decoupled mode) gets a runtime without a sampler: its prompt, tools and tokenizer are known here, its turns
    are not sampled here. `blind`: every tool answers "none" (delegation still runs the sub-agent, whose tools
    are blind too): the evaluation's control for answers that come from memory."""
    limits = RolloutLimits(max_turn_tokens=config.rollout.max_turn_tokens, max_sub_calls=config.rollout.max_sub_calls,
                           temperature=config.rollout.temperature)

    def runtime(name, prompt_and_tools, can_delegate):
        prompt, tools = prompt_and_tools
        if blind:
            tools = {tool: _answer_none for tool in tools}
        sampler = agents[name].sampler if name in agents else None
        own = getattr(agents.get(name), "tokenizer", None) or agent_tokenizer(config, name, tokenizer)
        return AgentRuntime(name, sampler, prompt, tools, can_delegate=can_delegate,
                            max_turns=config[name].max_turns, context_tokens=config[name].context_tokens,
                            tokenizer=own, slots=config[name].get("rollout_slots", 0))

    if isinstance(env, CompactEnvironment):
        def prompt_and_tools(name):
            return env.system_prompt(name), env.tools(name)
    else:
        backend, top_k = web_backend(config, env), config.env.search_top_k
        toolboxes = {MAIN: main_agent_toolbox(), SUB: sub_agent_toolbox(backend, top_k, page_chars(config, SUB)),
                     SINGLE: single_agent_toolbox(backend, top_k, page_chars(config, SINGLE))}

        def prompt_and_tools(name):
            toolbox = toolboxes[name]
            tools = {tool: functools.partial(_execute, toolbox, tool) for tool in toolbox.names if tool != DELEGATE}
            return system_prompt(name, toolbox.specs), tools

    grammar = get_grammar(config.env.grammar)
    if SINGLE in agents:
        return RolloutEngine(tokenizer, runtime(SINGLE, prompt_and_tools(SINGLE), False), None, limits, grammar=grammar)
    return RolloutEngine(tokenizer, runtime(MAIN, prompt_and_tools(MAIN), True),
                         runtime(SUB, prompt_and_tools(SUB), False), limits, sub_executor, grammar=grammar)


def _answer_none(arguments, session=None) -> str:
    return "none"


def _execute(toolbox, name: str, arguments, session=None) -> str:
    """A chat tool as the engine calls it; the chat world's tools keep no per-episode state."""
    return toolbox.execute(ToolCall(name, arguments))
