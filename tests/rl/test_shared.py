"""The shared-policy modes (`matpo`, `shared_mgrpo`): one model serves both roles, trains once per step on both
roles' rows pooled into one fixed-size batch, and checkpoints, resumes and starts stage 2 like the other modes."""

import json
import os

import jax
import numpy as np
import optax
import pytest

from mgrpo_jax.agent.state import create_agent_state
from mgrpo_jax.agent.step import make_logprob_fn, make_policy_step
from mgrpo_jax.config import MATPO_LOSS_HPARAMS, credit_name, get_config, rl_batch_rows, trained_section, validate
from mgrpo_jax.core.losses import resolve_loss_hparams
from mgrpo_jax.model import make_mesh
from mgrpo_jax.rl import sides
from mgrpo_jax.rl.trainer import Trainer
from mgrpo_jax.rollout import batches
from mgrpo_jax.runtime.metrics import read_jsonl
from tests.rl.scripted_launch import DelegateFirst
from tests.rl.test_trainer import _compact


def test_the_matpo_mode_takes_matpo_credit_and_loss_and_pools_its_batch():
    config = get_config("xbench", "figures,matpo")
    validate(config)
    assert credit_name(config) == "matpo"
    trained = trained_section(config, "main").loss_hparams
    assert (trained.eps_low, trained.eps_high, trained.dual_clip) == (0.2, 0.2, 3.0)
    assert (trained.aggregation, trained.kl_coef) == ("token-mean", 0.0)
    q, k, c, d = (config.rollout.queries, config.rollout.samples, config.rollout.max_sub_calls, config.rollout.d_max)
    assert rl_batch_rows(config, "main") == q * k + q * k * c  # MATPO: a row per possible call, no alignment
    shared = get_config("xbench", "figures,shared_mgrpo")
    assert credit_name(shared) == "mgrpo" and rl_batch_rows(shared, "main") == q * k + q * k * d
    assert trained_section(shared, "main") is shared.main  # M-GRPO's own loss settings
    shared.credit = "matpo"  # a credit by name overrides the mode's
    assert credit_name(shared) == "matpo" and rl_batch_rows(shared, "main") == q * k + q * k * c


def test_the_loss_recipe_is_read_at_build_time_and_default_holds_the_loss_fixed():
    """`loss_recipe="mode"`: the matpo mode's shared model trains with MATPO_LOSS_HPARAMS in the hyper-parameters the
    config leaves unset; "default" (a command-line override, applied after the preset) gives it the agents' own
    settings, the grpo defaults every other cell of the 2 x 2 trains with."""
    config = get_config("xbench", "figures,matpo")
    assert config.loss_recipe == "mode" and config.rollout.shared_role_weighting == "per_role"
    hparams = resolve_loss_hparams("grpo", trained_section(config, "main").loss_hparams.to_dict())
    assert {k: hparams[k] for k in MATPO_LOSS_HPARAMS} == MATPO_LOSS_HPARAMS
    assert config.main.loss_hparams.dual_clip is None  # the config itself is not edited
    config.main.loss_hparams.eps_high = 0.28  # set by the user: wins over the recipe
    assert trained_section(config, "main").loss_hparams.eps_high == 0.28
    config.loss_recipe = "default"
    validate(config)
    assert trained_section(config, "main") is config.main
    assert resolve_loss_hparams("grpo", config.main.loss_hparams.to_dict())["aggregation"] == "seq-mean-token-mean"
    for mode in ("mgrpo", "shared_mgrpo"):  # the same settings either way in every other mode
        other = get_config("xbench", f"figures,{mode}")
        assert trained_section(other, "main") is other.main
    config.loss_recipe, config.rollout.shared_role_weighting = "matpo", "pooling"
    with pytest.raises(ValueError) as e:
        validate(config)
    assert "loss_recipe='matpo': not one of mode, default" in str(e.value)
    assert "rollout.shared_role_weighting='pooling': not one of per_role, pooled; did you mean 'pooled'?" in str(
        e.value)


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
    """A learner that records the batches it trains on (one device, one micro-batch, the given loss settings)."""

    name, tokenizer = "shared", type("T", (), {"pad_id": 0})()
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])

    def __init__(self, aggregation="seq-mean-token-mean", micro_batches=1):
        self.batches = []
        self.loss_hparams = {"aggregation": aggregation} if aggregation else {}
        self.config = type("C", (), {"micro_batches": micro_batches, "loss": "grpo" if aggregation else "custom"})()

    def train(self, batches):  # a batch, or a list of them (as Learner.train takes)
        self.batches.extend([batches] if isinstance(batches, dict) else batches)
        return {}


