"""Run assembly from the config: `agent.sharding_rules` picks the rule set an agent's parameters are laid out by."""

import types

import jax
import pytest

from mgrpo_jax.agent.build import build_agent
from mgrpo_jax.config import base_config
from mgrpo_jax.model import get_rules, logical_to_spec

TOKENIZER = types.SimpleNamespace(vocab_size=256, pad_id=0)


def _agent(rules: str):
    cfg = base_config().main
    cfg.model_overrides.update({"d_model": 32, "n_layers": 1, "mlp_dim": 64, "n_heads": 2, "n_kv_heads": 2,
                                "head_dim": 16, "vocab_size": 256})
    cfg.mesh.update({"data": 1, "fsdp": 4, "tensor": 2})
    cfg.sharding_rules = rules
    return build_agent("main", cfg, TOKENIZER, jax.devices()[:8], seed=0)


@pytest.mark.parametrize("rules", ["default", "fsdp", "tensor", "data"])
def test_sharding_rules_come_from_the_config(rules):
    learner = _agent(rules)
    assert learner.rules == get_rules(rules)
    embed = learner.state.params["embed"]
    up = learner.state.params["layers"]["up"]
    assert embed.sharding.spec == logical_to_spec(("vocab", "embed"), get_rules(rules), learner.mesh, embed.shape)
    assert up.sharding.spec == logical_to_spec(("layers", "embed", "mlp"), get_rules(rules), learner.mesh, up.shape)
    # The optimizer state follows the parameters, and a reset keeps the rule set.
    learner.reset_optimizer(learner.config.optim)
    assert learner.state.params["embed"].sharding.spec == embed.sharding.spec


def test_the_rule_sets_place_parameters_differently():
    specs = {r: _agent(r).state.params["layers"]["up"].sharding.spec for r in ("default", "fsdp", "data")}
    assert all(axis is None for axis in specs["data"])  # replicated: only the batch is split
    assert "tensor" in str(specs["default"]) and "tensor" not in str(specs["fsdp"])
    assert len({specs["default"], specs["fsdp"], specs["data"]}) == 3
