"""The multi-agent rollout engine: Q questions x K rollouts of the whole system, on each agent's decode slots.

Every agent's sampler holds a fixed number of decode slots (`AgentRuntime.slots`, the config's
`<agent>.rollout_slots`; 0: one per episode that can be live at once), each with its own KV cache
(:mod:`mgrpo_jax.sampling.slots`). An episode that wants a turn gets a slot and keeps it across its turns, so a turn
prefills only what the episode gained since its last one (the tool response or the sub-agent's answer, and the
assistant header). Slots decode in jitted chunks of a few steps (`AgentRuntime.decode_chunk`); between chunks the
engine takes the turns that ended, runs their tools, starts a `delegate` call's sub-agent episode in the sub-agent's
pool, hands a finished sub-agent's answer back to its parent, and starts the next turns in the slots that are free.
The main agent's and the sub-agent's pools advance side by side: each round dispatches a chunk of every pool before
waiting on any, so neither agent waits for the other's whole batch.

**When an episode must leave its slot.** A main episode that waits on its sub-agent keeps its slot until another
episode needs one and none is free; then the episode that has waited longest gives it up, and prefills its whole
context once when it is next ready. The cache is not kept in host memory: copying it out and back costs a transfer
of the whole cache (on the paper's shapes, gigabytes per episode over the host link) where the prefill is one
compute-bound forward pass over the same tokens; it would also hold host memory for every parked episode. With the
default slot count (one per rollout) no episode ever leaves its slot; fewer slots trade prefill for cache memory.

**Paged KV** (`AgentRuntime.kv_block_size` > 0, the config's `rollout.kv_block_size`): the agent's slots keep their
episodes' keys and values in blocks of that many tokens (:mod:`mgrpo_jax.sampling.paged`), each episode holding the
blocks its length needs and the full blocks of a common prefix (a query's K rollouts' system prompt and question)
stored once, so the store (`kv_blocks`) bounds the rollout's KV memory rather than slots x context. A turn starts
when the store has its blocks; until it does, idle episodes (parked on a sub-agent) leave it as above, and where no
turn runs at all the first waiting episode takes the blocks of the other waiting ones (they prefill again later).

**Random numbers** come from the episode and the turn (`seed`, agent, question, rollout, invocation, turn number),
never from the slot or the batch: the same seed gives the same episodes whatever the slot count.

A sampler without slots (an object with only `.sample(prompts, max_new=, rng=, temperature=, stop_tokens=,
budgets=)`, and the `top_k` / `top_p` its rows are drawn with where it filters, e.g. a scripted policy in tests) gets
each round's pending turns in one call, as the lock-step engine did. The lock-step engine itself
(`mgrpo_jax.rollout.lockstep.LockstepRolloutEngine`: every ready episode's turn in one batch that decodes until its
longest row stops, the whole episode prefilled every turn) is kept as the oracle the tests compare against.

Delegations can also be served elsewhere (decoupled mode): a `sub_executor` callable receives each round's newly
spawned sub-agent episodes and returns them finished (answer and end reason filled in), instead of the sub-agent's
pool running them in this process. The sub-agent job runs them with `start_sub` / `run_subs`, on the same slots.

Limits end an episode cleanly and are recorded as its `end_reason`: a turn that breaks the protocol
(`format_error`), the agent's turn limit (`max_turns`), its context budget (`context`), a turn longer
than the per-turn token limit (`turn_too_long`). The per-rollout cap on delegations answers further
`delegate` calls with an error the main agent reads. Model outputs that break the protocol are data for
the reward, never exceptions.

Nothing a model writes can crash a run. The grammars' parsers are total, the tokenizer decodes any ids, and the
tools answer bad arguments with an error message. As a last line of defence, a tool (or the `delegate` argument
reader) that still raises on the arguments a model wrote is answered with the grammar's
`render_tool_error(tool, error)` (chat: `Error: <tool> failed on its arguments: <ExceptionType>: <message>`; the
compact grammar: its one-word `error`), logged once per tool and exception type, and counted in the episode's
`tool_calls` under `error/<tool>` (`RolloutBatch.stats()`: `<agent>/tool_errors`). Only that call is guarded;
an exception anywhere else in the engine is a bug and raises. Every text the engine renders (tool responses,
delegated tasks, sub-agent answers) is made valid Unicode first (`protocol.valid_unicode`).

**What the engine keeps of an episode while it runs** (`EpisodeState`: the delegation a main episode waits on, the
scratch space its tools share) is its own and lives for the run; the `Episode` holds only the trajectory, what is
judged, trained on and sent between jobs. A turn is read by the engine's `parse_turn` (the grammar's) and has no
length fixed ahead (`turn_length`); a subclass may script both (benchmarks and tests:
`mgrpo_jax.bench.rollout.ScriptedRolloutEngine`).

Each agent may have its own tokenizer (`AgentRuntime.tokenizer`, e.g. its pretrained checkpoint's): an episode is
rendered, sampled and decoded with its agent's, and the text that crosses between agents (a delegated task, a
sub-agent's answer) crosses as text, tokenized by the agent that reads it.
"""

