"""Which share of a world's questions the experts' per-world mistakes touch (`noise_exposure`)."""

import pytest

from experiments.figures import noise_exposure
from mgrpo_jax.env.compact.experts import CompactNoise
from mgrpo_jax.env.questions import DELEGATE_STEP, REASON_STEP, Question, SubTask


def _question(*facts):
    tasks = tuple(SubTask(i, DELEGATE_STEP, f"{fact} X", "v", i, fact) for i, fact in enumerate(facts))
    return Question("q", "stage2", "chain", len(facts), "t", "v", (*tasks, SubTask(len(tasks), REASON_STEP, "max 1 2",
                                                                                   "2", expression="max 1 2")),
                    (), ())


def test_shares_count_lookups_and_questions_by_hand():
    questions = [_question("age", "born_in"), _question("size", "size"), _question("mayor")]
    got = noise_exposure.exposure(questions, frozenset({"age", "size"}))
    # lookups: age* born_in size* size* mayor -> 3 of 5 noisy; questions clean: only the third
    assert got == {"noisy_lookups": pytest.approx(3 / 5), "clean_questions": pytest.approx(1 / 3)}
    assert noise_exposure.exposure(questions, frozenset()) == {"noisy_lookups": 0.0, "clean_questions": 1.0}


def test_questions_that_ask_no_fact_are_an_error_that_says_so():
    with pytest.raises(ValueError, match="no lookups"):
        noise_exposure.exposure([Question("q", "stage2", "compare", 0, "t", "v", (), (), ())], frozenset({"age"}))


def test_a_world_reports_its_own_noisy_facts_and_a_share_per_set():
    got = noise_exposure.world_exposure(3)
    assert got["noisy_facts"] == sorted(CompactNoise(seed=3).wrong_kind)
    for name in noise_exposure.SETS:
        assert 0.0 <= got[name]["noisy_lookups"] <= 1.0 and 0.0 <= got[name]["clean_questions"] <= 1.0
        assert got[name]["questions"] > 0


def test_reads_split_by_the_noisy_facts_by_hand():
    reads = [("age", True), ("age", False), ("size", False), ("mayor", True), ("mayor", True), ("born_in", False)]
    got = noise_exposure.read_accuracy(reads, frozenset({"age", "size"}))
    # noisy: age True, age False, size False -> 1/3; clean: mayor True x2, born_in False -> 2/3
    assert got == {"noisy": {"accuracy": pytest.approx(1 / 3), "lookups": 3},
                   "clean": {"accuracy": pytest.approx(2 / 3), "lookups": 3}}
    assert noise_exposure.read_accuracy(reads, frozenset())["noisy"] == {"accuracy": None, "lookups": 0}


def test_runs_without_a_summary_are_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        noise_exposure.main(["--runs", str(tmp_path)])
    assert f"{tmp_path} has no summary.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        noise_exposure.main(["--runs", str(tmp_path), "--samples", "0"])
    assert "--samples must be at least 1, got 160 and 0" in capsys.readouterr().err