def test_one_model_behind_both_sides_trains_once_on_the_pooled_bucketed_batch():
    config = get_config("xbench", "local,matpo")
    config.rollout.shared_role_weighting = "pooled"
    learner = _Recorder()
    q, k, c = config.rollout.queries, config.rollout.samples, config.rollout.max_sub_calls
    main = sides.MainSide(learner, None, None, config, "", 0)
    sub = sides.SubSide(learner, rl_batch_rows(config, "sub"))
    main_rows, sub_rows = _rows(q * k, 4, 1.0), _rows(q * k * c, 2, 1.0)
    sub_rows["weights"][::2] = 0.0  # MATPO's padding calls: the sub side keeps the real ones
    real = sides.real_rows(sub_rows)
    assert len(real["weights"]) == q * k * c // 2 and (real["tokens"] == sub_rows["tokens"][1::2]).all()
    pooled = sides.PooledPair(main, sub, config)
    metrics = pooled.update(main_rows, [real])
    (batch,) = learner.batches
    needed = q * k + q * k * c // 2
    assert len(batch["weights"]) == sides.bucket_rows(needed, 1, rl_batch_rows(config, "main")) < q * k * (1 + c)
    np.testing.assert_array_equal(batch["tokens"][: q * k], main_rows["tokens"])  # main rows first
    np.testing.assert_array_equal(batch["weights"], [1.0] * needed + [0.0] * (len(batch["weights"]) - needed))
    # Pooled: each role weighs its share of the rows (per-row mean): q*k main rows against q*k*c/2 sub rows.
    assert metrics["shared/main_weight"] == pytest.approx(q * k / needed)
    assert metrics["shared/sub_weight"] == pytest.approx(1 - q * k / needed)
    # A step without calls trains on the main rows alone, bucketed.
    metrics = pooled.update(main_rows, [])
    assert len(learner.batches[1]["weights"]) == sides.bucket_rows(q * k, 1, q * k * (1 + c))
    assert (metrics["shared/main_weight"], metrics["shared/sub_weight"]) == (1.0, 0.0)
    # Two models: each trains on its own rows; the sub learner's real calls are bucketed too.
    other = _Recorder()
    sides.SidePair(main, sides.SubSide(other, q * k * c)).update(main_rows, [real])
    assert len(learner.batches[2]["weights"]) == q * k
    assert len(other.batches[0]["weights"]) == sides.bucket_rows(q * k * c // 2, 1, q * k * c)
    with pytest.raises(ValueError, match="one learner on both sides"):
        sides.PooledPair(main, sides.SubSide(other), config)


def test_bucket_rows_are_few_sizes_that_split_and_never_exceed_the_whole_batch():
    sizes = {sides.bucket_rows(n, 8, 896) for n in range(1, 897)}
    assert sizes == {8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 896}
    assert all(sides.bucket_rows(n, 8, 896) >= n for n in range(1, 897))
    assert all(2 * sides.bucket_rows(n, 1, 10**6) <= 3 * n for n in range(1, 2000))  # at most a third padding
    assert sides.bucket_rows(418, 8, 896) == 512 and sides.bucket_rows(300, 8, 896) == 384


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_per_role_weighting_gives_each_role_half_of_the_objective(aggregation):
    config = get_config("xbench", "local,shared_mgrpo")
    learner = _Recorder(aggregation)
    main = sides.MainSide(learner, None, None, config, "", 0)
    q, k, d = config.rollout.queries, config.rollout.samples, config.rollout.d_max
    main_rows, sub_rows = _rows(q * k, 6, 1.0), _rows(q * k * d, 3, 1.0)
    metrics = sides.PooledPair(main, sides.SubSide(learner), config).update(main_rows, [sub_rows])
    assert (metrics["shared/main_weight"], metrics["shared/sub_weight"]) == pytest.approx((0.5, 0.5))
    weights = learner.batches[0]["weights"]
    # Trained tokens: every column but the first (5 per main row, 2 per sub row).
    main_d, sub_d = (q * k, q * k * d) if aggregation != "token-mean" else (5 * q * k, 2 * q * k * d)
    total = main_d + sub_d
    np.testing.assert_allclose(weights[: q * k], total / (2 * main_d), rtol=1e-6)
    np.testing.assert_allclose(weights[q * k:], total / (2 * sub_d), rtol=1e-6)
    custom = _Recorder(None)  # a loss without an aggregation: no denominator to normalise each role by
    with pytest.raises(ValueError, match="loss 'custom' has no `aggregation`; set rollout.shared_role_weighting"):
        sides.PooledPair(sides.MainSide(custom, None, None, config, "", 0), sides.SubSide(custom), config)


SGD = optax.sgd(1.0)  # the parameter change is minus the gradient


def _delta(new, old):
    return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                        jax.device_get(new.params), jax.device_get(old.params))


