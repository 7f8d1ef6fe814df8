"""The shared-policy modes (`matpo`, `shared_mgrpo`): one model serves both roles, trains once per step on both
roles' rows pooled into one fixed-size batch, and checkpoints, resumes and starts stage 2 like the other modes."""

import json
import os

import jax
import numpy as np
import pytest

from mgrpo_jax.config import credit_name, get_config, rl_batch_rows, validate
from mgrpo_jax.rl import sides
from mgrpo_jax.rl.trainer import Trainer
from mgrpo_jax.rollout import batches
from mgrpo_jax.runtime.metrics import read_jsonl
from tests.rl.test_trainer import _compact


def test_the_matpo_mode_takes_matpo_credit_and_loss_and_pools_its_batch():
    config = get_config("xbench", "figures,matpo")
    validate(config)
    assert credit_name(config) == "matpo"
    assert (config.main.loss_hparams.eps_low, config.main.loss_hparams.eps_high) == (0.2, 0.2)
    assert (config.main.loss_hparams.aggregation, config.main.loss_hparams.kl_coef) == ("token-mean", 0.0)
    q, k, c, d = (config.rollout.queries, config.rollout.samples, config.rollout.max_sub_calls, config.rollout.d_max)
    assert rl_batch_rows(config, "main") == q * k + q * k * c  # MATPO: a row per possible call, no alignment
    shared = get_config("xbench", "figures,shared_mgrpo")
    assert credit_name(shared) == "mgrpo" and rl_batch_rows(shared, "main") == q * k + q * k * d
    assert shared.main.loss_hparams.aggregation is None  # M-GRPO's own loss settings
    shared.credit = "matpo"  # a credit by name overrides the mode's
    assert credit_name(shared) == "matpo" and rl_batch_rows(shared, "main") == q * k + q * k * c


@pytest.mark.parametrize("mode", ["matpo", "shared_mgrpo"])
def test_a_shared_policy_mode_cannot_be_split_into_two_jobs(mode):
    config = get_config("xbench", f"local,{mode}")
    config.store, config.rollout.counterfactual_share = "file:///tmp/store", 0.0
    message = f"mode='{mode}': --role=main: mode {mode} trains one model for both agents, which cannot be split"
    with pytest.raises(ValueError, match=message):
        validate(config, job="main")
    validate(config, job="colocated")


def test_config_names_a_bad_credit_and_a_second_init_from():
    config = get_config("xbench", "local,matpo")
    config.credit = "matpoo"
    config.sub.init_from = "/some/checkpoint"
    with pytest.raises(ValueError) as e:
        validate(config)
    assert "credit='matpoo': not a registered credit assignment" in str(e.value)
    assert "did you mean 'matpo'" in str(e.value)
    assert "sub.init_from" in str(e.value) and "set main.init_from" in str(e.value)


def _rows(n, length, weight, pad_id=0, start=1):
    tokens = np.arange(start, start + n * length, dtype=np.int32).reshape(n, length)
    return {"tokens": tokens, "positions": np.tile(np.arange(length, dtype=np.int32), (n, 1)),
            "attention_mask": np.ones((n, length), bool), "loss_mask": np.ones((n, length), np.float32),
            "old_logprobs": np.full((n, length), -0.5, np.float32), "advantages": np.full(n, 0.25, np.float32),
            "weights": np.full(n, weight, np.float32), "temperature": np.ones(n, np.float32),
            "top_k": np.zeros(n, np.int32), "top_p": np.ones(n, np.float32)}


def test_concat_rows_pads_the_shorter_part_with_rows_that_train_nothing():
    main, sub = _rows(2, 3, 1.0), {**_rows(3, 5, 0.5, start=100), "source": np.zeros((3, 3), np.int32)}
    out = batches.concat_rows([main, sub], pad_id=7)
    assert "source" not in out  # only the columns both parts have
    assert out["tokens"].shape == (5, 5)
    np.testing.assert_array_equal(out["tokens"][:2, 3:], 7)
    np.testing.assert_array_equal(out["tokens"][2:], sub["tokens"])
    np.testing.assert_array_equal(out["positions"][0], [0, 1, 2, 3, 4])
    assert not out["attention_mask"][:2, 3:].any() and not out["loss_mask"][:2, 3:].any()
    assert (out["old_logprobs"][:2, 3:] == 0).all() and (out["old_logprobs"][:2, :3] == -0.5).all()
    np.testing.assert_array_equal(out["weights"], [1, 1, 0.5, 0.5, 0.5])


