"""Test-wide setup: eight fake CPU devices so sharded code runs on a laptop.

The flag must be set before JAX initialises its backend, i.e. before any test imports jax.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole test session, its workers and the runs they start as processes:
# the end-to-end tests compile the same smoke-sized programs again and again (a smoke run takes half the time
# with them cached). A fresh clone starts with an empty cache; the key covers the program and the devices.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".jax_test_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import hypothesis  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mgrpo_jax.model import get_model_config, make_mesh  # noqa: E402

hypothesis.settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
hypothesis.settings.register_profile("dev", max_examples=30, deadline=None)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "dev")

# Fixtures of the agent, runtime and rl tests: a tiny model config, meshes over the 8 fake CPU devices, batches.

VOCAB = 64


@pytest.fixture(scope="session")
def tiny_cfg():
    return get_model_config("tiny", vocab_size=VOCAB, d_model=64, mlp_dim=128, head_dim=16)


@pytest.fixture(scope="session")
def mesh1():
    return make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


@pytest.fixture(scope="session")
def mesh8():
    return make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def make_batch(rows: int = 16, length: int = 12, seed: int = 0, prompt: int = 4, vocab: int = VOCAB,
               advantages=None, weights=None) -> dict:
    """A policy batch (numpy): random tokens, right padding, loss mask on the generated part."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(rows, length), dtype=np.int32)
    lengths = rng.integers(prompt + 2, length + 1, size=rows)
    cols = np.arange(length)[None, :]
    attn = cols < lengths[:, None]
    tokens = np.where(attn, tokens, 0).astype(np.int32)
    positions = np.broadcast_to(cols, (rows, length)).astype(np.int32)
    loss_mask = (attn & (cols >= prompt)).astype(np.float32)
    adv = rng.normal(size=rows).astype(np.float32) if advantages is None else np.asarray(advantages, np.float32)
    w = np.ones(rows, np.float32) if weights is None else np.asarray(weights, np.float32)
    return {
        "tokens": tokens, "positions": positions, "attention_mask": attn, "loss_mask": loss_mask,
        "old_logprobs": np.zeros((rows, length), np.float32), "advantages": adv, "weights": w,
    }


@pytest.fixture(scope="session")
def batch_factory():
    return make_batch
