"""The transfer probe's reading of a rollout against the gold decomposition, and its per-kind summary."""

from experiments.figures import transfer_probe
from mgrpo_jax.env.questions import DELEGATE_STEP, REASON_STEP, Question, SubTask
from mgrpo_jax.rollout.episode import Episode

CHAIN = Question("v-0", "validation", "chain", 2, "country born_in Varn", "Oslan",
                 (SubTask(0, DELEGATE_STEP, "born_in Varn", "Thorn", 1, "born_in"),
                  SubTask(1, DELEGATE_STEP, "country Thorn", "Oslan", 2, "country", inputs=(0,))),
                 ((1, "born_in"), (2, "country")), (1,))
COMPARE = Question("v-1", "validation", "compare", 2, "max age Varn Kelt", "40",
                   (SubTask(0, DELEGATE_STEP, "age Varn", "31", 1, "age"),
                    SubTask(1, DELEGATE_STEP, "age Kelt", "40", 3, "age"),
                    SubTask(2, REASON_STEP, "max 31 40", "40", expression="max 31 40", inputs=(0, 1))),
                   ((1, "age"), (3, "age")), (1, 3))


def _episode(answer, calls=(), format_error=None):
    subs = [Episode(agent="sub", question_index=0, rollout=0, task=task, call={"task": task}, answer=reply)
            for task, reply in calls]
    return Episode(agent="main", question_index=0, rollout=0, answer=answer, format_error=format_error, subs=subs)


def test_each_rollout_gets_the_first_thing_that_went_wrong():
    right = [("born_in Varn", "Thorn"), ("country Thorn", "Oslan")]
    assert transfer_probe.outcome(CHAIN, _episode("Oslan", right)) == "correct"
    assert transfer_probe.outcome(CHAIN, _episode(None, right[:1])) == "format"
    assert transfer_probe.outcome(CHAIN, _episode("x", right, format_error="no answer tag")) == "format"
    assert transfer_probe.outcome(CHAIN, _episode("Gril", [("born_in Vorn", "Gril")])) == "first_call"
    assert transfer_probe.outcome(CHAIN, _episode("Tolt", [("born_in Varn", "Broux"), ("country Broux", "Tolt")])) \
        == "sub_answer"
    # The first hop right, the second asks about the topic again instead of carrying the answer on.
    assert transfer_probe.outcome(CHAIN, _episode("Bair", [("born_in Varn", "Thorn"), ("country Varn", "Bair")])) \
        == "chaining"
    assert transfer_probe.outcome(CHAIN, _episode("Thorn", right[:1])) == "chaining"  # stopped a hop short
    assert transfer_probe.outcome(CHAIN, _episode("Thorn", right)) == "final_answer"
    # A comparison: both lookups right, the wrong one of the two values answered (the calc step is not a call).
    both = [("age Varn", "31"), ("age Kelt", "40")]
    assert transfer_probe.outcome(COMPARE, _episode("40", both)) == "correct"
    assert transfer_probe.outcome(COMPARE, _episode("31", both)) == "final_answer"


def test_summary_and_gap_per_kind_by_hand():
    right = [("born_in Varn", "Thorn"), ("country Thorn", "Oslan")]
    trained = transfer_probe.summarize(
        [CHAIN, COMPARE], [[_episode("Oslan", right), _episode(None)], [_episode("40", [])] * 2])
    assert trained["all"]["rollouts"] == 4 and trained["all"]["accuracy"] == 0.75
    assert trained["chain/2"]["accuracy"] == 0.5 and trained["chain/2"]["outcomes"]["format"] == 0.5
    assert trained["compare/2"] == {"questions": 1, "rollouts": 2, "accuracy": 1.0,
                                    "outcomes": {name: float(name == "correct") for name in transfer_probe.OUTCOMES}}
    held_out = transfer_probe.summarize([CHAIN], [[_episode("Oslan", right), _episode("Oslan", right)]])
    gap = transfer_probe.gap(trained, held_out)
    assert gap["chain/2"] == {"fresh": 0.5, "validation": 1.0, "gap": -0.5, "counts": [1, 1]}
    assert gap["compare/2"]["gap"] is None and gap["compare/2"]["counts"] == [1, 0]