@pytest.fixture(scope="module")
def pooled_setup(tiny_cfg, mesh1, batch_factory):
    """A tiny model, 4 main rows of 12 tokens and 12 sub rows (5 of them weight-0 padding) of 8, behaviour
    log-probs a little off the policy so the clip acts."""
    graphdef, state, sharding = create_agent_state(tiny_cfg, SGD, mesh1, seed=0)
    logprobs = make_logprob_fn(graphdef, sharding, mesh1)
    parts = []
    for rows, length, seed in ((4, 12, 1), (12, 8, 2)):
        b = batch_factory(rows=rows, length=length, seed=seed, prompt=3)
        lp = np.asarray(logprobs(state.params, b["tokens"], b["positions"], b["attention_mask"]))
        b["old_logprobs"] = (lp + np.random.default_rng(seed).normal(0, 0.2, lp.shape)).astype(np.float32) * (
            b["attention_mask"])
        b["temperature"] = np.ones(rows, np.float32)
        parts.append(b)
    parts[1]["weights"][[2, 5, 7, 9, 11]] = 0.0
    return graphdef, state, sharding, parts


def _step(setup, mesh, aggregation, micro_batches, batch):
    graphdef, state, sharding, _ = setup
    step = make_policy_step(graphdef, SGD, "grpo", {"aggregation": aggregation}, sharding, mesh,
                            micro_batches=micro_batches, donate=False)
    new, metrics = step(state, batch)
    return _delta(new, state), jax.device_get(metrics)