from __future__ import annotations

import contextlib
import logging
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mgrpo_jax.env.grammar import CHAT, Grammar, delegation
from mgrpo_jax.env.prompts import ASSISTANT, SYSTEM, TOOL, USER
from mgrpo_jax.env.protocol import FinalAnswer, FormatError, ParsedTurn, ToolCall, valid_unicode
from mgrpo_jax.env.tools import DELEGATE
from mgrpo_jax.rollout.episode import (
    ANSWERED,
    CONTEXT_FULL,
    FORMAT_ERROR,
    MAX_TURNS,
    TOOL_ERROR_PREFIX,
    TURN_TOO_LONG,
    Episode,
    RolloutBatch,
)
from mgrpo_jax.sampling.buckets import DEFAULT_BATCH_BUCKETS, bucket
from mgrpo_jax.sampling.paged import PagedSlots
from mgrpo_jax.sampling.sampler import Sampler
from mgrpo_jax.sampling.slots import SLOT_CHUNK, DecodeSlots

log = logging.getLogger(__name__)


@dataclass
class AgentRuntime:
    """What the engine needs to run one agent: its sampler, its tools and its limits."""

    name: str  # "main", "sub" or "single"
    sampler: object  # a `Sampler` (decode slots), or any `.sample(prompts, max_new=, rng=, temperature=, stop_tokens=,
    # budgets=)` (module docstring)
    system_prompt: str
    # Run in-process as `tool(arguments, session)`; `session` is the episode's own dict (compact `open r2` reads the
    # episode's last search from it). `delegate` is handled by the engine.
    tools: Mapping[str, Callable[[Mapping, dict], str]]
    can_delegate: bool = False
    max_turns: int = 8
    context_tokens: int = 2048
    tokenizer: Any = None  # its own ChatTokenizer (None: the engine's); it renders and reads all of its episodes
    slots: int = 0  # decode slots of its sampler (0: one per episode that can be live at once, rounded up)
    decode_chunk: int = 0  # decode steps per round between the host's looks at the slots (0: the sampler's default)
    # Paged KV (mgrpo_jax/sampling/paged.py): blocks of this many tokens, 0: each slot a row of the whole context.
    kv_block_size: int = 0
    kv_blocks: int = 0  # blocks of the paged store (0: as many as the slots' rows would hold)
    paged_attention: str = "gather"  # the paged decode's attention: "gather" (any backend) or "pallas" (TPU kernel)

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(self.tools) + ((DELEGATE,) if self.can_delegate else ())


@dataclass(frozen=True)
class RolloutLimits:
    max_turn_tokens: int = 128  # new tokens per assistant turn (the sampler's static max_new)
    max_sub_calls: int = 16  # delegations per rollout; further calls get an error response
    min_turn_tokens: int = 8  # a turn needs at least this much context left, else the episode ends
    max_answer_chars: int = 400  # a sub-agent's answer as the main agent sees it
    temperature: float = 1.0


@dataclass(eq=False)
class EpisodeState:
    """What the engine keeps of an episode while a run drives it, apart from its trajectory (the `Episode`)."""

    episode: Episode = field(repr=False)  # whose state it is (held: its id names no other episode during the run)
    waiting_on: Episode | None = None  # main episodes: the delegation being served
    tool_session: dict = field(default_factory=dict, repr=False)  # the episode's tools' scratch space


