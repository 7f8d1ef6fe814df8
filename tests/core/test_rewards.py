import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax.core import main_reward, sub_reward


def test_main_reward_takes_the_three_paper_values():
    format_ok = jnp.array([True, True, False, False])
    correct = jnp.array([1.0, 0.0, 1.0, 0.0])
    np.testing.assert_allclose(main_reward(format_ok, correct), [1.0, 0.1, 0.0, 0.0], atol=1e-7)


def test_sub_reward_hand_computed_and_gated():
    format_ok = jnp.array([True, True, True, False])
    main_correct = jnp.array([1.0, 0.0, 1.0, 1.0])
    expert = jnp.array([1.0, 1.0, 0.5, 1.0])
    # 0.1 + 0.4 + 0.5 | 0.1 + 0.5 | 0.1 + 0.4 + 0.25 | gate
    np.testing.assert_allclose(sub_reward(format_ok, main_correct, expert), [1.0, 0.6, 0.75, 0.0], atol=1e-6)


def test_reward_weights_are_configurable_and_validated():
    np.testing.assert_allclose(main_reward(True, 1.0, alpha=(0.5, 0.5)), 1.0)
    np.testing.assert_allclose(sub_reward(True, 0.0, 1.0, beta=(0.0, 0.0, 1.0)), 1.0)
    with pytest.raises(ValueError, match="alpha must have 2"):
        main_reward(True, 1.0, alpha=(0.1, 0.2, 0.7))
    with pytest.raises(ValueError, match="beta must have 3"):
        sub_reward(True, 1.0, 1.0, beta=(0.5, 0.5))


def test_rewards_jit_equals_eager_and_broadcast():
    format_ok = jnp.array([[True, False], [True, True]])
    correct = jnp.array([[1.0, 1.0], [0.0, 1.0]])
    np.testing.assert_array_equal(jax.jit(main_reward)(format_ok, correct), main_reward(format_ok, correct))
    # The main agent's correctness of each rollout broadcasts over its D sub-call slots.
    out = sub_reward(jnp.ones((2, 2, 3), bool), correct[..., None], jnp.zeros((2, 2, 3)))
    assert out.shape == (2, 2, 3)
    np.testing.assert_allclose(out[1, 1], [0.5, 0.5, 0.5])
