"""One agent as it learns: its model, mesh, train state and sampler, and its jitted train steps.

    learner.train(batch)            # `passes` policy updates on a fixed-size batch, then new weights to the sampler
    step = learner.sft_step(cfg)    # the warm start's supervised step under its own optimizer

Every train step donates the state, so the sampler is re-pointed at the new parameters after each update
(`publish`). With `loss_hparams.kl_coef > 0` the learner holds a frozen reference policy: a copy of the parameters
RL starts from (taken at construction and again at every optimizer reset, so after a warm start it is the
warm-started policy), sharded like them, never updated, checkpointed beside the state; each RL batch gets its
log-probs (`ref_logprobs`, at the batch's sampling temperatures) for the loss's KL term. With `kl_coef == 0` none
of this exists. The policy step is jitted once per batch shape; its log-probs use the top-k / top-p of this
agent's sampler (the filters its behaviour log-probs were recorded under; temperatures come per row).

A LoRA agent (`agent.lora.rank > 0`, `mgrpo_jax.model.lora`) trains its adapters only: `state` holds the adapters
and their optimizer state, `base` the frozen base weights (never donated and not in the checkpoints: written once
beside the run's agent record, `mgrpo_jax.train.export`, and rebuilt from the config on resume). Its KL reference
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

from mgrpo_jax.core.losses import loss_defaults
from mgrpo_jax.sampling import Sampler
from mgrpo_jax.train.optim import make_optimizer
from mgrpo_jax.train.state import create_agent_state_from_params, merged_params, reset_lora_optimizer
from mgrpo_jax.train.step import make_logprob_fn, make_policy_step, make_sft_step, set_hparams

# `temperature`: each row's sampling temperature, so the step's log-probs are those of the behaviour
# distribution (mgrpo_jax/train/step.py); every policy batch carries it.
TRAIN_KEYS = ("tokens", "positions", "attention_mask", "loss_mask", "old_logprobs", "advantages", "weights",
              "temperature")
SFT_KEYS = ("tokens", "positions", "attention_mask", "loss_mask", "weights")


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
    _policy_step: object = dataclasses.field(default=None, repr=False)
    _reference_logprobs: object = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        self.freeze_reference()

    @property
    def loss_hparams(self) -> dict:
        """The hyper-parameters the policy step's loss runs with: its own defaults under the ones the config sets."""
        return {**loss_defaults(self.config.loss), **set_hparams(self.config.loss_hparams.to_dict())}

    @property
    def kl_coef(self) -> float:
        return float(self.config.loss_hparams.get("kl_coef") or 0.0)

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
        its base is written once beside the run's agent record, `mgrpo_jax.train.export.record_agents`), plus
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
        self._policy_step = self._reference_logprobs = None  # built for the old state layout
        self.freeze_reference()
        self.publish()

    def sft_step(self, optim_cfg):
        """A jitted supervised step for the current state, whose optimizer must be `optim_cfg`'s."""
        return make_sft_step(self.graphdef, make_optimizer(optim_cfg), self.sharding, self.mesh,
                             router_aux_loss_coef=self.config.get("router_aux_loss_coef"), frozen=self.base)

    @property
    def policy_step(self):
        """The jitted policy step (built on first use, kept until the optimizer is reset)."""
        if self._policy_step is None:
            cfg = self.config
            self._policy_step = make_policy_step(
                self.graphdef, make_optimizer(cfg.optim), cfg.loss, cfg.loss_hparams.to_dict(), self.sharding,
                self.mesh, micro_batches=cfg.micro_batches, top_k=self.sampler.top_k, top_p=self.sampler.top_p,
                router_aux_loss_coef=cfg.get("router_aux_loss_coef"), frozen=self.base)
        return self._policy_step

    @policy_step.setter
    def policy_step(self, step) -> None:  # e.g. a timing wrapper (mgrpo_jax/bench/rollout.py)
        self._policy_step = step

    def reference_logprobs(self, batch: dict) -> jax.Array:
        """[B, T] teacher-forced log-probs of the frozen reference on `batch`, under the batch's sampling
        temperatures and this agent's sampler filters (as the policy step computes the policy's)."""
        params = self.reference_params
        if self._reference_logprobs is None:
            graphdef, sharding = ((self.graphdef, self.sharding) if self.lora is None else  # the base: a plain model
                                  (self.sampler.graphdef, jax.tree.map(lambda x: x.sharding, params)))
            self._reference_logprobs = make_logprob_fn(
                graphdef, sharding, self.mesh,
                micro_batches=self.config.micro_batches, top_k=self.sampler.top_k, top_p=self.sampler.top_p)
        return self._reference_logprobs(params, batch["tokens"], batch["positions"], batch["attention_mask"],
                                        batch["temperature"])

    def train(self, batches) -> dict:
        """`passes` updates on each batch in turn (a dict, or a list of dicts: the unsynchronised sub-agent's
        FIFO chunks, oldest first), then new weights to the sampler. Returns each batch's last-pass metrics,
        combined over batches (`*_min` / `*_max` by min / max, `tokens` summed, the rest averaged), as
        `<agent>/train/<key>`."""
        batches = [batches] if isinstance(batches, dict) else list(batches)
        if not batches:
            return {}
        step = self.policy_step
        per_batch = []
        for batch in batches:
            train_batch = {k: batch[k] for k in TRAIN_KEYS}
            if self.reference_params is not None:
                train_batch["ref_logprobs"] = self.reference_logprobs(train_batch)
            metrics = {}
            for _ in range(self.config.passes):
                self.state, metrics = step(self.state, train_batch)
            per_batch.append(metrics)
        self.publish()
        out = {f"{self.name}/train/{k}": v for k, v in combine_metrics(jax.device_get(per_batch)).items()}
        # The clip range, KL coefficient, ... in force, so a run's log shows which loss it really trained with.
        out.update({f"{self.name}/loss/{k}": float(v) for k, v in self.loss_hparams.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)})
        return out


def combine_metrics(per_batch: Sequence[dict]) -> dict[str, float]:
    out = {}
    for k in per_batch[-1]:
        values = [float(m[k]) for m in per_batch]
        if k.endswith("_min"):
            out[k] = min(values)
        elif k.endswith("_max"):
            out[k] = max(values)
        elif k == "tokens":
            out[k] = sum(values)
        else:
            out[k] = values[0] if len(values) == 1 else float(np.mean(values))
    return out
