"""The stage-2 curriculum (mgrpo_jax/rl/curriculum.py): its pool, where its filter poses the pool, the shared pool
of `env.curriculum_file`, and the world seed and pool hash every run records."""

import hashlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import ml_collections
import pytest

from mgrpo_jax.config import get_config, validate
from mgrpo_jax.env.build import build_environment
from mgrpo_jax.env.questions import FRESH, HELD_OUT_SPLITS
from mgrpo_jax.rl import curriculum
from mgrpo_jax.rl.sides import counterfactual_twin
from mgrpo_jax.runtime.seeds import derive_seed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(env_seed: int = 0, share: float = 1.0):
    """The `figures` preset's stage 2 over a small compact world: batches of 16 x 8 rollouts, 4 samples per pool
    question, so the filter poses 32 pool questions per twin."""
    config = get_config("xbench", "figures")
    config.stage, config.env.seed = "stage2", env_seed
    config.env.sizes = ml_collections.ConfigDict(
        {"stage1": 40, "stage2": 120, "validation": 10, "eval_gaia": 10, "eval_xbench": 10, "eval_webwalker": 10,
         "fresh": 12})
    config.env.stage2_filter_pool = 70
    config.rollout.counterfactual_share = share
    return config


@pytest.fixture(scope="module")
def env():
    return build_environment(_config())


class SpyEngine:
    """Records the world or twin active while each batch runs and what the batch's questions answer there; each
    rollout answers the active twin's answer at even pool positions and the world's answer at odd ones."""

    def __init__(self, env):
        self.env, self.batches = env, []
        self.world_answers = {q.id: q.answer for q in env.questions.stage2}

    def run(self, questions, rollouts, seed=0):
        self.batches.append({"active": self.env.twins.current, "questions": list(questions), "seed": seed,
                             "rollouts": rollouts})
        top = []
        for i, q in enumerate(questions):
            answer = q.answer if i % 2 == 0 else self.world_answers[q.id]
            top.append([SimpleNamespace(answer=answer, question_index=i) for _ in range(rollouts)])
        return SimpleNamespace(top=top)


def test_the_filter_poses_its_pool_in_seeded_twins_and_judges_by_the_twins_answers(env, tmp_path):
    config = _config()
    engine = SpyEngine(env)
    served, record = curriculum.filter_curriculum(config, env, engine, str(tmp_path))
    # 70 pool questions in batches of 16 x 8 / 4 = 32: three batches, each in the twin its seeded draw names.
    assert [len(b["questions"]) for b in engine.batches] == [32, 32, 6]
    twins = [counterfactual_twin(config, i, "curriculum_twin") for i in range(3)]
    assert record["twins"] == twins and all(1 <= t <= 64 for t in twins)
    for i, (batch, twin) in enumerate(zip(engine.batches, twins, strict=True)):
        assert batch["active"] is env.twins.twin(twin) and batch["active"] is not env.world  # never the world
        assert batch["seed"] == derive_seed(config.seed, "curriculum", i) and batch["rollouts"] == 4
        world = env.twins.twin(twin)
        for q in batch["questions"]:
            if q.kind == "chain":  # posed in the twin: its answer follows the twin's values hop by hop
                *facts, value = q.text.split()
                for fact in reversed(facts):
                    value = world.lookup(fact, value)
                assert q.answer == value
    assert env.twins.current is env.world  # the world is active again afterwards
    # Judged by the twins' answers: the even positions (the twin's answer) are solved, the odd ones (the world's)
    # only where the twin happens to agree with the world; the filter keeps what is solved at most half the time.
    expected = {q.id for b in engine.batches for i, q in enumerate(b["questions"])
                if i % 2 and q.answer != engine.world_answers[q.id]}
    assert 30 <= len(expected) <= 35  # 35 odd positions, less the rare agreements
    fresh = set(record["fresh"])
    assert {q.id for q in served} == expected | fresh and record["pool_kept"] == len(expected)
    assert record["kept"] == [q.id for q in served]  # split order
    assert json.loads((tmp_path / "curriculum.json").read_text()) == record
    assert (record["world_seed"], record["pool_hash"]) == (0, curriculum.pool_hash(served))


def test_without_twins_the_filter_asks_the_world_in_one_batch(env, tmp_path):
    config = _config(share=0.0)
    config.rollout.queries = 2
    engine = SpyEngine(env)
    served, record = curriculum.filter_curriculum(config, env, engine, str(tmp_path), write=False)
    assert len(engine.batches) == 1 and engine.batches[0]["active"] is env.world and record["twins"] == [0]
    # In the world both answers are the world's: every pool question is solved, only the fresh texts are served.
    assert len(served) == 12 and record["pool_kept"] == 0 and [q.id for q in served] == record["fresh"]
    assert not (tmp_path / "curriculum.json").exists()


def test_the_pool_holds_no_evaluation_text_and_the_fresh_texts_are_always_trained(env):
    config = _config()
    always, pool = curriculum.filter_parts(config, env)
    evaluated = {q.text for split in (*HELD_OUT_SPLITS, FRESH) for q in env.questions.split(split)}
    assert len(pool) == 70 and not {q.text for q in pool} & evaluated
    assert {q.split for q in pool} == {"stage2"}
    fresh_texts = [q.text for q in env.questions.fresh]
    assert [q.text for q in always] == fresh_texts and len(always) == 12  # the first 12 stage-2 texts
    # Every fresh text is served whatever the filter measures: a system that solves everything keeps only them.
    config.rollout.queries = 2
    everything = SimpleNamespace(run=lambda qs, n, seed=0: SimpleNamespace(
        top=[[SimpleNamespace(answer=q.answer, question_index=i)] * n for i, q in enumerate(qs)]))
    served, _ = curriculum.filter_curriculum(config, env, everything, "", write=False)
    assert [q.text for q in served] == fresh_texts