class EngineCore:
    """What both engines share: episodes, tool responses, a turn's bookkeeping, delegation and hand-back.

    Subclasses may script their agents' turns by overriding `turn_length` and `parse_turn` (module docstring)."""

    def __init__(self, tokenizer, top: AgentRuntime, sub: AgentRuntime | None = None,
                 limits: RolloutLimits | None = None,
                 sub_executor: Callable[[list[Episode], Sequence], list[Episode]] | None = None,
                 grammar: Grammar = CHAT):
        if top.can_delegate and sub is None:
            raise ValueError(f"agent {top.name!r} can delegate but no sub-agent runtime was given")
        self.tokenizer = tokenizer
        self.top = top
        self.sub = sub
        self.limits = limits or RolloutLimits()
        self.grammar = grammar  # how turns parse and how prompts and tool responses are written
        # None: sub-agent turns run here, on the sub-agent's sampler. Else called as `sub_executor(spawned,
        # questions)` with the sub-agent episodes a round started; returns them finished.
        self.sub_executor = sub_executor
        self._runtimes = {agent.name: agent for agent in (top, sub) if agent is not None}
        for agent in self._runtimes.values():
            agent.tokenizer = agent.tokenizer or tokenizer
        self._logged_failures: set[tuple[str, str]] = set()
        self._states: dict[int, EpisodeState] | None = None  # id(episode) -> its state, during a run

    # -- the engine's per-episode state ---------------------------------------------------------------

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """The span of one run: the episodes' states live as long as it (a run inside another shares its states)."""
        if self._states is not None:
            yield
            return
        self._states = {}
        try:
            yield
        finally:
            self._states = None

    def _state(self, episode: Episode) -> EpisodeState:
        """The engine's state of an episode of the current run (a new one the first time)."""
        state = self._states.get(id(episode))
        if state is None:
            state = self._states[id(episode)] = EpisodeState(episode)
        return state

    def _waiting(self, episode: Episode) -> bool:
        """Whether the episode waits on a delegation (its sub-agent episode has not answered yet)."""
        state = self._states.get(id(episode))
        return state is not None and state.waiting_on is not None

    # -- how a turn is read (subclasses may script it) ----------------------------------------------

    def turn_length(self, agent: AgentRuntime, episode: Episode) -> int | None:
        """A length fixed ahead for the episode's next turn, or None (here: a turn ends at its stop token, or is cut
        off by a limit). A turn that reaches its fixed length is whole, as if it had stopped (its text: all of its
        ids); the length also caps the turn's budget. Scripted engines (benchmarks, tests) override it."""
        return None

    def parse_turn(self, agent: AgentRuntime, episode: Episode, text: str) -> ParsedTurn:
        """What a whole turn's text does (a tool call, a final answer or a format error): the grammar's reading
        (scripted engines: their script's)."""
        return self.grammar.parse_turn(text, allowed_tools=agent.tool_names)

    # -- episode construction ------------------------------------------------------------------------

    def _start(self, agent: AgentRuntime, user_text: str, **fields) -> Episode:
        episode = Episode(agent=agent.name, **fields)
        ids, _ = agent.tokenizer.render_chat([(SYSTEM, agent.system_prompt), (USER, valid_unicode(user_text))])
        episode.extend(ids)
        return episode

    def _respond(self, episode: Episode, output: str) -> None:
        """A tool response (or a sub-agent's answer) to `episode`, tokenized by the episode's own agent."""
        response = self.grammar.render_tool_response(valid_unicode(output))
        episode.extend(self._runtimes[episode.agent].tokenizer.render_message(TOOL, response))

    def _top_episodes(self, questions: Sequence, rollouts: int) -> list[list[Episode]]:
        return [[self._start(self.top, self.grammar.question_prompt(q.text), question_index=qi, rollout=k)
                 for k in range(rollouts)]
                for qi, q in enumerate(questions)]

    def start_sub(self, task: str, context: str = "", **fields) -> Episode:
        """A new sub-agent episode for `delegate(task, context)` (fields: question_index, rollout, invocation)."""
        task, context = valid_unicode(task), valid_unicode(context)
        return self._start(self.sub, self.grammar.sub_agent_prompt(task, context),
                           call={"task": task, "context": context},
                           task=task if not context.strip() else f"{task}\n{context}", **fields)

    # -- one turn ------------------------------------------------------------------------------------

    def _prepare_turn(self, agent: AgentRuntime, episode: Episode) -> _Turn | None:
        """The next turn's prompt (the episode and the assistant header) and budget; None, with the episode ended
        (`context`), when too little of its context budget is left for a turn."""
        prefix = agent.tokenizer.render_turn_prefix(ASSISTANT)
        room = agent.context_tokens - len(episode.tokens) - len(prefix)
        if room < self.limits.min_turn_tokens:
            episode.end_reason = CONTEXT_FULL
            return None
        budget = min(self.limits.max_turn_tokens, room)
        length = self.turn_length(agent, episode)
        if length is not None:
            length = int(length)
            budget = min(budget, length)
        return _Turn(prefix, budget, length, getattr(agent.sampler, "version", 0))

    def _finish_turn(self, agent: AgentRuntime, episode: Episode, turn: _Turn, ids, logprobs, stopped: bool,
                     temperature: float) -> list[Episode]:
        """Appends a sampled turn to its episode and acts on it; returns the sub-agent episodes it started."""
        tokenizer = agent.tokenizer
        top_k, top_p = int(agent.sampler.top_k), float(agent.sampler.top_p)
        episode.temperature, episode.top_k, episode.top_p = float(temperature), top_k, top_p
        episode.extend(turn.prefix)
        episode.extend(ids, trained=True, logprobs=logprobs, version=turn.version)
        # A turn with a length fixed ahead (`turn_length`) is whole when it reaches it.
        whole = stopped or (turn.length is not None and len(ids) == turn.length)
        if not whole:
            episode.turns.append(tokenizer.decode(ids))
            # Cut short by the context budget, or by the per-turn token limit.
            episode.end_reason = CONTEXT_FULL if turn.budget < self.limits.max_turn_tokens else TURN_TOO_LONG
            return []
        episode.extend(tokenizer.turn_separator_ids)
        text = tokenizer.decode(ids[:-1] if stopped else ids)
        episode.turns.append(text)
        return self._act(agent, episode, text)

    def _act(self, agent: AgentRuntime, episode: Episode, text: str) -> list[Episode]:
        parsed = self.parse_turn(agent, episode, text)
        if isinstance(parsed, FormatError):
            episode.end_reason = FORMAT_ERROR
            episode.format_error = parsed.reason
            return []
        if isinstance(parsed, FinalAnswer):
            episode.answer = parsed.text
            episode.end_reason = ANSWERED
            return []
        episode.tool_calls[parsed.name] += 1
        state = self._state(episode)
        spawned = []
        if parsed.name == DELEGATE:
            if len(episode.subs) >= self.limits.max_sub_calls:
                self._respond(episode, f"Error: at most {self.limits.max_sub_calls} delegations per question.")
            else:
                arguments, error = self._guarded(episode, parsed, lambda: delegation(parsed.arguments))
                if error is not None:
                    self._respond(episode, error)
                else:
                    sub = self.start_sub(*arguments, question_index=episode.question_index,
                                         rollout=episode.rollout, invocation=len(episode.subs))
                    episode.subs.append(sub)
                    state.waiting_on = sub
                    spawned.append(sub)
        else:
            tool = agent.tools[parsed.name]
            output, error = self._guarded(episode, parsed, lambda: tool(parsed.arguments, state.tool_session))
            self._respond(episode, output if error is None else error)
        if state.waiting_on is None and len(episode.turns) >= agent.max_turns:
            episode.end_reason = MAX_TURNS
        return spawned

    def _guarded(self, episode: Episode, call: ToolCall, run: Callable[[], Any]) -> tuple[Any, str | None]:
        """`(run(), None)`, where `run` is the tool call on a model's parsed arguments; if it raises, `(None, the
        error response the agent reads)`, counted under `error/<tool>` in the episode's `tool_calls`."""
        try:
            return run(), None
        except Exception as error:  # whatever a model wrote, the run goes on (module docstring)
            episode.tool_calls[TOOL_ERROR_PREFIX + call.name] += 1
            kind = type(error).__name__
            if (call.name, kind) not in self._logged_failures:
                self._logged_failures.add((call.name, kind))
                log.warning("tool %s raised on model-written arguments %.200r (answered with an error; logged "
                            "once per tool and exception type)", call.name, call.arguments, exc_info=True)
            return None, self.grammar.render_tool_error(call.name, error)

    def _return_to_parent(self, sub: Episode, top: list[list[Episode]]) -> None:
        parent = top[sub.question_index][sub.rollout]
        self._state(parent).waiting_on = None
        if sub.answer is not None:
            report = sub.answer[: self.limits.max_answer_chars]
        else:
            report = self.grammar.no_answer_report(sub.end_reason)
        self._respond(parent, report)
        if len(parent.turns) >= self.top.max_turns:
            parent.end_reason = MAX_TURNS


