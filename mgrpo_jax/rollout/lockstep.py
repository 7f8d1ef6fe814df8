"""The lock-step rollout engine: the oracle the decode-slot engine (`mgrpo_jax.rollout.engine.RolloutEngine`) is
tested and benchmarked against. Not used by the trainer.

Each iteration of its loop
  1. samples one turn for every top-level episode (main or single agent) that is not waiting on a delegation, in
     one `Sampler.sample` call, which prefills every row's whole episode and decodes until its longest row stops;
  2. runs the tools those turns call; a `delegate` call starts a sub-agent episode and parks its parent;
  3. samples one turn for every live sub-agent episode, in one call through the sub-agent's sampler, runs their
     tools, and hands each finished sub-agent's answer back to its parent as the tool response.

Its random numbers come from the iteration and the row's place in the batch; the turns' bookkeeping (budgets,
limits, tools, delegation) is the slot engine's own (`EngineCore`), so greedy runs of both give the same episodes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from mgrpo_jax.rollout.engine import AgentRuntime, EngineCore, round_seed
from mgrpo_jax.rollout.episode import Episode, RolloutBatch


class LockstepRolloutEngine(EngineCore):
    def run(self, questions: Sequence, rollouts: int, seed: int = 0, temperature: float | None = None) -> RolloutBatch:
        with self._running():
            return self._run(questions, rollouts, seed, temperature)

    def _run(self, questions: Sequence, rollouts: int, seed: int, temperature: float | None) -> RolloutBatch:
        timings = {"sampling_s": 0.0, "tools_s": 0.0}
        temperature = self.limits.temperature if temperature is None else float(temperature)
        top = self._top_episodes(questions, rollouts)
        live_subs: list[Episode] = []
        iteration = 0
        while True:
            ready = [e for row in top for e in row if not e.done and not self._waiting(e)]
            if not ready and not live_subs:
                break
            if ready:
                spawned = self._turn(self.top, ready, round_seed(seed, iteration, "top"), timings, temperature)
                if self.sub_executor is not None and spawned:
                    start = time.perf_counter()
                    for sub in self.sub_executor(spawned, questions):
                        self._return_to_parent(sub, top)
                    timings["remote_subs_s"] = timings.get("remote_subs_s", 0.0) + time.perf_counter() - start
                else:
                    live_subs.extend(spawned)
            if live_subs:
                self._turn(self.sub, live_subs, round_seed(seed, iteration, "sub"), timings, temperature)
                for sub in [s for s in live_subs if s.done]:
                    live_subs.remove(sub)
                    self._return_to_parent(sub, top)
            iteration += 1
        return RolloutBatch(list(questions), top, timings)

    def run_subs(self, subs: list[Episode], seed: int = 0, timings: dict | None = None,
                 temperature: float | None = None) -> dict:
        timings = {"sampling_s": 0.0, "tools_s": 0.0} if timings is None else timings
        temperature = self.limits.temperature if temperature is None else float(temperature)
        live, iteration = list(subs), 0
        with self._running():
            while live:
                self._turn(self.sub, live, round_seed(seed, iteration, "sub"), timings, temperature)
                live = [s for s in live if not s.done]
                iteration += 1
        return timings

    def _turn(self, agent: AgentRuntime, episodes: list[Episode], rng: int, timings: dict,
              temperature: float) -> list[Episode]:
        """One sampled turn for each episode; returns the sub-agent episodes the turns started."""
        active = [(e, turn) for e in episodes if (turn := self._prepare_turn(agent, e)) is not None]
        if not active:
            return []
        start = time.perf_counter()
        out = agent.sampler.sample([e.tokens + turn.prefix for e, turn in active], max_new=self.limits.max_turn_tokens,
                                   rng=rng, temperature=temperature, stop_tokens=(agent.tokenizer.end_of_turn_id,),
                                   budgets=[turn.budget for _, turn in active])
        timings["sampling_s"] += time.perf_counter() - start

        start = time.perf_counter()
        spawned = []
        for row, (episode, turn) in enumerate(active):
            n = int(out.lengths[row])
            spawned.extend(self._finish_turn(agent, episode, turn, out.tokens[row, :n], out.logprobs[row, :n],
                                             bool(out.stopped[row]), temperature))
        timings["tools_s"] += time.perf_counter() - start
        return spawned


__all__ = ["LockstepRolloutEngine"]
