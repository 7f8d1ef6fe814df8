"""The trainer's hooks: periods, order, figures added for the hooks after, the last step, bad periods."""

import pytest

from mgrpo_jax.rl.hooks import EVALUATE, SAVE, WRITE, Hooks, StepInfo


def _run(hooks: Hooks, steps: int, stop_at: int | None = None) -> list[dict]:
    out = []
    for step in range(1, steps + 1):
        last = step == steps or step == stop_at
        out.append(hooks.run(StepInfo(step, {"loss": float(step)}, last=last)))
        if step == stop_at:
            break
    return out


def test_each_hook_runs_at_its_period_and_at_the_last_step_when_asked():
    calls = []
    hooks = Hooks()
    hooks.add(lambda info: calls.append(("every", info.step)))
    hooks.add(lambda info: calls.append(("third", info.step)), every=3)
    hooks.add(lambda info: calls.append(("third+last", info.step)), every=3, at_last=True)
    _run(hooks, 7)
    assert [s for name, s in calls if name == "every"] == [1, 2, 3, 4, 5, 6, 7]
    assert [s for name, s in calls if name == "third"] == [3, 6]
    assert [s for name, s in calls if name == "third+last"] == [3, 6, 7]


def test_hooks_run_in_order_and_later_ones_see_the_figures_earlier_ones_added():
    seen = []
    hooks = Hooks()
    hooks.add(lambda info: seen.append(("save", dict(info.metrics))), order=SAVE)
    hooks.add(lambda info: seen.append(("write", dict(info.metrics))), order=WRITE)
    hooks.add(lambda info: {"eval/accuracy": 0.5}, every=2, order=EVALUATE)
    hooks.add(lambda info: {"user/twice": 2 * info.metrics["loss"]})  # USER: after evaluation, before writing
    metrics = _run(hooks, 2)
    assert [name for name, _ in seen] == ["write", "save", "write", "save"]
    assert seen[0][1] == {"loss": 1.0, "user/twice": 2.0}  # step 1: no evaluation
    assert seen[2][1] == {"loss": 2.0, "eval/accuracy": 0.5, "user/twice": 4.0}
    assert metrics[1] == seen[3][1]  # run returns the step's metrics with every hook's figures


def test_a_stop_is_the_last_step_and_a_removed_hook_stops_running():
    calls = []
    hooks = Hooks()
    hook = hooks.add(lambda info: calls.append(info.step), every=10, at_last=True)
    _run(hooks, 20, stop_at=4)
    assert calls == [4]
    hooks.remove(hook)
    _run(hooks, 20)
    assert calls == [4]


@pytest.mark.parametrize("every", [0, -3])
def test_a_period_below_one_is_an_error_naming_it(every):
    with pytest.raises(ValueError, match=f"every={every}"):
        Hooks().add(lambda info: None, every=every)
