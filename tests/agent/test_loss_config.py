"""A loss chosen by config trains with its own hyper-parameters unless the config sets them; the KL reference
policy is built only when `kl_coef > 0`, a frozen copy of the weights RL starts from, its log-probs in every RL
batch, the KL term of the loss equal to a hand computation, and kept by checkpoints."""

import jax
import numpy as np
import pytest

from mgrpo_jax.agent.learner import Learner
from mgrpo_jax.agent.state import create_agent_state, model_from_state
from mgrpo_jax.agent.step import make_logprob_fn
from mgrpo_jax.config import get_config
from mgrpo_jax.core.losses import available_losses, loss_defaults
from mgrpo_jax.runtime.checkpoint import Checkpointer
from mgrpo_jax.sampling import Sampler


def _learner(tiny_cfg, mesh, kl_coef: float, estimator: str = "k3", seed: int = 0, loss: str = "grpo") -> Learner:
    config = get_config("xbench", "smoke").main
    config.loss_hparams.kl_coef, config.loss_hparams.kl_estimator = kl_coef, estimator
    config.loss = loss  # the learner builds its policy step with the loss it is given
    graphdef, state, sharding = create_agent_state(tiny_cfg, config.optim, mesh, seed=seed)
    sampler = Sampler(model_from_state(graphdef, state), pad_id=0)
    return Learner("main", config, tiny_cfg, mesh, graphdef, state, sharding, sampler)


def _rl_batch(learner, batch_factory):
    batch = batch_factory(rows=8, length=12, seed=3)
    batch["temperature"] = np.ones(8, np.float32)
    lp = make_logprob_fn(learner.graphdef, learner.sharding, learner.mesh)(
        learner.state.params, batch["tokens"], batch["positions"], batch["attention_mask"])
    batch["old_logprobs"] = np.asarray(lp)  # on-policy: ratio 1, the surrogate's value is -mean(A)
    return batch


@pytest.mark.parametrize("name", available_losses())
def test_a_loss_chosen_by_config_uses_its_own_defaults(tiny_cfg, mesh1, name):
    learner = _learner(tiny_cfg, mesh1, kl_coef=0.0)
    learner.config.loss = name
    assert learner.loss_hparams == {**loss_defaults(name), "kl_coef": 0.0, "kl_estimator": "k3"}
    learner.config.loss_hparams.eps_high = 0.5  # set by the user: overrides the loss's own
    assert learner.loss_hparams == {**loss_defaults(name), "eps_high": 0.5, "kl_coef": 0.0, "kl_estimator": "k3"}


@pytest.mark.parametrize("name, clip_range, ratio_level, aggregation", [
    ("grpo", (0.2, 0.28), "token", "seq-mean-token-mean"),
    ("dr_grpo", (0.2, 0.28), "token", "seq-mean-token-sum-norm"),
    ("gspo", (3e-4, 4e-4), "sequence-mean", "seq-mean-token-mean")])
def test_the_step_trains_with_the_losses_clip_range(tiny_cfg, mesh1, batch_factory, name, clip_range, ratio_level,
                                                    aggregation):
    learner = _learner(tiny_cfg, mesh1, kl_coef=0.0, loss=name)
    hparams = learner.loss_hparams
    assert ((hparams["eps_low"], hparams["eps_high"]), hparams["ratio_level"], hparams["aggregation"]) == \
        (clip_range, ratio_level, aggregation)
    batch = _rl_batch(learner, batch_factory)
    batch["advantages"] = np.ones(8, np.float32)
    batch["old_logprobs"] = batch["old_logprobs"] - 1e-3 * batch["loss_mask"]  # every ratio exp(1e-3) ~ 1.001
    metrics = learner.train(batch)
    # Outside GSPO's 1 + 4e-4 (every token clipped), well inside GRPO's 1 + 0.28 (none).
    assert metrics["main/train/clip_frac"] == (1.0 if name == "gspo" else 0.0)
    assert metrics["main/loss/eps_high"] == clip_range[1]


def test_no_reference_without_kl(tiny_cfg, mesh1, batch_factory):
    learner = _learner(tiny_cfg, mesh1, kl_coef=0.0)
    assert learner.reference is None and list(learner.checkpoint_items()) == ["main"]
    seen = []
    step = learner.policy_step
    learner.policy_step = lambda state, batch: (seen.append(sorted(batch)), step(state, batch))[1]
    metrics = learner.train(_rl_batch(learner, batch_factory))
    assert "ref_logprobs" not in seen[0] and "main/train/kl_ref" not in metrics


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_term_equals_a_hand_computation(tiny_cfg, mesh1, batch_factory, estimator):
    learner = _learner(tiny_cfg, mesh1, kl_coef=0.5, estimator=estimator)
    # A reference other than the policy (another initialisation), so the KL is not zero.
    learner.reference = create_agent_state(tiny_cfg, learner.config.optim, mesh1, seed=7)[1].params
    batch = _rl_batch(learner, batch_factory)
    logprob = make_logprob_fn(learner.graphdef, learner.sharding, mesh1)
    policy = np.asarray(batch["old_logprobs"])
    ref = np.asarray(logprob(learner.reference, batch["tokens"], batch["positions"], batch["attention_mask"]))
    log_ratio = ref - policy
    kl = -log_ratio if estimator == "k1" else np.exp(log_ratio) - log_ratio - 1
    mask = batch["loss_mask"]
    kl_rows = (kl * mask).sum(1) / mask.sum(1)
    surrogate_rows = -batch["advantages"]  # ratio 1 on every token
    metrics = learner.train(batch)
    assert metrics["main/train/kl_ref"] == pytest.approx((kl * mask).sum() / mask.sum(), rel=1e-4)
    assert metrics["main/train/loss"] == pytest.approx(np.mean(surrogate_rows + 0.5 * kl_rows), rel=1e-4, abs=1e-6)
    assert metrics["main/loss/kl_coef"] == 0.5


def test_reference_is_frozen_and_follows_the_rl_start(tiny_cfg, mesh1, batch_factory, tmp_path):
    learner = _learner(tiny_cfg, mesh1, kl_coef=0.1)
    start = jax.device_get(learner.reference)
    jax.tree.map(np.testing.assert_array_equal, start, jax.device_get(learner.state.params))
    for _ in range(2):
        learner.train(_rl_batch(learner, batch_factory))
    trained = jax.device_get(learner.state.params)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(learner.reference), start)  # never updated
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(start),
                                                        strict=True))
    assert jax.tree.leaves(learner.reference)[0].sharding == jax.tree.leaves(learner.state.params)[0].sharding

    with Checkpointer(tmp_path, async_save=False) as checkpointer:  # the reference survives a resume
        checkpointer.save(1, learner.checkpoint_items(), {"step": 1}, force=True)
        fresh = _learner(tiny_cfg, mesh1, kl_coef=0.1, seed=5)
        states, _ = checkpointer.restore(fresh.checkpoint_items())
    fresh.load_checkpoint_items(states)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(fresh.reference), start)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(fresh.state.params), trained)

    learner.reset_optimizer(learner.config.optim)  # a new RL start (after a warm start) re-freezes it
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(learner.reference), trained)
