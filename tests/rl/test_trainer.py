"""End to end: the `smoke` preset runs warm start, RL steps of both agents, evaluation and checkpoints;
an interrupted and resumed run continues with exactly the metrics of an uninterrupted one."""

import json
import os

import jax
import numpy as np
import pytest

from mgrpo_jax.config import get_config
from mgrpo_jax.core import mgrpo_targets
from mgrpo_jax.env.build import reward_judge
from mgrpo_jax.rl import system
from mgrpo_jax.rl.exchange import MainStep
from mgrpo_jax.rl.trainer import Trainer
from mgrpo_jax.rollout import batches
from mgrpo_jax.rollout.judging import rollout_arrays
from mgrpo_jax.runtime.metrics import read_jsonl

DETERMINISTIC_KEYS = ("main/reward", "main/correct", "main/format_ok", "main/generated_tokens", "sub/reward",
                      "main/train/loss", "sub/train/loss")


def _smoke(mode="mgrpo", steps=2):
    config = get_config("xbench", f"smoke,{mode}")
    config.train.steps = steps
    return config


def _rl_records(workdir):
    return [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "step" in r]


@pytest.mark.slow
def test_smoke_preset_runs_end_to_end(tmp_path):
    config = _smoke()
    config.main.decode_phases = 3  # the main agent samples in phases (same tokens as one loop)
    trainer = Trainer(config, str(tmp_path))
    assert (trainer.agents["main"].sampler.decode_phases, trainer.agents["sub"].sampler.decode_phases) == (3, 1)
    summary = trainer.run()
    records = _rl_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    for key in ("main/reward", "sub/reward", "main/train/loss", "time/sampling_s", "eval/eval_gaia/accuracy"):
        assert key in summary, key
    assert 0.0 <= summary["main/reward"] <= 1.0
    assert (tmp_path / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "summary.json").read_text())["main/reward"] == summary["main/reward"]
    assert (tmp_path / "checkpoints").is_dir() and (tmp_path / "tokenizer.model").is_file()
    run = json.loads((tmp_path / "summary.json").read_text())["run"]  # the run-level record
    assert (run["status"], run["step"], run["mode"], run["config"]["train"]["steps"]) == ("finished", 2, "mgrpo", 2)
    assert run["wall_time_s"] > 0 and run["best"]["main/reward"]["step"] in (1, 2)
    assert {"metrics.jsonl", "tb", "rewards.png", "checkpoints", "summary.json"} <= set(run["files"])
    rows = read_jsonl(tmp_path / "metrics.jsonl")  # warm-start rows first: every row names the world and pool
    assert "warmstart_step" in rows[0] and all(r["env/seed"] == 0 and len(r["env/pool_hash"]) == 16 for r in rows)


@pytest.mark.slow
def test_resumed_run_reproduces_the_uninterrupted_metrics(tmp_path):
    straight = tmp_path / "straight"
    Trainer(_smoke(steps=3), str(straight)).run()
    interrupted = tmp_path / "interrupted"
    Trainer(_smoke(steps=1), str(interrupted)).run()  # stops after step 1 with a checkpoint
    Trainer(_smoke(steps=3), str(interrupted)).run()  # a new process would do the same: resume at step 1
    a, b = _rl_records(straight), _rl_records(interrupted)
    assert [r["step"] for r in b] == [1, 2, 3]
    # Running a finished run again changes nothing and says so.
    before = (straight / "summary.json").read_text()
    again = Trainer(_smoke(steps=3), str(straight))
    assert again.run() == {k: v for k, v in json.loads(before).items() if k != "run"}
    assert again.status == "finished" and (straight / "summary.json").read_text() == before
    for ra, rb in zip(a, b, strict=True):
        for key in DETERMINISTIC_KEYS:
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (ra["step"], key)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["frozen_sub", "single_agent", "mgrpo_unsync"])
def test_other_training_modes_run(tmp_path, mode):
    config = _smoke(mode, steps=2)
    config.train.eval_every = 0
    summary = Trainer(config, str(tmp_path)).run()
    top = "single" if mode == "single_agent" else "main"
    assert f"{top}/reward" in summary
    if mode == "frozen_sub":
        assert "sub/train/loss" not in summary and "main/train/loss" in summary


@pytest.mark.slow
def test_real_benchmark_files_are_evaluated_and_transcripts_logged(tmp_path):
    # Two invented records in GAIA's metadata.jsonl schema (never real benchmark text).
    folder = tmp_path / "gaia" / "2023" / "validation"
    folder.mkdir(parents=True)
    records = [{"task_id": f"00000000-0000-0000-0000-00000000000{i}", "Question": f"What is {i} plus {i}?",
                "Level": 1, "Final answer": str(2 * i), "file_name": "",
                "Annotator Metadata": {"Steps": "add", "Number of steps": "1"}} for i in (1, 2)]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = get_config("gaia", "smoke")
    config.env.benchmark_path = str(folder)
    trainer = Trainer(config, str(tmp_path / "run"))
    metrics = trainer.evaluate()
    assert 0.0 <= metrics["eval/gaia_file/accuracy"] <= 1.0
    assert {"eval/eval_gaia/accuracy", "eval/eval_xbench/accuracy", "eval/eval_webwalker/accuracy"} <= set(metrics)
    trainer.rl_step()
    lines = (tmp_path / "run" / "transcripts.jsonl").read_text().splitlines()
    assert len(lines) == config.train.log_transcripts
    assert {"question", "gold", "turns", "delegations", "end_reason"} <= set(json.loads(lines[0]))


