"""The environment a config names, and what it supplies each agent: the world (the offline world of pages or the
compact world), the reward judge, the experts' noise, the tokenizer's corpus, and each agent's system prompt and
tools (`agent_tools`), offline or through the real services the config points at."""

from __future__ import annotations

import dataclasses
import functools

import ml_collections

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
    DELEGATE,
    HttpPageBackend,
    HttpSearchBackend,
    SplitBackend,
    WorldBackend,
    main_agent_toolbox,
    single_agent_toolbox,
    sub_agent_toolbox,
)
from mgrpo_jax.env.world import CHARS_PER_TOKEN, WorldConfig
from mgrpo_jax.store.retry import RetryPolicy

Environment = OfflineEnvironment | CompactEnvironment


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


def agent_tools(config, env: Environment, agent: str, blind: bool = False) -> tuple[str, dict]:
    """Agent `agent`'s system prompt and tools {name: fn(arguments, session=None) -> str}, delegation excluded (the
    engine runs it). `blind`: every tool answers "none", the evaluation's control for answers from memory."""
    if isinstance(env, CompactEnvironment):
        prompt, tools = env.system_prompt(agent), env.tools(agent)
    else:
        backend, top_k = web_backend(config, env), config.env.search_top_k
        toolbox = {MAIN: main_agent_toolbox, SUB: functools.partial(sub_agent_toolbox, backend, top_k,
                                                                    page_chars(config, SUB)),
                   SINGLE: functools.partial(single_agent_toolbox, backend, top_k,
                                             page_chars(config, SINGLE))}[agent]()
        prompt = system_prompt(agent, toolbox.specs)
        tools = {tool: functools.partial(_execute, toolbox, tool) for tool in toolbox.names if tool != DELEGATE}
    if blind:
        tools = {tool: _answer_none for tool in tools}
    return prompt, tools


def _answer_none(arguments, session=None) -> str:
    return "none"


def _execute(toolbox, name: str, arguments, session=None) -> str:
    """A chat tool as the engine calls it; the chat world's tools keep no per-episode state."""
    return toolbox.execute(ToolCall(name, arguments))