class RolloutEngine(EngineCore):
    """Runs episodes on every agent's decode slots (module docstring). `slot_stats` holds the last run's pool
    counters per agent (prefilled and decoded tokens, slot-steps, chunks, evictions)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slot_stats: dict[str, dict[str, int]] = {}

    def run(self, questions: Sequence, rollouts: int, seed: int = 0, temperature: float | None = None) -> RolloutBatch:
        """Run `rollouts` whole-system episodes of every question; returns them with timings. `temperature`
        overrides the limits' for this call (0: greedy, e.g. the warm start's format check)."""
        timings = {"sampling_s": 0.0, "tools_s": 0.0}
        temperature = self.limits.temperature if temperature is None else float(temperature)
        top = self._top_episodes(questions, rollouts)
        live = len(questions) * rollouts  # at most one sub-agent episode per rollout runs at a time
        pools = {self.top.name: _pool(self.top, live, self, seed, temperature)}
        if self.sub is not None and self.sub_executor is None:
            pools[self.sub.name] = _pool(self.sub, live, self, seed, temperature)
        self._drive(pools, [e for row in top for e in row], timings, top=top, questions=questions)
        return RolloutBatch(list(questions), top, timings)

    def run_subs(self, subs: list[Episode], seed: int = 0, timings: dict | None = None,
                 temperature: float | None = None) -> dict:
        """Runs sub-agent episodes to the end on the sub-agent's slots (the sub-agent job's side); returns timings.
        `temperature` overrides the limits' for this call, as in `run`."""
        timings = {"sampling_s": 0.0, "tools_s": 0.0} if timings is None else timings
        temperature = self.limits.temperature if temperature is None else float(temperature)
        if subs:
            self._drive({self.sub.name: _pool(self.sub, len(subs), self, seed, temperature)}, list(subs), timings)
        return timings

    def _drive(self, pools: dict, episodes: list[Episode], timings: dict, top=None, questions=None) -> None:
        """Rounds of: every pool starts the turns it has slots for and dispatches a chunk; then each pool's ended
        turns are appended and acted on, and every episode goes where its state says (`_settle`)."""
        with self._running():
            self._drive_pools(pools, episodes, timings, top, questions)

    def _drive_pools(self, pools: dict, episodes: list[Episode], timings: dict, top, questions) -> None:
        try:
            for episode in episodes:
                self._settle(episode, pools, top)
            while any(pool.busy for pool in pools.values()):
                t0 = time.perf_counter()
                for pool in pools.values():  # every pool's chunk is in flight before any is waited on
                    pool.launch()
                timings["sampling_s"] += time.perf_counter() - t0
                for pool in pools.values():
                    t0 = time.perf_counter()
                    finished = pool.collect()
                    timings["sampling_s"] += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    spawned = []
                    for episode, turn, ids, logprobs, stopped in finished:
                        spawned.extend(self._finish_turn(pool.agent, episode, turn, ids, logprobs, stopped,
                                                         pool.temperature))
                        self._settle(episode, pools, top)
                    timings["tools_s"] += time.perf_counter() - t0
                    if spawned and self.sub_executor is not None:
                        t0 = time.perf_counter()
                        for sub in self.sub_executor(spawned, questions):
                            self._settle(sub, pools, top)
                        timings["remote_subs_s"] = timings.get("remote_subs_s", 0.0) + time.perf_counter() - t0
                    else:
                        for sub in spawned:
                            self._settle(sub, pools, top)
        finally:
            self.slot_stats = {name: pool.stats() for name, pool in pools.items()}
            for pool in pools.values():
                pool.close()

    def _settle(self, episode: Episode, pools: dict, top) -> None:
        """Queues a ready episode for its next turn; leaves one that waits on a sub-agent parked (in its slot, while
        no one else needs it); frees the slot of one that ended, and hands a finished sub-agent's answer back."""
        pool = pools.get(episode.agent)
        if not episode.done and not self._waiting(episode):
            turn = self._prepare_turn(pool.agent, episode)
            if turn is not None:
                pool.queue(episode, turn)
                return
        if episode.done:
            if pool is not None:
                pool.release(episode)
            if top is not None and self.sub is not None and episode.agent == self.sub.name:
                self._return_to_parent(episode, top)
                self._settle(top[episode.question_index][episode.rollout], pools, top)


