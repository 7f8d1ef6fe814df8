"""`build_system(config, job)`: the parts one job of a run is made of, assembled from its config: the environment,
the tokenizer, each agent's `Learner` (model, mesh, train state, sampler, jitted steps) and the rollout engine over
them. The trainer, the benchmarks and the notebooks start here; nothing below this module knows the whole."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from etils import epath

from mgrpo_jax.agent.build import agent_tokenizer, build_agents, distinct_learners
from mgrpo_jax.agent.learner import Learner
from mgrpo_jax.config import agent_names
from mgrpo_jax.env.build import Environment, agent_tools, build_environment, tokenizer_corpus
from mgrpo_jax.env.compact import CompactEnvironment
from mgrpo_jax.env.grammar import get_grammar
from mgrpo_jax.env.prompts import MAIN, SINGLE, SUB
from mgrpo_jax.rollout.engine import AgentRuntime, RolloutEngine, RolloutLimits
from mgrpo_jax.tokenizer import ChatTokenizer, Tokenizer

JOBS = {"colocated": None, "main": (MAIN,), "sub": (SUB,)}  # job -> the agents it holds (None: every agent)


@dataclasses.dataclass
class System:
    """One job's parts. `agents`: {agent: its Learner}; in a shared-policy mode both agents map to one learner."""

    config: object
    env: Environment
    tokenizer: Tokenizer
    agents: dict[str, Learner]
    engine: RolloutEngine

    @property
    def learners(self) -> dict[str, Learner]:
        """Each model once: what checkpoints, the warm start and export iterate over."""
        return distinct_learners(self.agents)

    @property
    def top_name(self) -> str:
        """The agent the questions are posed to: `main`, or `single` in the single-agent mode."""
        return agent_names(self.config.mode)[0]

    def blind_engine(self) -> RolloutEngine:
        """The same agents with every tool answering "none": the evaluation's control for answers from memory."""
        return build_engine(self.config, self.tokenizer, self.env, self.agents, blind=True)


def build_system(config, job: str = "colocated", workdir: str | None = None, *, tokenizer: Tokenizer | None = None,
                 sub_executor: Callable | None = None) -> System:
    """The parts of job `job` (`colocated`: every agent; `main` / `sub`: one side of the decoupled mode).
    `tokenizer`: given (the sub job's, the main job's published one), else `build_tokenizer`'s. `sub_executor`:
    where the engine's delegations go when the sub-agent is not in this job (`rollout.engine`)."""
    if job not in JOBS:
        raise ValueError(f"unknown job {job!r}: expected one of {tuple(JOBS)}")
    env = build_environment(config)
    tokenizer = tokenizer or build_tokenizer(config, env, workdir)
    agents = build_agents(config, tokenizer, only=JOBS[job])
    return System(config, env, tokenizer, agents, build_engine(config, tokenizer, env, agents, sub_executor))


def build_tokenizer(config, env: Environment, workdir: str | None) -> Tokenizer:
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


def build_engine(config, tokenizer: ChatTokenizer, env: Environment, agents: dict[str, Learner],
                 sub_executor: Callable | None = None, blind: bool = False) -> RolloutEngine:
    """The rollout engine, each agent with its own tokenizer and the tools the environment gives it; an agent missing
    from `agents` (the other job's, in decoupled mode) gets a runtime without a sampler: its prompt, tools and
    tokenizer are known here, its turns are not sampled here. `blind`: every tool answers "none" (delegation still
    runs the sub-agent, whose tools are blind too)."""
    limits = RolloutLimits(max_turn_tokens=config.rollout.max_turn_tokens, max_sub_calls=config.rollout.max_sub_calls,
                           temperature=config.rollout.temperature)

    def runtime(name, can_delegate):
        prompt, tools = agent_tools(config, env, name, blind=blind)
        learner = agents.get(name)
        return AgentRuntime(name, learner.sampler if learner else None, prompt, tools, can_delegate=can_delegate,
                            max_turns=config[name].max_turns, context_tokens=config[name].context_tokens,
                            tokenizer=(learner and learner.tokenizer) or agent_tokenizer(config, name, tokenizer),
                            slots=config[name].get("rollout_slots", 0),
                            kv_block_size=config.rollout.get("kv_block_size", 0),
                            kv_blocks=config[name].get("rollout_kv_blocks", 0),
                            paged_attention=config.rollout.get("paged_attention", "gather"))

    grammar = get_grammar(config.env.grammar)
    if SINGLE in agent_names(config.mode):
        return RolloutEngine(tokenizer, runtime(SINGLE, False), None, limits, grammar=grammar)
    return RolloutEngine(tokenizer, runtime(MAIN, True), runtime(SUB, False), limits, sub_executor, grammar=grammar)