@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_per_role_pooled_update_is_the_mean_of_the_two_roles_own_updates(pooled_setup, mesh1, aggregation):
    """The pooled batch with per-role weights, split into 2 micro-batches, moves the shared model by the mean of
    the two roles' own updates (each role's loss normalised by its own rows or tokens), and its loss is the mean
    of the two roles' losses."""
    main_rows, sub_rows = pooled_setup[3]
    learner = _Recorder(aggregation)
    config = get_config("xbench", "local,shared_mgrpo")
    config.rollout.queries, config.rollout.samples, config.rollout.d_max = 2, 2, 3  # 4 + 12 rows
    pair = sides.PooledPair(sides.MainSide(learner, None, None, config, "", 0), sides.SubSide(learner), config)
    pair.update(main_rows, [sub_rows])
    pooled = {k: v for k, v in learner.batches[0].items() if k not in ("top_k", "top_p")}
    d_pooled, m_pooled = _step(pooled_setup, mesh1, aggregation, 2, pooled)
    d_main, m_main = _step(pooled_setup, mesh1, aggregation, 1, main_rows)
    d_sub, m_sub = _step(pooled_setup, mesh1, aggregation, 1, sub_rows)
    np.testing.assert_allclose(m_pooled["loss"], (m_main["loss"] + m_sub["loss"]) / 2, rtol=1e-5)
    want = jax.tree.map(lambda a, b: (a + b) / 2, d_main, d_sub)
    diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), d_pooled, want)))
    assert diff < 2e-6 and max(float(np.abs(x).max()) for x in jax.tree.leaves(want)) > 1e-3
    # The pooled denominator is both roles' together (rows or tokens), as without the weighting.
    assert m_pooled["loss_denominator"] == pytest.approx(m_main["loss_denominator"] + m_sub["loss_denominator"])


def test_bucketed_batch_gives_the_same_loss_and_update_as_the_whole_one(pooled_setup, mesh1):
    """MATPO's pooled batch without its weight-0 call rows, padded to a bucket, trains exactly as the whole batch."""
    main_rows, sub_rows = pooled_setup[3]
    whole = batches.concat_rows([main_rows, sub_rows])
    bucketed = batches.pad_rows(batches.concat_rows([main_rows, sides.real_rows(sub_rows)]),
                                sides.bucket_rows(4 + 7, 2, 16))
    assert len(bucketed["weights"]) == 12 < len(whole["weights"])
    d_whole, m_whole = _step(pooled_setup, mesh1, "token-mean", 2, whole)
    d_bucket, m_bucket = _step(pooled_setup, mesh1, "token-mean", 2, bucketed)
    for key in ("loss", "loss_denominator", "tokens", "grad_norm"):
        np.testing.assert_allclose(m_bucket[key], m_whole[key], rtol=1e-5, err_msg=key)
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), d_bucket, d_whole))) < 2e-6


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
    assert summary["shared/loss/dual_clip"] == 3.0 and 0.0 <= summary["shared/train/dual_clip_frac"] <= 1.0
    # per_role, the default: half each when the step made calls, the main rows alone when it made none.
    weights = (summary["shared/main_weight"], summary["shared/sub_weight"])
    assert weights == pytest.approx((0.5, 0.5)) or weights == (1.0, 0.0)
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


@pytest.mark.slow
def test_two_models_under_matpos_credit_train_a_step_on_bucketed_calls(tmp_path):
    """The fourth cell of the 2 x 2: mode mgrpo (two models) with MATPO's credit. Every main episode's first turn is
    a delegation (tests/rl/scripted_launch.py), so each of the Q*K rollouts makes one call: the sub learner trains
    on those Q*K real rows, not on Q*K*C rows of which half are padding, and both losses are finite."""
    config = get_config("xbench", "smoke,mgrpo")
    config.credit, config.train.steps, config.train.eval_every = "matpo", 1, 0
    validate(config)
    trainer = Trainer(config, str(tmp_path))
    trainer.engine.top.sampler = DelegateFirst(trainer.engine.top.sampler, trainer.tokenizer)
    sub, rows = trainer.learners["sub"], []
    train = sub.train
    sub.train = lambda batches: rows.extend(len(b["weights"]) for b in batches) or train(batches)
    summary = trainer.run()
    q, k, c = config.rollout.queries, config.rollout.samples, config.rollout.max_sub_calls
    assert trainer.status == "finished" and summary["d_k/mean"] == 1.0
    assert rows == [q * k] and q * k < q * k * c  # one bucket of the real calls
    assert summary["sub/train/loss_denominator"] == q * k and summary["sub/train/tokens"] > 0
    assert all(np.isfinite(summary[f"{agent}/train/loss"]) for agent in ("main", "sub"))