def _pool(agent: AgentRuntime, live: int, engine: EngineCore, seed: int, temperature: float):
    if agent.sampler is None:
        raise ValueError(f"agent {agent.name!r} has no sampler in this process")
    if isinstance(agent.sampler, Sampler):
        return _SlotPool(agent, live, engine.limits, seed, temperature)
    return _CallPool(agent, engine.limits, seed, temperature)


@dataclass(frozen=True)
class _Turn:
    prefix: list[int]  # the assistant header, appended before the sampled ids
    budget: int  # new tokens the turn may sample
    length: int | None  # its length fixed ahead (EngineCore.turn_length): reaching it ends the turn whole
    # The sampler's policy version when the turn was prepared (mgrpo_jax/rl/asynchronous.py pushes new weights while
    # episodes run): its tokens are tagged with it, the oldest version any of them can have been sampled under.
    version: int = 0


class _SlotPool:
    """An agent's pending turns on its sampler's decode slots; chooses who holds which slot."""

    def __init__(self, agent: AgentRuntime, live: int, limits: RolloutLimits, seed: int, temperature: float):
        self.agent, self.seed, self.temperature = agent, seed, temperature
        n = agent.slots or bucket(live, DEFAULT_BATCH_BUCKETS)
        chunk = agent.decode_chunk or SLOT_CHUNK
        if agent.kv_block_size:
            self.slots = PagedSlots(agent.sampler, n, agent.context_tokens, block_size=agent.kv_block_size,
                                    blocks=agent.kv_blocks, attention=agent.paged_attention, chunk=chunk)
        else:
            self.slots = DecodeSlots(agent.sampler, n, agent.context_tokens, chunk=chunk)
        self.stop = (agent.tokenizer.end_of_turn_id,)
        self._waiting: list[tuple[Episode, _Turn]] = []
        self._turns: dict[int, _Turn] = {}
        self._idle_since: dict[int, int] = {}  # slot -> round its owner's last turn ended (eviction order)
        self._round = 0

    def queue(self, episode: Episode, turn: _Turn) -> None:
        self._waiting.append((episode, turn))

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or self.slots.busy

    def launch(self) -> None:
        queued = {id(e) for e, _ in self._waiting}
        still = [(episode, turn) for episode, turn in self._waiting if not self._admit(episode, turn, queued)]
        if still and not self.slots.busy:
            # Nothing runs, and the paged store's blocks are held by episodes that wait for a turn too: the first
            # waiting one takes what it needs from the others (they prefill again when they get their turn).
            episode, turn = still[0]
            if self._admit(episode, turn, {id(episode)}):
                still = still[1:]
        self._waiting = still
        self.slots.launch()

    def _admit(self, episode: Episode, turn: _Turn, queued: set[int]) -> bool:
        """Starts the episode's turn in its slot, or a free one, or the slot of an idle episode (not in `queued`),
        where the pool has room for it (a paged pool's blocks: idle episodes leave until it does); False if not."""
        slots = self.slots
        slot = slots.slot_of(episode)
        if slot is None:
            slot = slots.free_slot()
            if slot is None:
                slot = self._evictable(queued)
                if slot is None:
                    return False
                slots.release(slots.owners[slot], evicted=True)
            slots.assign(episode, slot)
        context = episode.tokens + turn.prefix
        while not slots.fits(episode, context, turn.budget):
            other = self._evictable(queued | {id(episode)})
            if other is None:
                if not slots.cached[slot]:  # it holds nothing yet: its slot serves another episode meanwhile
                    slots.release(episode)
                return False
            slots.release(slots.owners[other], evicted=True)
        self._turns[id(episode)] = turn
        slots.start(episode, context, budget=turn.budget, seed=turn_seed(self.seed, episode),
                    temperature=self.temperature, stop_tokens=self.stop)
        return True

    def _evictable(self, queued: set[int]) -> int | None:
        """The slot whose owner has waited longest (on its sub-agent) without a turn, if any."""
        idle = [(self._idle_since.get(s, -1), s) for s, owner in enumerate(self.slots.owners)
                if owner is not None and id(owner) not in queued and not self.slots.in_turn(s)]
        return min(idle)[1] if idle else None

    def collect(self) -> list:
        self._round += 1
        out = []
        for episode, ids, logprobs, stopped in self.slots.collect():
            self._idle_since[self.slots.slot_of(episode)] = self._round
            out.append((episode, self._turns.pop(id(episode)), ids, logprobs, stopped))
        return out

    def release(self, episode: Episode) -> None:
        if self.slots.slot_of(episode) is not None:
            self.slots.release(episode)

    def close(self) -> None:
        self.slots.close()

    def stats(self) -> dict[str, int]:
        return self.slots.stats()


