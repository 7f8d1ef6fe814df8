"""The M-GRPO trainer: warm start, then RL steps of the whole system, with evaluation, checkpoints and logs.

    trainer = Trainer(config, workdir)
    trainer.run()          # resumes from the workdir's latest checkpoint if there is one

One RL step (DESIGN.md section 3): Q questions -> Q*K whole-system rollouts through the rollout engine ->
main rewards and advantages -> the main agent's rewards go to the shared store -> the sub-agent side reads
them back, computes R_S, aligns its sub-trajectories to D slots per rollout and computes pooled advantages
-> each agent's jitted train step on its own mesh -> new weights to the samplers -> metrics.

Modes: `mgrpo` (both train), `frozen_sub` (main trains, sub frozen), `single_agent` (one agent with the
sub-agent's tools and `reason`), `mgrpo_unsync` (the sub-agent trains from a FIFO of sub-trajectories popped
in fixed chunks and grouped without regard to query, as the authors' released code does).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import types
import zlib

import jax
import numpy as np

from mgrpo_jax.core import align, d_histogram, degenerate_groups, main_advantages, sub_advantages
from mgrpo_jax.env.benchmarks import load_gaia, load_webwalker, load_xbench
from mgrpo_jax.env.pipeline import question_iterator
from mgrpo_jax.env.prompts import MAIN, SINGLE, SUB
from mgrpo_jax.env.questions import filter_low_success
from mgrpo_jax.env.scoring import score_benchmark_answer, world_answer_correct
from mgrpo_jax.rollout import batches, rewards
from mgrpo_jax.store import open_store
from mgrpo_jax.train import system
from mgrpo_jax.train.checkpoint import Checkpointer, PreemptionGuard
from mgrpo_jax.train.metrics import MetricWriter, plot_curves
from mgrpo_jax.train.optim import make_optimizer
from mgrpo_jax.train.step import make_policy_step, make_sft_step

log = logging.getLogger(__name__)

# `temperature`: each row's sampling temperature, so the step's log-probs are those of the behaviour
# distribution (mgrpo_jax/train/step.py); every policy batch built here carries it.
TRAIN_KEYS = ("tokens", "positions", "attention_mask", "loss_mask", "old_logprobs", "advantages", "weights",
              "temperature")
SFT_KEYS = ("tokens", "positions", "attention_mask", "loss_mask", "weights")
EVAL_SETS = ("eval_gaia", "eval_xbench", "eval_webwalker")
BENCHMARK_LOADERS = {"gaia": load_gaia, "xbench": load_xbench, "webwalker": load_webwalker}


def _score_record(benchmark: str, prediction: str, gold: str) -> bool:
    # No LLM judge is configured offline: XBench / WebWalkerQA fall back to their exact-match paths.
    return score_benchmark_answer(benchmark, "", gold, prediction, judge=None)


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


class Trainer:
    agent_subset = None  # the agents this process builds (None: all); one side of the decoupled mode sets it

    def __init__(self, config, workdir: str):
        self.config = config
        # Orbax needs absolute checkpoint paths; a workdir given relative to the current directory is fine.
        self.workdir = workdir if "://" in workdir else os.path.abspath(workdir)
        workdir = self.workdir
        self.is_main_process = jax.process_index() == 0
        self.top_name = SINGLE if config.mode == "single_agent" else MAIN
        os.makedirs(workdir, exist_ok=True)
        start = time.perf_counter()
        self.env = system.build_environment(config)
        self.tokenizer = system.build_tokenizer(config, self.env, workdir)
        self.agents = system.build_agents(config, self.tokenizer, only=self.agent_subset)
        self.engine = system.build_engine(config, self.tokenizer, self.env, self.agents)
        self.store = open_store(config.store)
        self.writer = MetricWriter(workdir, enabled=self.is_main_process, total_steps=config.train.steps,
                                   console_keys=(f"{self.top_name}/reward", f"{self.top_name}/correct",
                                                 "sub/reward", "time/step_s"))
        self.checkpointer = Checkpointer(workdir, save_every=config.train.checkpoint_every)
        self.questions = self._training_questions()
        self.iterator = question_iterator(self.questions, batch_size=config.rollout.queries, seed=config.seed)
        self.step = 0
        self.warm_started = config.warmstart.steps == 0
        self._policy_steps: dict = {}
        self._fifo = self.store.fifo("sub_trajectories") if config.mode == "mgrpo_unsync" else None
        self._fifo_consumer = self._fifo.consumer("sub_trainer") if self._fifo else None
        log.info("built %s run (%s preset, mode %s) in %.1f s", config.benchmark, config.preset, config.mode,
                 time.perf_counter() - start)

    # -- data -------------------------------------------------------------------------------------------

    def _training_questions(self):
        questions = list(self.env.questions.split(self.config.stage))
        kept = self._load_curriculum()
        if kept is not None:
            by_id = {q.id: q for q in questions}
            questions = [by_id[i] for i in kept]
        return questions

    def _curriculum_path(self) -> str:
        return os.path.join(self.workdir, "curriculum.json")

    def _load_curriculum(self) -> list[str] | None:
        path = self._curriculum_path()
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)["kept"]

    def filter_curriculum(self) -> dict:
        """Stage 2 keeps the questions the starting system solves at most `env.stage2_max_success` of the
        time (the paper filters stage-2 data by the stage-1 model's success), estimated from
        `env.stage2_filter_samples` rollouts of each of the first `env.stage2_filter_pool` questions. The kept
        ids go to `workdir/curriculum.json`, so a resumed run serves the same questions."""
        env_cfg = self.config.env
        pool = list(self.env.questions.split(self.config.stage))
        pool = pool[: env_cfg.stage2_filter_pool or None]
        samples = env_cfg.stage2_filter_samples
        result = self.engine.run(pool, samples, seed=_seed(self.config.seed, "curriculum"))
        rates = {q.id: 0.0 for q in pool}
        for row in result.top:
            for episode in row:
                question = pool[episode.question_index]
                solved = episode.answer is not None and world_answer_correct(episode.answer, question.answer)
                rates[question.id] += float(solved) / samples
        kept = filter_low_success(pool, lambda q: rates[q.id], env_cfg.stage2_max_success)
        if len(kept) < self.config.rollout.queries:
            raise ValueError(
                f"stage-2 curriculum: {len(kept)} of {len(pool)} questions have success <= "
                f"env.stage2_max_success={env_cfg.stage2_max_success}, fewer than rollout.queries="
                f"{self.config.rollout.queries}; raise the threshold or env.stage2_filter_pool")
        summary = {"pool": len(pool), "kept": [q.id for q in kept], "samples": samples,
                   "max_success": env_cfg.stage2_max_success, "mean_success": float(np.mean(list(rates.values())))}
        if self.is_main_process:
            with open(self._curriculum_path(), "w") as f:
                json.dump(summary, f)
        self.questions = kept
        self.iterator = question_iterator(kept, batch_size=self.config.rollout.queries, seed=self.config.seed)
        log.info("stage-2 curriculum: kept %d of %d questions (mean success %.3f)", len(kept), len(pool),
                 summary["mean_success"])
        return summary

    def init_from_checkpoint(self, path: str) -> int:
        """Starts this run from another run's latest checkpoint (stage 2 from stage 1): every agent of this run
        takes its parameters from there, with a fresh optimizer and no warm start. Returns the source step."""
        source_dir = path if "://" in path else os.path.abspath(path)
        source = Checkpointer(source_dir)
        step = source.latest_step()
        if step is None:
            raise FileNotFoundError(f"config.init_checkpoint={path!r}: no checkpoint under {source_dir}/checkpoints")
        try:
            states, _ = source.restore({name: agent.state for name, agent in self.agents.items()}, step=step)
        except (KeyError, ValueError, FileNotFoundError) as e:
            raise ValueError(f"config.init_checkpoint={path!r} (step {step}) does not hold agents "
                             f"{sorted(self.agents)} with this run's shapes: {e}") from e
        finally:
            source.close()
        for name, agent in self.agents.items():
            agent.state = states[name]
            agent.reset_optimizer(agent.config.optim)
        self.warm_started = True
        log.info("initialised %s from %s (step %d)", sorted(self.agents), path, step)
        return step

    def _top_tools(self):
        return self.engine.top.tool_names

    def _sub_tools(self):
        return self.engine.sub.tool_names if self.engine.sub else None

    # -- warm start -------------------------------------------------------------------------------------

    def demonstrations(self, agent: str, count: int, seed: int):
        """Rendered (ids, mask) expert episodes for one agent, from stage-1 and stage-2 training questions."""
        experts = self.env.experts(system.noise_config(self.config))
        pool = list(self.env.questions.stage1) + list(self.env.questions.stage2)
        order = np.random.default_rng(seed).permutation(len(pool))
        examples = []
        for i in order:
            question = pool[int(i)]
            if agent == SINGLE:
                episodes = [experts.single_agent(question).top]
            else:
                transcript = experts.main_agent(question)
                episodes = [transcript.top] if agent == MAIN else list(transcript.subs)
            for episode in episodes:
                examples.append(self.tokenizer.render_chat(episode.as_chat()))
            if len(examples) >= count:
                break
        return examples[:count]

    def warm_start(self, guard: PreemptionGuard | None = None) -> bool:
        """Supervised cloning of the scripted experts' transcripts, then a fresh RL optimizer per agent.

        Each agent trains for up to its `warmstart_steps` (or `warmstart.steps`). With `warmstart.check_every` > 0
        the agents train in rounds of that many steps, and after each round greedy decoding runs on
        `warmstart.format_questions` training questions: an agent that has trained `warmstart.min_steps` and keeps
        the protocol on at least `warmstart.format_target` of its episodes stops (logged as
        `warmstart/<agent>/format_ok`, with the system's greedy `warmstart/<agent>/correct`). RL should start from
        agents that keep the format; otherwise their rewards are all zero and RL has nothing to work with. The
        format comes long before the content (copying names and values), hence the minimum.

        Returns False when preempted: the warm start is short, so a resumed run simply starts it again.
        """
        cfg = self.config.warmstart
        clones = {}
        for name, agent in self.agents.items():
            steps = agent.config.warmstart_steps or cfg.steps
            sft_cfg = agent.config.sft.copy_and_resolve_references()
            sft_cfg.total_steps = sft_cfg.total_steps or steps  # decay over the whole warm start
            agent.reset_optimizer(sft_cfg)
            clones[name] = types.SimpleNamespace(
                steps=steps, done=0, losses=[], start=time.perf_counter(),
                examples=self.demonstrations(name, cfg.examples, _seed(self.config.seed, "demos", name)),
                step=make_sft_step(agent.graphdef, make_optimizer(sft_cfg), agent.sharding, agent.mesh),
                rng=np.random.default_rng(_seed(self.config.seed, "sft", name)))
        active = [name for name in self.agents if clones[name].steps > 0]
        while active:
            for name in active:
                clone, agent = clones[name], self.agents[name]
                for _ in range(min(cfg.check_every or clone.steps, clone.steps - clone.done)):
                    if guard is not None and guard.should_stop():
                        log.warning("preempted during the warm start of %s; it restarts when the run resumes", name)
                        return False
                    rows = [clone.examples[j] for j in clone.rng.choice(len(clone.examples), cfg.batch_size,
                                                                        replace=False)]
                    length = batches.bucket_length([len(ids) for ids, _ in rows], agent.config.context_tokens)
                    batch = batches.sft_rows(rows, length, self.tokenizer.pad_id)
                    agent.state, metrics = clone.step(agent.state, {k: batch[k] for k in SFT_KEYS})
                    clone.losses.append(float(metrics["loss"]))
                    if clone.done % 25 == 0 or clone.done == clone.steps - 1:
                        self.writer.write(clone.done, {f"warmstart/{name}/loss": clone.losses[-1]},
                                          prefix_step="warmstart")
                    clone.done += 1
                agent.publish()
            finished = [name for name in active if clones[name].done >= clones[name].steps]
            if cfg.check_every and self.agent_subset is None:  # the check needs every agent of the system
                rates, correct = self.greedy_format()
                for name in active:
                    self.writer.write(clones[name].done, {f"warmstart/{name}/format_ok": rates[name],
                                                          f"warmstart/{name}/correct": correct},
                                      prefix_step="warmstart")
                    log.info("warm start %s: step %d, loss %.3f, greedy format %.2f (system correct %.2f)", name,
                             clones[name].done, clones[name].losses[-1], rates[name], correct)
                finished += [name for name in active
                             if rates[name] >= cfg.format_target and clones[name].done >= cfg.min_steps]
            active = [name for name in active if name not in finished]
        for name, agent in self.agents.items():
            clone = clones[name]
            agent.reset_optimizer(agent.config.optim)
            log.info("warm start %s: %d steps, loss %.3f -> %.3f (%.1f s)", name, clone.done,
                     clone.losses[0] if clone.losses else float("nan"),
                     clone.losses[-1] if clone.losses else float("nan"), time.perf_counter() - clone.start)
        self.warm_started = True
        return True

    def greedy_format(self) -> tuple[dict[str, float], float]:
        """({agent: share of its greedy episodes that keep the protocol}, share of correct final answers) on
        `warmstart.format_questions` training questions (the first ones of stage 1 and of stage 2, half each)."""
        count = self.config.warmstart.format_questions
        pool = list(self.env.questions.stage1[: count - count // 2]) + list(self.env.questions.stage2[: count // 2])
        result = self.engine.run(pool, 1, seed=_seed(self.config.seed, "format"), temperature=0.0)
        grammar = self.engine.grammar
        shares = {}
        for name in self.agents:
            episodes = list(result.episodes(name))
            tools = self._sub_tools() if name == SUB else self._top_tools()
            shares[name] = float(np.mean([rewards.episode_format_ok(e.turns, tools, grammar) for e in episodes])
                                 if episodes else 0.0)
        correct = [float(e.answer is not None and world_answer_correct(e.answer, pool[e.question_index].answer))
                   for row in result.top for e in row]
        return shares, float(np.mean(correct))

    # -- one RL step ------------------------------------------------------------------------------------

    def _policy_step(self, agent):
        """The agent's jitted policy step, built once; its log-probs use the top-k / top-p of the agent's
        sampler (the filters the behaviour log-probs were recorded under; temperatures come per row)."""
        if agent.name not in self._policy_steps:
            self._policy_steps[agent.name] = make_policy_step(
                agent.graphdef, make_optimizer(agent.config.optim), agent.config.loss, dict(agent.config.loss_hparams),
                agent.sharding, agent.mesh, micro_batches=agent.config.micro_batches,
                top_k=agent.sampler.top_k, top_p=agent.sampler.top_p)
        return self._policy_steps[agent.name]

    def _train(self, agent, batches) -> dict:
        """`passes` updates on each batch in turn (a dict, or a list of dicts: the unsynchronised sub-agent's
        FIFO chunks, oldest first), then new weights to the sampler. Logged: each batch's last-pass metrics,
        combined over batches (`*_min` / `*_max` by min / max, `tokens` summed, the rest averaged), as
        `<agent>/train/<key>`."""
        batches = [batches] if isinstance(batches, dict) else list(batches)
        if not batches:
            return {}
        step = self._policy_step(agent)
        per_batch = []
        for batch in batches:
            train_batch = {k: batch[k] for k in TRAIN_KEYS}
            metrics = {}
            for _ in range(agent.config.passes):
                agent.state, metrics = step(agent.state, train_batch)
            per_batch.append(metrics)
        agent.publish()
        per_batch = jax.device_get(per_batch)
        out = {}
        for k in per_batch[-1]:
            values = [float(m[k]) for m in per_batch]
            if k.endswith("_min"):
                out[k] = min(values)
            elif k.endswith("_max"):
                out[k] = max(values)
            elif k == "tokens":
                out[k] = sum(values)
            else:
                out[k] = values[0] if len(values) == 1 else float(np.mean(values))
        return {f"{agent.name}/train/{k}": v for k, v in out.items()}

    def rl_step(self) -> dict:
        cfg = self.config
        timings = {}
        t0 = time.perf_counter()
        questions = next(self.iterator)
        rollout = self.engine.run(questions, cfg.rollout.samples, seed=_seed(cfg.seed, "rollout", self.step))
        timings.update(rollout.timings)
        self.log_transcripts(rollout)
        t1 = time.perf_counter()

        inputs = rewards.reward_inputs(rollout, world_answer_correct, self.env.judge.score, self._top_tools(),
                                       self._sub_tools(), self.engine.grammar)
        main_r = rewards.main_rewards(inputs, tuple(cfg.rewards.alpha))
        adv_kw = dict(scale=cfg.advantages.scale, baseline=cfg.advantages.baseline, eps=cfg.advantages.eps)
        main_adv = np.asarray(main_advantages(main_r, **adv_kw))
        metrics = {
            f"{self.top_name}/reward": float(main_r.mean()),
            f"{self.top_name}/correct": float(inputs.correct.mean()),
            f"{self.top_name}/format_ok": float(inputs.format_ok.mean()),
            f"{self.top_name}/zero_std_groups": float(np.sum(degenerate_groups(main_r, np.ones_like(main_r)))),
        }
        metrics.update(rollout.stats())
        top_agent = self.agents[self.top_name]
        top_len = batches.bucket_length([len(e.tokens) for row in rollout.top for e in row],
                                        top_agent.config.context_tokens)
        top_rows = batches.top_batch(rollout.top, main_adv, top_len, self.tokenizer.pad_id,
                                     temperature=cfg.rollout.temperature)

        sub_rows = []
        if self.top_name == MAIN:
            # The main side publishes its rewards; the sub side reads them back (the decoupled data path).
            writer = self.store.step_writer(self.step, MAIN, int(top_agent.state.step))
            writer.put_array("main_correct", inputs.correct)
            writer.put_array("main_reward", main_r)
            writer.put_array("sub_counts", rollout.sub_counts())
            writer.commit()
        if SUB in self.agents:
            view = self.store.wait_step(self.step, MAIN, timeout_s=60)
            main_correct = view.array("main_correct")
            counts = view.array("sub_counts")
            sub_metrics, sub_rows = self._sub_side(rollout, inputs, main_correct, counts, adv_kw)
            metrics.update(sub_metrics)
        timings["rewards_s"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        metrics.update(self._train(top_agent, top_rows))
        sub_agent = self.agents.get(SUB)
        if sub_rows and sub_agent is not None and sub_agent.trainable:
            metrics.update(self._train(sub_agent, sub_rows))
        timings["training_s"] = time.perf_counter() - t2
        timings["step_s"] = time.perf_counter() - t0
        timings["other_s"] = timings["step_s"] - sum(timings[k] for k in ("sampling_s", "tools_s", "rewards_s",
                                                                          "training_s"))
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        episodes = sum(1 for _ in rollout.episodes())
        metrics["throughput/episodes_per_s"] = episodes / timings["step_s"]
        metrics["throughput/generated_tokens_per_s"] = sum(e.generated_tokens for e in rollout.episodes()) / timings[
            "step_s"]
        self.store.gc(keep_last=4)
        return metrics

    def _sub_side(self, rollout, inputs, main_correct, counts, adv_kw, versions=None) -> tuple[dict, list[dict]]:
        """The sub-agent's rewards, alignment and advantages: (metrics, its train batches: none, the aligned
        Q*K*D rows, or in `mgrpo_unsync` the FIFO chunks popped this step). `versions`: the sub policy version
        that sampled each (query, rollout, invocation) (default: the current one, as in the colocated run)."""
        cfg = self.config
        d = cfg.rollout.d_max
        out = {}
        hist = d_histogram(counts, max_bin=max(d * 2, 1))
        out.update({f"d_k/hist/{i}": int(c) for i, c in enumerate(hist)})
        if counts.max() > 0:  # `sub/reward` over the aligned slots, in every two-agent mode
            index, weight = align(counts, d, jax.random.key(_seed(cfg.seed, "align", self.step)),
                                  mode=cfg.rollout.align_mode)
            index, weight = np.asarray(index), np.asarray(weight)
            sub_r = rewards.aligned_sub_rewards(inputs, main_correct, index, weight, tuple(cfg.rewards.beta))
            valid = weight > 0
            out["sub/reward"] = float(sub_r[valid].mean()) if valid.any() else 0.0
            out["sub/expert"] = float(np.mean([x for q in inputs.sub_expert for k in q for x in k] or [0.0]))
            out["sub/format_ok"] = float(np.mean([x for q in inputs.sub_format_ok for k in q for x in k] or [0.0]))
        else:
            out["sub/reward"] = 0.0
        if cfg.mode == "mgrpo_unsync":  # pops the chunks waiting even when this step delegated nothing
            return out, self._unsync_rows(rollout, inputs, main_correct, adv_kw, out, versions)
        if counts.max() == 0:
            return out, []
        seq_len = batches.bucket_length([len(s.tokens) for row in rollout.top for e in row for s in e.subs],
                                        self.agents[SUB].config.context_tokens)
        sub_adv = np.asarray(sub_advantages(sub_r, weight, **adv_kw))
        out["sub/zero_std_groups"] = float(np.asarray(degenerate_groups(
            sub_r.reshape(sub_r.shape[0], -1), weight.reshape(weight.shape[0], -1))).sum())
        return out, [batches.sub_batch(rollout.top, index, weight, sub_adv, seq_len, self.tokenizer.pad_id,
                                       temperature=cfg.rollout.temperature)]

    def _unsync_rows(self, rollout, inputs, main_correct, adv_kw, out, versions=None) -> list[dict]:
        """mgrpo_unsync: push every real sub-trajectory of this step (no alignment) to the FIFO in a seeded
        random order, pop every full `unsync_chunk` waiting, z-score each chunk's arrival groups of
        `rollout.samples` records (mgrpo_jax/train/unsync.py says why). Returns the chunks' batches, oldest
        first; logs `sub/staleness`, `sub/fifo_backlog` and the push / pop counts into `out`."""
        from mgrpo_jax.train import unsync

        cfg = self.config
        agent = self.agents[SUB]
        version = int(agent.state.step)
        records = unsync.step_records(rollout, inputs, main_correct, tuple(cfg.rewards.beta), self.step,
                                      version if versions is None else versions, cfg.rollout.temperature)
        chunks, metrics = unsync.unsync_step(
            self._fifo, self._fifo_consumer, records, chunk=cfg.rollout.unsync_chunk, group=cfg.rollout.samples,
            seed=_seed(cfg.seed, "unsync", self.step), start_version=version, passes=agent.config.passes,
            seq_len_limit=agent.config.context_tokens, pad_id=self.tokenizer.pad_id, adv_kw=adv_kw)
        out.update(metrics)
        return chunks

    # -- evaluation -------------------------------------------------------------------------------------

    def evaluation_sets(self) -> dict:
        """{name: (questions, scorer)}: the offline world's three held-out sets, plus the real benchmark's
        records when `config.env.benchmark_path` names its files (scored by that benchmark's own rule)."""
        limit = self.config.train.eval_questions or None
        sets = {name: (list(self.env.questions.split(name))[:limit], world_answer_correct) for name in EVAL_SETS}
        path = self.config.env.benchmark_path
        if path:
            benchmark = self.config.benchmark
            records = [r for r in BENCHMARK_LOADERS[benchmark](path) if r.answer is not None][:limit]
            questions = [types.SimpleNamespace(text=r.question, answer=r.answer, id=r.id) for r in records]
            scorer = functools.partial(_score_record, benchmark)
            sets[f"{benchmark}_file"] = (questions, scorer)
        return sets

    def evaluate(self) -> dict:
        """avg@runs accuracy on each evaluation set (sampled at the rollout temperature)."""
        cfg = self.config.train
        out = {}
        for name, (questions, scorer) in self.evaluation_sets().items():
            if not questions:  # a world too small to draw this set
                log.warning("evaluation set %s is empty; skipped", name)
                continue
            result = self.engine.run(questions, cfg.eval_runs, seed=_seed(self.config.seed, "eval", self.step, name))
            correct = [
                float(e.answer is not None and scorer(e.answer, questions[e.question_index].answer))
                for e in (ep for row in result.top for ep in row)
            ]
            out[f"eval/{name}/accuracy"] = float(np.mean(correct))
        return out

    def log_transcripts(self, rollout) -> None:
        """A few whole-system rollouts as text (main turns, delegated tasks, sub-agent answers) for inspection."""
        count = self.config.train.log_transcripts
        if not count or not self.is_main_process:
            return
        path = os.path.join(self.workdir, "transcripts.jsonl")
        with open(path, "a") as f:
            for episode in [e for row in rollout.top for e in row][:count]:
                record = {"step": self.step, "question": rollout.questions[episode.question_index].text,
                          "gold": rollout.questions[episode.question_index].answer, "answer": episode.answer,
                          "end_reason": episode.end_reason, "turns": episode.turns,
                          "delegations": [{"task": s.task, "answer": s.answer, "end_reason": s.end_reason,
                                           "turns": s.turns} for s in episode.subs]}
                f.write(json.dumps(record) + "\n")

    # -- state ------------------------------------------------------------------------------------------

    def host_state(self) -> dict:
        return {"step": self.step, "iterator": self.iterator.get_state(), "warm_started": self.warm_started,
                "fifo_offset": self._fifo_consumer.offset if self._fifo_consumer else 0}

    def save(self, force: bool = False) -> None:
        states = {name: agent.state for name, agent in self.agents.items()}
        self.checkpointer.save(self.step, states, self.host_state(), force=force)

    def restore(self) -> bool:
        if self.checkpointer.latest_step() is None:
            return False
        # The current states are the restore targets: their shapes and shardings place the restored arrays.
        states, host = self.checkpointer.restore({name: agent.state for name, agent in self.agents.items()})
        for name, agent in self.agents.items():
            agent.state = states[name]
            agent.publish()
        self.step = int(host["step"])
        self.iterator.set_state(host["iterator"])
        self.warm_started = bool(host["warm_started"])
        if self._fifo_consumer is not None:
            self._fifo_consumer.seek(int(host.get("fifo_offset", 0)))
        self.writer.truncate_after(self.step)
        log.info("resumed from step %d", self.step)
        return True

    # -- the run ----------------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg = self.config
        summary = {}
        with PreemptionGuard() as guard:
            resumed = self.restore()
            if not resumed:
                if cfg.init_checkpoint:
                    self.init_from_checkpoint(cfg.init_checkpoint)
                elif not self.warm_started and not self.warm_start(guard):
                    return {}
                if cfg.stage == "stage2" and cfg.env.stage2_max_success < 1:
                    self.filter_curriculum()
                if cfg.train.eval_at_start:
                    self.writer.write(0, self.evaluate())  # the starting point of the accuracy curves
                self.save(force=True)
            while self.step < cfg.train.steps:
                metrics = self.rl_step()
                self.step += 1
                if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                    metrics.update(self.evaluate())
                self.writer.write(self.step, metrics)
                summary = metrics
                log.info("step %d | %s reward %.3f correct %.2f | %.1f s", self.step, self.top_name,
                         metrics[f"{self.top_name}/reward"], metrics[f"{self.top_name}/correct"],
                         metrics["time/step_s"])
                stop = guard.should_stop()
                self.save(force=stop or self.step == cfg.train.steps)
                if stop:
                    log.warning("preempted at step %d: checkpoint written, exiting", self.step)
                    break
        self.checkpointer.wait()
        if self.is_main_process:
            if self.step > 0:  # a warm-start-only run (train.steps = 0) has no reward curve
                plot_curves(self.writer.jsonl_path, [f"{self.top_name}/reward", "sub/reward"],
                            os.path.join(self.workdir, "rewards.png"))
            with open(os.path.join(self.workdir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=1, sort_keys=True)
        return summary
