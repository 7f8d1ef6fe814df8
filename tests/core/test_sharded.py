"""The kernels under an 8-device CPU mesh (batch sharded over devices) equal the single-device result."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mgrpo_jax.core import PolicyLossInputs, align, get_loss, main_advantages, main_reward, sub_advantages


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 8:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _pipeline(format_ok, correct, counts, logprobs, old, mask, key):
    rewards = main_reward(format_ok, correct)
    adv_main = main_advantages(rewards)
    _, weight = align(counts, 4, key)
    sub_rewards = rewards[..., None] * weight
    adv_sub = sub_advantages(sub_rewards, weight)
    q, k = rewards.shape
    inputs = PolicyLossInputs(logprobs, old, adv_main.reshape(q * k), mask)
    grad_fn = jax.grad(lambda lp: (lambda s, d, _: s / d)(*get_loss("grpo")(inputs._replace(logprobs=lp))))
    return adv_main, adv_sub, grad_fn(logprobs)


def test_pipeline_sharded_equals_single_device(mesh):
    rng = np.random.default_rng(0)
    q, k, t = 8, 4, 16
    args = (
        rng.random((q, k)) < 0.8,
        (rng.random((q, k)) < 0.4).astype(np.float32),
        rng.integers(0, 7, size=(q, k)),
        (rng.normal(size=(q * k, t)) * 0.1).astype(np.float32),
        (rng.normal(size=(q * k, t)) * 0.1).astype(np.float32),
        (rng.random((q * k, t)) < 0.7).astype(np.float32),
    )
    key = jax.random.key(0)
    single = jax.jit(_pipeline)(*args, key)
    batch = NamedSharding(mesh, P("data"))
    sharded_args = [jax.device_put(a, batch) for a in args]
    sharded = jax.jit(_pipeline)(*sharded_args, key)
    assert sharded[2].sharding.num_devices == 8
    for got, want in zip(sharded, single, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