class _CallPool:
    """An agent whose sampler has no slots (`.sample` only): each round's pending turns in one call."""

    def __init__(self, agent: AgentRuntime, limits: RolloutLimits, seed: int, temperature: float):
        self.agent, self.limits, self.seed, self.temperature = agent, limits, seed, temperature
        self._waiting: list[tuple[Episode, _Turn]] = []
        self._out = None
        self._round = 0

    def queue(self, episode: Episode, turn: _Turn) -> None:
        self._waiting.append((episode, turn))

    @property
    def busy(self) -> bool:
        return bool(self._waiting)

    def launch(self) -> None:
        if not self._waiting:
            return
        batch, self._waiting = self._waiting, []
        out = self.agent.sampler.sample([e.tokens + t.prefix for e, t in batch], max_new=self.limits.max_turn_tokens,
                                        rng=round_seed(self.seed, self._round, self.agent.name),
                                        temperature=self.temperature,
                                        stop_tokens=(self.agent.tokenizer.end_of_turn_id,),
                                        budgets=[t.budget for _, t in batch])
        self._round += 1
        self._out = (batch, out)

    def collect(self) -> list:
        if self._out is None:
            return []
        (batch, out), self._out = self._out, None
        return [(episode, turn, out.tokens[row, :int(out.lengths[row])], out.logprobs[row, :int(out.lengths[row])],
                 bool(out.stopped[row])) for row, (episode, turn) in enumerate(batch)]

    def release(self, episode: Episode) -> None:
        pass

    def close(self) -> None:
        self._waiting, self._out = [], None

    def stats(self) -> dict[str, int]:
        return {"calls": self._round}


def turn_seed(seed: int, episode: Episode) -> int:
    """The key seed of an episode's next turn: from the run's seed and the episode's identity and turn number only."""
    key = f"{seed}/{episode.agent}/{episode.question_index}/{episode.rollout}/{episode.invocation}/{len(episode.turns)}"
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def round_seed(seed: int, iteration: int, agent: str) -> int:
    """The key seed of one batched call: from the run's seed, the round (iteration) and the agent (its name, or
    the lock-step oracle's "top" / "sub")."""
    return zlib.crc32(f"{seed}/{iteration}/{agent}".encode()) & 0x7FFFFFFF