def _filtered(env, workdir) -> dict:
    return curriculum.filter_curriculum(_config(), env, SpyEngine(env), str(workdir))[1]


def test_a_curriculum_file_serves_exactly_its_ids_and_a_resumed_run_the_same(env, tmp_path):
    record = _filtered(env, tmp_path / "filter_run")
    config = _config()
    config.env.curriculum_file = str(tmp_path / "filter_run" / "curriculum.json")
    feed = curriculum.QuestionFeed(config, env, str(tmp_path / "lineage"))
    assert [q.id for q in feed.questions] == record["kept"]
    assert feed.identity() == {"env/seed": 0, "env/pool_hash": record["pool_hash"]}
    spy = SpyEngine(env)
    copied = feed.prepare(spy, write=True)  # records the shared pool in the run's workdir; filters nothing
    assert not spy.batches and copied["source"] == config.env.curriculum_file
    assert json.loads((tmp_path / "lineage" / "curriculum.json").read_text())["kept"] == record["kept"]
    resumed = curriculum.QuestionFeed(config, env, str(tmp_path / "lineage"))
    assert [q.id for q in resumed.questions] == record["kept"]
    config.env.curriculum_file = ""  # the workdir's copy alone serves the same questions
    assert [q.id for q in curriculum.QuestionFeed(config, env, str(tmp_path / "lineage")).questions] == record["kept"]
    # The shared file changed under a started run: an error, not a silent switch of questions.
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps({**record, "kept": record["kept"][1:]}))
    config.env.curriculum_file = str(changed)
    with pytest.raises(ValueError, match="no longer names the questions this run trained on"):
        curriculum.QuestionFeed(config, env, str(tmp_path / "lineage"))


def test_a_curriculum_file_of_another_world_or_unreadable_is_a_clear_error(env, tmp_path):
    record = _filtered(env, tmp_path)
    config = _config()
    bad = tmp_path / "bad.json"
    cases = [
        (None, "env.curriculum_file=.*no such file"),
        ("not json", "env.curriculum_file=.*not a curriculum.json"),
        (json.dumps({"kept": [1, 2]}), "`kept` must be a list of question ids"),
        (json.dumps({**record, "world_seed": 1}), "written for world env.seed=1, this run's is env.seed=0"),
        (json.dumps({**record, "kept": ["stage2-999"]}), "ids the stage2 split of world env.seed=0 does not have"),
        (json.dumps({**record, "pool_hash": "0" * 16}), "texts differ"),
    ]
    for text, message in cases:
        if text is not None:
            bad.write_text(text)
        config.env.curriculum_file = str(bad if text is not None else tmp_path / "missing.json")
        with pytest.raises(ValueError, match=message):
            curriculum.QuestionFeed(config, env, str(tmp_path / "run"))
    # Another world has the same ids ("stage2-3") but other texts: its pool hash tells them apart.
    other = _config(env_seed=1)
    other.env.curriculum_file = str(tmp_path / "curriculum.json")
    with pytest.raises(ValueError, match="env.seed=0, this run's is env.seed=1"):
        curriculum.QuestionFeed(other, build_environment(other), str(tmp_path / "run1"))
    unseeded = tmp_path / "unseeded.json"
    unseeded.write_text(json.dumps({k: v for k, v in record.items() if k != "world_seed"}))
    other.env.curriculum_file = str(unseeded)
    with pytest.raises(ValueError, match="texts differ"):
        curriculum.QuestionFeed(other, build_environment(other), str(tmp_path / "run1"))


def test_the_pool_hash_is_hand_computable_stable_across_processes_and_names_the_world(env, tmp_path):
    questions = [SimpleNamespace(id="b", text="y z"), SimpleNamespace(id="a", text="x")]
    assert curriculum.pool_hash(questions) == hashlib.sha256(b"a\tx\nb\ty z").hexdigest()[:16]
    assert curriculum.pool_hash(questions[::-1]) == curriculum.pool_hash(questions)
    feeds = [curriculum.QuestionFeed(c, build_environment(c), str(tmp_path / str(s)))
             for s, c in ((0, _config(0)), (1, _config(1)))]
    identities = [f.identity() for f in feeds]
    assert [i["env/seed"] for i in identities] == [0, 1]
    assert identities[0]["env/pool_hash"] != identities[1]["env/pool_hash"]
    script = ("import sys; sys.path.insert(0, 'tests/rl'); import test_curriculum as t; "
              "from mgrpo_jax.rl import curriculum; from mgrpo_jax.env.build import build_environment; "
              "c = t._config(0); print(curriculum.QuestionFeed(c, build_environment(c), sys.argv[1]).identity())")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "sub")], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True).stdout
    assert out.strip().splitlines()[-1] == str(identities[0])


def test_a_curriculum_file_outside_stage_2_is_a_config_error():
    config = _config()
    config.stage, config.env.curriculum_file = "stage1", "runs/x/curriculum.json"
    with pytest.raises(ValueError, match="env.curriculum_file='runs/x/curriculum.json': .*needs stage=stage2"):
        validate(config)
    config.stage = "stage2"
    validate(config)