@pytest.mark.slow
def test_stage2_starts_from_the_stage1_checkpoint_with_a_filtered_curriculum(tmp_path):
    stage1 = tmp_path / "stage1"
    Trainer(_smoke(steps=1), str(stage1)).run()
    config = _smoke(steps=1)
    config.stage = "stage2"
    config.init_checkpoint = str(stage1)
    config.env.stage2_filter_pool = 6
    config.env.stage2_filter_samples = 1
    config.env.stage2_max_success = 1.0 - 1e-9  # keeps the questions the stage-1 system did not solve
    config.train.eval_every = 0
    config.train.eval_at_start = True
    trainer = Trainer(config, str(tmp_path / "stage2"))
    trainer.init_from_checkpoint(config.init_checkpoint)
    source = Trainer(_smoke(steps=1), str(stage1))
    source.restore()
    for name, agent in trainer.agents.items():
        for a, b in zip(jax.tree.leaves(agent.state.params), jax.tree.leaves(source.agents[name].state.params),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert int(agent.state.step) == 0  # a fresh RL optimizer
    assert (tmp_path / "stage2" / "tokenizer.model").read_bytes() == (stage1 / "tokenizer.model").read_bytes()

    trainer.run()
    curriculum = json.loads((tmp_path / "stage2" / "curriculum.json").read_text())
    assert curriculum["pool"] == 6 and curriculum["samples"] == 1
    stage2_ids = {q.id for q in trainer.env.questions.stage2}
    assert set(curriculum["kept"]) <= stage2_ids and len(curriculum["kept"]) >= config.rollout.queries
    records = read_jsonl(tmp_path / "stage2" / "metrics.jsonl")
    assert not any("warmstart_step" in r for r in records)  # no warm start: the stage-1 weights are the start
    assert [r["step"] for r in records if "step" in r] == [0, 1]
    assert "eval/eval_gaia/accuracy" in records[0]
    # Every row and the summary record the world and the served pool, as curriculum.json does.
    assert curriculum["world_seed"] == config.env.seed == 0 and curriculum["twins"] == [0]  # the chat world
    assert curriculum["pool_hash"] == trainer.feed.pool_hash
    assert all((r["env/seed"], r["env/pool_hash"]) == (0, curriculum["pool_hash"]) for r in records)
    summary = json.loads((tmp_path / "stage2" / "summary.json").read_text())
    assert (summary["env/seed"], summary["env/pool_hash"]) == (0, curriculum["pool_hash"])
    resumed = Trainer(config, str(tmp_path / "stage2"))  # a resumed run serves the same filtered questions
    assert [q.id for q in resumed.feed.questions] == curriculum["kept"]


def test_init_checkpoint_without_a_checkpoint_is_a_clear_error(tmp_path):
    config = _smoke(steps=1)
    config.init_checkpoint = str(tmp_path / "nothing")
    trainer = Trainer(config, str(tmp_path / "run"))
    with pytest.raises(FileNotFoundError, match="config.init_checkpoint=.*no checkpoint"):
        trainer.init_from_checkpoint(config.init_checkpoint)


def _compact(mode="mgrpo", steps=2):
    """The `local` preset's compact system, shrunk to seconds: a small world, a few warm-start steps, 2 RL steps."""
    config = get_config("xbench", f"local,{mode}")
    config.env.compact.n_names, config.env.compact.n_orgs = 40, 10
    config.env.sizes.stage1 = config.env.sizes.stage2 = 60
    for split in ("validation", "eval_gaia", "eval_xbench", "eval_webwalker"):
        config.env.sizes[split] = 8
    config.rollout.queries, config.rollout.samples, config.rollout.d_max = 2, 4, 2
    config.warmstart.steps, config.warmstart.batch_size, config.warmstart.examples = 4, 8, 64
    config.warmstart.check_every, config.warmstart.format_questions = 2, 4
    config.train.steps, config.train.eval_every, config.train.eval_questions = steps, steps, 4
    for agent in (config.main, config.sub, config.single):
        agent.model_overrides.d_model, agent.model_overrides.n_layers = 32, 1
    return config


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mgrpo", "single_agent"])
def test_compact_system_runs_end_to_end(tmp_path, mode):
    """The compact grammar through the whole loop: word tokenizer, warm start with greedy format checks (logged), RL
    steps whose format gate and rewards use the compact grammar, evaluation."""
    summary = Trainer(_compact(mode), str(tmp_path)).run()
    top = "single" if mode == "single_agent" else "main"
    records = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    checks = [r for r in records if f"warmstart/{top}/format_ok" in r]
    assert [r["warmstart_step"] for r in checks] == [2, 4]  # format below target: runs to its step cap
    assert all(0.0 <= r[f"warmstart/{top}/format_ok"] <= 1.0 for r in checks)
    assert 0.0 <= summary[f"{top}/reward"] <= 1.0 and "eval/eval_xbench/accuracy" in summary
    lines = [json.loads(line) for line in (tmp_path / "transcripts.jsonl").read_text().splitlines()]
    assert lines and all(isinstance(t, str) for line in lines for t in line["turns"])


def test_a_temperature_override_travels_with_the_episodes_and_trains_at_ratio_one(tmp_path):
    """`engine.run(temperature=0.7)` on a config sampling at 1: the episodes record 0.7, the sides' batches take it
    from there, and both agents' updates on them are on-policy (every importance ratio 1)."""
    config = _smoke(steps=1)
    config.warmstart.steps = 0
    assert config.rollout.temperature == 1.0
    trainer = Trainer(config, str(tmp_path))
    questions = next(trainer.feed.iterator)
    rollout = trainer.engine.run(questions, config.rollout.samples, seed=3, temperature=0.7)
    assert {e.temperature for e in rollout.episodes()} == {0.7}
    # The main side's rows and update, from the override's rollout and its judges' arrays.
    judge = reward_judge(config, trainer.env)
    arrays = rollout_arrays(rollout, judge, trainer.engine.top.tool_names, trainer.engine.sub.tool_names,
                            trainer.engine.grammar, calls=config.rollout.max_sub_calls)
    targets = jax.device_get(mgrpo_targets(arrays, jax.random.key(0), trainer.targets_config))
    stats = {k: float(v) for k, v in targets.stats.items()}
    _, rows = trainer.main.rows(MainStep(rollout, arrays, {}), targets, stats, 0)
    np.testing.assert_allclose(rows["temperature"], 0.7)
    metrics = trainer.main.update(rows)
    assert metrics["main/train/ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["main/train/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    # The sub-agent's rows the same way (the untrained main agent seldom delegates: sub-episodes of their own).
    subs = [trainer.engine.start_sub(f"task {i}", question_index=0, rollout=i, invocation=0) for i in range(4)]
    trainer.engine.run_subs(subs, seed=5, temperature=0.7)
    sub = trainer.agents["sub"]
    sub_rows = batches.top_batch([subs], np.linspace(-1, 1, 4), sub.config.context_tokens, sub.tokenizer.pad_id)
    np.testing.assert_allclose(sub_rows["temperature"], 0.7)
    metrics = sub.train(sub_rows)
    assert metrics["sub/train/ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["sub/train/ratio_max"] == pytest.approx(1.0, abs=1e-5)


def test_a_blind_evaluation_runs_the_same_agents_with_every_tool_answering_none(tmp_path):
    config = _compact(steps=1)
    config.train.eval_sets = "eval_gaia,validation,fresh"
    config.env.sizes.fresh = 8
    config.train.eval_blind = True
    trainer = Trainer(config, str(tmp_path))
    blind = system.build_engine(config, trainer.tokenizer, trainer.env, trainer.agents, blind=True)
    assert blind.top.sampler is trainer.engine.top.sampler and blind.sub.sampler is trainer.engine.sub.sampler
    for runtime in (blind.top, blind.sub):
        assert runtime.tools  # the same tools, every one blind
        assert set(runtime.tools) == set(trainer.engine.top.tools if runtime is blind.top else
                                         trainer.engine.sub.tools)
        for tool in runtime.tools.values():
            assert tool({"query": "age Varn", "url": "r1", "problem": "max 10 20"}, {}) == "none"
    metrics = trainer.evaluate()
    assert set(metrics) == {f"{prefix}/{name}/accuracy" for prefix in ("eval", "eval_blind")
                            for name in ("eval_gaia", "validation", "fresh")}


def test_an_rl_step_posed_in_a_counterfactual_twin_is_rewarded_by_the_twins_answers(tmp_path):
    config = _compact(steps=1)
    config.rollout.counterfactual_share = 1.0
    trainer = Trainer(config, str(tmp_path))
    questions = list(trainer.env.questions.stage1[:2])
    collected = trainer.main.collect(3, questions)
    twin = collected.metrics["counterfactual/twin"]
    assert 1 <= twin <= 64
    world = trainer.env.twins.twin(twin)
    assert [q.text for q in collected.rollout.questions] == [q.text for q in questions]
    assert [q.answer for q in collected.rollout.questions] == [world.lookup(*q.text.split()) for q in questions]
    assert trainer.env.twins.current is trainer.env.world  # evaluation and the next step see the world again
    assert trainer.main.collect(3, questions).metrics["counterfactual/twin"] == twin  # seeded per step
    config.rollout.counterfactual_share = 0.0
    assert "counterfactual/twin" not in trainer.main.collect(3, questions).metrics
