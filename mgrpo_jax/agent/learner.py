"""One agent as it learns: its model, mesh, train state and sampler, and its jitted train steps.

    learner.train(batch)            # `passes` policy updates on a fixed-size batch, then new weights to the sampler
    learner.start_sft(cfg)          # the warm start: a fresh optimizer `cfg` and its jitted supervised step,
    learner.sft_update(batch)       #   one update per call,
    learner.reset_optimizer(optim)  #   then the RL optimizer

Every train step donates the state, so the sampler is re-pointed at the new parameters after each update
(`publish`). The steps are built with the state (and again when the optimizer is reset), so `policy_step` is a plain
attribute that a benchmark may wrap. With `loss_hparams.kl_coef > 0` the learner holds a frozen reference policy: a
copy of the parameters RL starts from (taken at construction and again at every optimizer reset, so after a warm
start it is the warm-started policy), sharded like them, never updated, checkpointed beside the state; each RL batch
gets its log-probs (`ref_logprobs`, at the batch's sampling temperatures) for the loss's KL term. With `kl_coef ==
0` none of this exists. The policy step is jitted once per batch shape; its log-probs use the top-k / top-p of this
agent's sampler (the filters its behaviour log-probs were recorded under; temperatures come per row).

A LoRA agent (`agent.lora.rank > 0`, `mgrpo_jax.model.lora`) trains its adapters only: `state` holds the adapters
and their optimizer state, `base` the frozen base weights (never donated and not in the checkpoints: written once
beside the run's agent record, `mgrpo_jax.agent.export`, and rebuilt from the config on resume). Its KL reference
is the base with the adapters off (no copy), and the sampler gets base + adapters merged once per policy update
(`publish`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from mgrpo_jax.agent.optim import make_optimizer
from mgrpo_jax.agent.state import create_agent_state_from_params, merged_params, reset_lora_optimizer
from mgrpo_jax.agent.step import (
    POLICY_KEYS,
    SFT_KEYS,
    combine_metrics,
    make_logprob_fn,
    make_policy_step,
    make_sft_step,
    run_passes,
)
from mgrpo_jax.core.losses import resolve_loss_hparams
from mgrpo_jax.sampling import Sampler


@dataclasses.dataclass
class Learner:
    name: str
    config: ml_collections.ConfigDict  # the agent's config (`config.main`, `config.sub` or `config.single`)
    model_config: object
    mesh: object
    graphdef: object
    state: object
    sharding: object
    sampler: Sampler
    rules: Sequence = ()  # the sharding rules its parameters are laid out by (`agent.sharding_rules`)
    trainable: bool = True
    reference: object = None  # the frozen reference policy's parameters (kl_coef > 0 only)
    tokenizer: object = None  # its ChatTokenizer: the run's, or its `init_from` checkpoint's own
    base: object = None  # a LoRA agent's frozen base weights (a plain Transformer's state); None without LoRA
    lora: object = None  # its LoraSpec (mgrpo_jax.model.lora); None without LoRA
    policy_step: object = dataclasses.field(default=None, init=False, repr=False)  # the jitted RL step
    sft_step: object = dataclasses.field(default=None, init=False, repr=False)  # the warm start's (start_sft)
    _reference_logprobs: object = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.freeze_reference()
        self._build_steps()

    @property
    def version(self) -> int:
        """The policy's version: how many updates its state has taken."""
        return int(self.state.step)

    @property
    def loss_hparams(self) -> dict:
        """The hyper-parameters the policy step's loss runs with: its own defaults under the ones the config sets."""
        return resolve_loss_hparams(self.config.loss, self.config.loss_hparams.to_dict())

    @property
    def kl_coef(self) -> float:
        return float(self.loss_hparams.get("kl_coef") or 0.0)  # a loss without a KL term has none

    def freeze_reference(self) -> None:
        """The current parameters become the KL reference (a copy on the same shardings); no-op for kl_coef 0
        and for a LoRA agent, whose reference is its base."""
        if self.kl_coef > 0 and self.lora is None:
            self.reference = jax.tree.map(jnp.copy, self.state.params)

    @property
    def reference_params(self):
        """The KL reference's parameters (a plain Transformer's state), None for kl_coef 0."""
        if self.kl_coef <= 0:
            return None
        return self.base if self.lora is not None else self.reference

    def policy_params(self):
        """The current policy as a plain Transformer's state: a LoRA agent's base with its adapters merged."""
        if self.lora is None:
            return self.state.params
        return merged_params(self.state.params, self.base, self.lora.scale)

    def policy_model(self):
        """The current policy as a plain Transformer (what the sampler runs and an export writes)."""
        return nnx.merge(self.sampler.graphdef, self.policy_params())

    def checkpoint_items(self) -> dict:
        """What a checkpoint holds of this agent: `{name: state}` (a LoRA agent's: adapters and their optimizer state;
        its base is written once beside the run's agent record, `mgrpo_jax.agent.export.record_agents`), plus
        `{name}_reference` with a full fine-tuning agent's KL reference."""
        items = {self.name: self.state}
        if self.reference is not None:
            items[f"{self.name}_reference"] = self.reference
        return items

    def load_checkpoint_items(self, items: dict) -> None:
        self.state = items[self.name]
        if self.reference is not None:
            self.reference = items[f"{self.name}_reference"]
        self.publish()

    def publish(self) -> None:
        self.sampler.update_weights(self.policy_params())

    def reset_optimizer(self, optim_cfg) -> None:
        """Keep the parameters, start a fresh optimizer (warm start -> RL)."""
        if self.lora is not None:
            self.state, self.sharding = reset_lora_optimizer(self.state, self.sharding, optim_cfg)
        else:
            self.graphdef, self.state, self.sharding = create_agent_state_from_params(
                self.model_config, self.state.params, optim_cfg, self.mesh, self.rules)
        self.freeze_reference()
        self._build_steps()  # for the new state layout
        self.publish()

    def _build_steps(self) -> None:
        """The jitted policy step (and the KL reference's log-probs) for the current state; nothing compiles here."""
        cfg = self.config
        self.policy_step = make_policy_step(
            self.graphdef, make_optimizer(cfg.optim), cfg.loss, cfg.loss_hparams.to_dict(), self.sharding,
            self.mesh, micro_batches=cfg.micro_batches, top_k=self.sampler.top_k, top_p=self.sampler.top_p,
            router_aux_loss_coef=cfg.get("router_aux_loss_coef"), frozen=self.base)
        self._reference_logprobs = None
        if self.kl_coef > 0:
            graphdef, sharding = ((self.graphdef, self.sharding) if self.lora is None else  # the base: a plain model
                                  (self.sampler.graphdef, jax.tree.map(lambda x: x.sharding, self.base)))
            self._reference_logprobs = make_logprob_fn(
                graphdef, sharding, self.mesh,
                micro_batches=cfg.micro_batches, top_k=self.sampler.top_k, top_p=self.sampler.top_p)

    # -- the warm start ---------------------------------------------------------------------------------

    def start_sft(self, optim_cfg) -> None:
        """A fresh optimizer `optim_cfg` and the jitted supervised step for it (the warm start)."""
        self.reset_optimizer(optim_cfg)
        self.sft_step = make_sft_step(self.graphdef, make_optimizer(optim_cfg), self.sharding, self.mesh,
                                      router_aux_loss_coef=self.config.get("router_aux_loss_coef"), frozen=self.base)

    def sft_update(self, batch: dict) -> dict:
        """One supervised update on `batch` (`SFT_KEYS`); the sampler is not re-pointed (`publish` does that)."""
        self.state, metrics = self.sft_step(self.state, {k: batch[k] for k in SFT_KEYS})
        return metrics

    def restore_state(self, state) -> None:
        """A state restored from a checkpoint of the same layout; the sampler gets its weights."""
        self.state = state
        self.publish()

    # -- RL ---------------------------------------------------------------------------------------------

    def reference_logprobs(self, batch: dict) -> jax.Array:
        """[B, T] teacher-forced log-probs of the frozen reference on `batch`, under the batch's sampling
        temperatures and this agent's sampler filters (as the policy step computes the policy's)."""
        return self._reference_logprobs(self.reference_params, batch["tokens"], batch["positions"],
                                        batch["attention_mask"], batch["temperature"])

    def check_filters(self, batch: dict) -> None:
        """The batch's rows were drawn under this agent's sampler filters, which its policy step is compiled with
        (padding rows, of weight 0, are never read); otherwise the importance ratios would be off."""
        used = np.asarray(batch["weights"]) > 0
        for key, own in (("top_k", self.sampler.top_k), ("top_p", self.sampler.top_p)):
            if key in batch and used.any() and not np.allclose(np.asarray(batch[key])[used], own):
                raise ValueError(f"{self.name}: a batch drawn with {key} {sorted(set(np.asarray(batch[key])[used]))}"
                                 f" cannot train under this agent's policy step, compiled for {key}={own}")

    def train(self, batches) -> dict:
        """`passes` updates on each batch in turn (a dict, or a list of dicts: the unsynchronised sub-agent's
        FIFO chunks, oldest first), then new weights to the sampler. Returns each batch's last-pass metrics,
        combined over batches as the step combines its micro-batches (`step.combine_metrics`: `tokens` summed,
        `*_min` / `*_max` by min / max, the rest token-weighted), as `<agent>/train/<key>`."""
        batches = [batches] if isinstance(batches, dict) else list(batches)
        if not batches:
            return {}
        per_batch = []
        for batch in batches:
            self.check_filters(batch)
            train_batch = {k: batch[k] for k in POLICY_KEYS}
            if self.reference_params is not None:
                train_batch["ref_logprobs"] = self.reference_logprobs(train_batch)
            self.state, updates = run_passes(self.policy_step, self.state, train_batch, self.config.passes)
            per_batch.append(updates[-1] if updates else {})
        self.publish()
        per_batch = jax.device_get(per_batch)
        combined = per_batch[0] if len(per_batch) == 1 else combine_metrics(
            {k: np.asarray([m[k] for m in per_batch], np.float32) for k in per_batch[-1]})
        out = {f"{self.name}/train/{k}": float(v) for k, v in combined.items()}
        # The clip range, KL coefficient, ... in force, so a run's log shows which loss it really trained with.
        out.update({f"{self.name}/loss/{k}": float(v) for k, v in self.loss_hparams.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)})
        return out