class _Recorder:
    """A learner that records the batches it trains on."""

    name, tokenizer = "shared", type("T", (), {"pad_id": 0})()

    def __init__(self):
        self.batches = []

    def train(self, batches):  # a batch, or a list of them (as Learner.train takes)
        self.batches.extend([batches] if isinstance(batches, dict) else batches)
        return {}


def test_one_model_behind_both_sides_trains_once_on_the_pooled_fixed_size_batch():
    config = get_config("xbench", "local,matpo")
    learner = _Recorder()
    main, sub = sides.MainSide(learner, None, None, config, "", 0), sides.SubSide(learner)
    q, k, c = config.rollout.queries, config.rollout.samples, config.rollout.max_sub_calls
    main_rows, sub_rows = _rows(q * k, 4, 1.0), _rows(q * k * c, 2, 1.0)
    sub_rows["weights"][::2] = 0.0  # MATPO's padding calls
    pooled = sides.PooledPair(main, sub, config)
    pooled.update(main_rows, [sub_rows])
    (batch,) = learner.batches
    assert len(batch["weights"]) == rl_batch_rows(config, "main") == q * k * (1 + c)
    np.testing.assert_array_equal(batch["tokens"][: q * k], main_rows["tokens"])  # main rows first
    assert batch["weights"][q * k:].sum() == sub_rows["weights"].sum()
    # A step without calls still trains on the same fixed-size batch: the rest is weight-0 padding.
    pooled.update(main_rows, [])
    assert len(learner.batches[1]["weights"]) == len(batch["weights"])
    assert learner.batches[1]["weights"][q * k:].sum() == 0
    # Two models: each trains on its own rows.
    other = _Recorder()
    sides.SidePair(main, sides.SubSide(other)).update(main_rows, [sub_rows])
    assert len(learner.batches[2]["weights"]) == q * k and len(other.batches) == 1
    with pytest.raises(ValueError, match="one learner on both sides"):
        sides.PooledPair(main, sides.SubSide(other), config)


@pytest.mark.slow
def test_the_matpo_mode_trains_resumes_and_starts_stage2_from_its_checkpoint(tmp_path):
    """The compact system in the matpo mode: one learner for both roles, warm-started on both roles'
    demonstrations, one pooled update per step, checkpoints under its one name; a second stage starts from it."""
    config = _compact("matpo", steps=1)
    trainer = Trainer(config, str(tmp_path / "stage1"))
    assert trainer.agents["main"] is trainer.agents["sub"] and list(trainer.learners) == ["shared"]
    summary = trainer.run()
    assert trainer.status == "finished"
    assert summary["shared/train/tokens"] > 0 and "main/reward" in summary and "main/train/loss" not in summary
    assert summary["shared/loss/eps_high"] == 0.2 and summary["shared/loss/kl_coef"] == 0.0
    records = read_jsonl(os.path.join(tmp_path / "stage1", "metrics.jsonl"))
    checks = [r for r in records if "warmstart/shared/format_ok" in r]
    assert checks and all({"warmstart/shared/main/format_ok", "warmstart/shared/sub/format_ok"} <= set(r)
                          for r in checks)
    assert all(r["warmstart/shared/format_ok"] == min(r["warmstart/shared/main/format_ok"],
                                                      r["warmstart/shared/sub/format_ok"]) for r in checks)

    resumed = _compact("matpo", steps=2)  # the same run, one step longer: resumes from step 1
    again = Trainer(resumed, str(tmp_path / "stage1"))
    again.run()
    assert [r["step"] for r in read_jsonl(tmp_path / "stage1" / "metrics.jsonl") if "step" in r][-2:] == [1, 2]

    stage2 = _compact("shared_mgrpo", steps=1)
    stage2.init_checkpoint = str(tmp_path / "stage1")
    stage2.stage, stage2.env.stage2_max_success = "stage2", 1.0
    follower = Trainer(stage2, str(tmp_path / "stage2"))
    follower.init_from_checkpoint(stage2.init_checkpoint)
    for a, b in zip(jax.tree.leaves(follower.learners["shared"].state.params),
                    jax.tree.leaves(again.learners["shared"].state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    follower.run()
    run = json.loads((tmp_path / "stage2" / "summary.json").read_text())["run"]
    assert (run["status"], run["mode"]) == ("finished", "shared_mgrpo")
