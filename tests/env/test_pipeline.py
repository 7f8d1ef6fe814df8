from mgrpo_jax.env.pipeline import question_dataset, question_iterator
from mgrpo_jax.env.questions import Question


def _questions(count):
    return [Question(f"q{i}", "stage1", "lookup", 1, f"text {i}", str(i), (), (), (i,)) for i in range(count)]


def test_batches_shuffle_repeat_and_cover_each_epoch():
    questions = _questions(10)
    iterator = question_iterator(questions, batch_size=5, seed=0)
    epoch_one = [next(iterator) for _ in range(2)]
    epoch_two = [next(iterator) for _ in range(2)]
    assert all(isinstance(batch, tuple) and len(batch) == 5 for batch in epoch_one + epoch_two)
    assert sorted(q.id for batch in epoch_one for q in batch) == sorted(q.id for q in questions)
    assert [q.id for b in epoch_one for q in b] != [q.id for b in epoch_two for q in b]  # reshuffled
    assert [q.id for b in epoch_one for q in b] != [q.id for q in questions]


def test_iterator_state_resumes_exactly():
    questions = _questions(13)
    iterator = question_iterator(questions, batch_size=4, seed=7)
    for _ in range(5):
        next(iterator)
    state = iterator.get_state()
    expected = [next(iterator) for _ in range(6)]
    resumed = question_iterator(questions, batch_size=4, seed=7)
    resumed.set_state(state)
    assert [next(resumed) for _ in range(6)] == expected


def test_finite_epochs_and_no_shuffle():
    dataset = question_dataset(_questions(7), batch_size=3, seed=0, shuffle=False, num_epochs=1,
                               drop_remainder=False)
    assert [[q.id for q in batch] for batch in dataset] == [["q0", "q1", "q2"], ["q3", "q4", "q5"], ["q6"]]
