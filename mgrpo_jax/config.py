"""The run configuration: one ml_collections ConfigDict. This module holds the defaults and the checks.

  base_config(benchmark)   the defaults, every field with its meaning;
  validate(config, job)    every check the config alone allows (names, sizes, micro-batch splits, the decoupled
                           jobs' needs), reported together in one ValueError; `mgrpo_jax.rl.run.run` calls
                           it before building anything;
  get_config(benchmark, preset)  the config of `benchmark` for "preset[,mode]" (`resolve`).

The presets every benchmark shares live in the package, `mgrpo_jax/presets.py` (smoke, local, figures, paper,
paper_dense, paper_lora), and `get_config` resolves them. The experiment files (`experiments/xbench.py`,
`gaia.py`, `webwalker.py`), what users pass to `launch/tpu_run.py --config=experiments/xbench.py:local,frozen_sub`,
start their tables from that one and call `resolve` too, so `get_config(b, arg)` and `experiments/<b>.py`'s
`get_config(arg)` give the same config. Nothing in the package loads experiments/ (mgrpo_jax/presets.py says why).

Modes (`config.mode`): mgrpo | frozen_sub | single_agent | mgrpo_unsync | matpo | shared_mgrpo
(mgrpo_jax/rl/trainer.py says what each trains). The last two are the shared-policy modes: one model serves both
agents (built from `config.main`; `sub` keeps only its agent's limits) and trains on both agents' rows pooled into one
batch; their credit assignment is MATPO's and M-GRPO's (`credit_name`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import re
import urllib.parse
from collections.abc import Callable, Mapping

import ml_collections
from ml_collections.config_dict import placeholder

from mgrpo_jax import presets

MODES = ("mgrpo", "frozen_sub", "single_agent", "mgrpo_unsync", "matpo", "shared_mgrpo")
SHARED_MODES = ("matpo", "shared_mgrpo")  # one model, one optimizer, both agents (mgrpo_jax/agent/build.py)


def agent_names(mode: str) -> tuple[str, ...]:
    """The agents of `mode`'s rollouts: the single agent, or the main agent and its sub-agent."""
    return ("single",) if mode == "single_agent" else ("main", "sub")


# The credit assignment (mgrpo_jax/core/credit.py) a mode uses when `config.credit` is empty.
MODE_CREDIT = {"matpo": "matpo"}
DEFAULT_CREDIT = "mgrpo"
CREDIT_ALIASES = {"mgrpo_targets": "mgrpo"}  # the registry's earlier name of M-GRPO's credit, still accepted
# MATPO's loss (its public code, mgrpo_jax/core/matpo.py names the files): clipped PPO at 0.2 / 0.2 with verl's dual
# clip at 3.0 on negative advantages (`clip_ratio_c`), one token mean over planner and worker tokens, no KL. The
# matpo mode's shared model (`main`) trains with it under `loss_recipe="mode"` (`trained_section`).
MATPO_LOSS_HPARAMS = {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0, "aggregation": "token-mean", "kl_coef": 0.0}
# `config.loss_recipe`: "mode" -- the matpo mode trains with MATPO's loss (MATPO_LOSS_HPARAMS in the hyper-parameters
# `main.loss_hparams` leaves unset), every other mode with its agents' own; "default" -- every mode with its agents'
# own loss settings (the grpo defaults unless set), so the shared-model cells of the 2 x 2 differ in credit alone.
LOSS_RECIPES = ("mode", "default")
# `rollout.shared_role_weighting`, how a shared model's pooled batch weighs its two roles (mgrpo_jax/rl/sides.py):
# "per_role" -- each role's loss normalised by its own denominator (rows or tokens, by the loss's aggregation), the
# two averaged, as two distinct models would weigh them; "pooled" -- one mean over every row or token of the batch
# (MATPO's code), where the role with more rows or tokens weighs more.
ROLE_WEIGHTINGS = ("per_role", "pooled")
PRESETS = tuple(presets.PRESETS)
PAGED_ATTENTIONS = ("gather", "pallas")  # rollout.paged_attention (mgrpo_jax/sampling/paged.py: ATTENTIONS)
BENCHMARKS = ("xbench", "gaia", "webwalker")
SEARCH_ORDERS = ("per_twin", "world")  # env.compact.search_order (mgrpo_jax/env/compact/world.py: SEARCH_ORDERS)
DECAYS = ("cosine", "linear", "constant")  # learning-rate schedules after the warm-up (mgrpo_jax/agent/optim.py)


def _agent(model: str, *, context_tokens: int, max_turns: int, lr: float) -> ml_collections.ConfigDict:
    agent = ml_collections.ConfigDict()
    agent.model = model  # a preset of mgrpo_jax.model.shapes.get_model_config
    agent.model_overrides = ml_collections.ConfigDict()
    agent.init_from = ""  # a Hugging Face checkpoint directory (safetensors + config.json), optional
    # -1: the rest; `expert`: expert parallelism of mixture-of-experts models (mgrpo_jax/model/moe.py)
    agent.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1, "expert": 1})
    # How parameters and activations map onto the mesh axes: a rule set of mgrpo_jax.model.sharding.RULE_SETS
    # (default: FSDP over `fsdp` plus tensor parallelism over `tensor`).
    agent.sharding_rules = "default"
    # Weight of the MoE router's load-balancing loss in the train steps (unset: the model's router_aux_loss_coef;
    # dense models have no router and ignore it).
    agent.router_aux_loss_coef = ml_collections.config_dict.placeholder(float)
    agent.context_tokens = context_tokens  # episode budget; also the train step's sequence length
    agent.max_turns = max_turns
    agent.micro_batches = 1
    agent.decode_phases = 1  # the sampler's decode loop in this many phases over growing caches (sampling)
    # Decode slots of the agent's sampler in the rollout engine (mgrpo_jax/rollout/engine.py): each holds one episode's
    # KV cache across its turns. 0: one per episode that can be live at once (Q*K); fewer save cache memory and
    # cost a re-prefill whenever a parked episode gives its slot up.
    agent.rollout_slots = 0
    # Blocks of the paged KV store of its decode slots (with rollout.kv_block_size > 0): 0 holds as many tokens as
    # the contiguous slots would (rollout_slots x context_tokens); fewer bound the rollout's KV memory, the engine
    # evicting idle episodes (they prefill again) when a turn finds too few.
    agent.rollout_kv_blocks = 0
    agent.warmstart_steps = 0  # supervised warm-start steps of this agent (0: warmstart.steps)
    agent.passes = 1  # PPO-style optimisation passes (mu) over each RL batch
    agent.loss = "grpo"  # a name registered in mgrpo_jax.core.losses (register_loss)
    # The loss's keyword arguments, all unset (None) here: the loss's registration holds their defaults
    # (`mgrpo_jax.core.losses.loss_defaults(name)`) and a value set here overrides its own (`resolve_loss_hparams`).
    # The fields exist so command-line overrides are typed. kl_coef > 0 builds a frozen reference policy (the agent's
    # initial weights) whose log-probs the loss's KL term (kl_estimator) uses.
    agent.loss_hparams = ml_collections.ConfigDict(
        {"eps_low": placeholder(float), "eps_high": placeholder(float), "aggregation": placeholder(str),
         "ratio_level": placeholder(str), "dual_clip": placeholder(float), "max_tokens": placeholder(int),
         "kl_coef": placeholder(float), "kl_estimator": placeholder(str)})
    agent.optim = ml_collections.ConfigDict(
        {"lr": lr, "warmup_steps": 0, "decay": "constant", "total_steps": 0, "b1": 0.9, "b2": 0.98,
         "weight_decay": 0.1, "grad_clip_norm": 1.0})
    # LoRA adapters per agent (mgrpo_jax/model/lora.py; README "LoRA"): rank 0 = full fine-tuning. With rank > 0 only
    # the adapters (scale alpha / rank) on the projections whose path `layers/<q|k|v|o|gate|up|down>` the regular
    # expression `target` matches train; the base weights stay frozen. dropout must be 0 (deterministic log-probs).
    agent.lora = ml_collections.ConfigDict({"rank": 0, "alpha": 16.0, "target": ".", "dropout": 0.0})
    agent.sft = ml_collections.ConfigDict(
        {"lr": 3e-3, "warmup_steps": 10, "decay": "cosine", "total_steps": 0, "b1": 0.9, "b2": 0.98,
         "weight_decay": 0.0, "grad_clip_norm": 1.0})
    return agent


def base_config(benchmark: str = "xbench") -> ml_collections.ConfigDict:
    if benchmark not in BENCHMARKS:
        raise ValueError(f"benchmark={benchmark!r} is not one of {BENCHMARKS}")
    c = ml_collections.ConfigDict()
    c.preset = "local"
    c.benchmark = benchmark
    c.mode = "mgrpo"
    c.seed = 0
    c.stage = "stage1"  # which training split: stage1 (format + 1 hop) or stage2 (multi-hop, filtered)
    c.init_checkpoint = ""  # a workdir whose latest checkpoint starts this run (stage 2 from stage 1)

    c.env = ml_collections.ConfigDict()
    c.env.seed = 0
    # The turn grammar and its world (mgrpo_jax/env/grammar.py): `chat` (Qwen-style tags, JSON calls; the offline
    # world of pages; pretrained checkpoints) or `compact` (one token per tag, argument and value; the compact world
    # of mgrpo_jax/env/compact, which agents under 1M parameters learn on a CPU).
    c.env.grammar = "chat"
    c.env.compact = ml_collections.ConfigDict({"n_names": 160, "n_orgs": 40, "n_countries": 10, "search_results": 3,
                                               "search_order": "per_twin"})
    # The compact experts' mistakes (mgrpo_jax/env/compact/experts.py CompactNoise). Decided from the design, never
    # tuned on evaluation numbers: at rate 0.7 a mistake is the greedy majority action (a clone copies it) while 3 in
    # 10 sampled actions are the one-token fix; on about half of the relevant fact types, so clones are right on the
    # other half and rewards vary within a group.
    c.env.compact_noise = ml_collections.ConfigDict(
        {"rate": 0.7, "wrong_kind_facts": 0.5, "wrong_entity_facts": 0.5, "skip_calc_facts": 0.5})
    c.env.n_entities = 2000
    c.env.background_sentences = 26
    c.env.snippet_chars = 300
    c.env.search_top_k = 5
    c.env.sizes = ml_collections.ConfigDict(
        {"stage1": 2000, "stage2": 2000, "validation": 200, "eval_gaia": 165, "eval_xbench": 100,
         "eval_webwalker": 680, "fresh": 0})
    # Systematic expert noise (fractions of fact types / entities / question kinds the experts get wrong).
    c.env.noise = ml_collections.ConfigDict()
    # Stage 2 keeps the questions the starting system (stage-1 checkpoint) solves at most this often, estimated
    # from `stage2_filter_samples` rollouts of each of the first `stage2_filter_pool` questions (1.0: keep all).
    c.env.stage2_max_success = 0.5
    c.env.stage2_filter_pool = 256
    c.env.stage2_filter_samples = 4
    # A `curriculum.json` another run's filter wrote (one question pool per world, shared by every stage-2 lineage
    # of it): this run trains on exactly its kept ids and filters nothing. Empty: filter here.
    c.env.curriculum_file = ""
    # Real services (README, "Real search, reader and judge services"); empty URLs: the offline world's own. API keys
    # are read from the environment variables named here, never from the config (it is saved with the run).
    c.env.search_url = ""  # a JSON search API (HttpSearchBackend); empty: the offline world's BM25
    c.env.search_api_key_env = "MGRPO_SEARCH_API_KEY"
    c.env.visit_url = ""  # a page reader for `visit` (HttpPageBackend; `{url}` in it is replaced by the page's URL)
    c.env.visit_api_key_env = "MGRPO_VISIT_API_KEY"
    c.env.visit_max_chars = 0  # a read page is cut to this; 0: the agent's whole context (context_tokens x 4 chars)
    c.env.judge_url = ""  # an OpenAI-compatible endpoint (http://host:port/v1) for r_correct and r_expert
    c.env.judge_model = ""
    c.env.judge_api_key_env = "MGRPO_JUDGE_API_KEY"
    c.env.judge_concurrency = 16  # judge requests in flight at once
    c.env.judge_max_tokens = 512
    c.env.http_timeout_s = 60.0  # per attempt, for search, reader and judge requests
    c.env.http_max_attempts = 4  # tries of a request that fails with a timeout, a lost connection, 408/429/5xx
    c.env.http_backoff_s = 1.0  # the first retry's delay; doubled per retry up to 16 s
    c.env.benchmark_path = ""  # real benchmark files for evaluation (formats: mgrpo_jax/env/benchmarks.py)

    c.tokenizer = ml_collections.ConfigDict({"path": "", "vocab_size": 2048})
    # Pieces may span words, so the recurring prompt and protocol phrases compress to a few tokens.
    c.tokenizer.trainer_kwargs = ml_collections.ConfigDict(
        {"split_by_whitespace": False, "max_sentencepiece_length": 64})

    c.main = _agent("tiny", context_tokens=1024, max_turns=8, lr=1e-4)
    c.sub = _agent("tiny", context_tokens=1024, max_turns=6, lr=1e-4)
    c.single = _agent("tiny", context_tokens=2048, max_turns=12, lr=1e-4)

    c.rollout = ml_collections.ConfigDict()
    c.rollout.queries = 8  # Q questions per step
    c.rollout.samples = 8  # K rollouts per question
    c.rollout.d_max = 8  # D aligned sub-trajectory slots per rollout
    c.rollout.align_mode = "duplicate"  # or "mask"
    c.rollout.max_turn_tokens = 128
    c.rollout.max_sub_calls = 16
    c.rollout.temperature = 1.0
    c.rollout.unsync_chunk = 64  # mgrpo_unsync: sub-trajectories per FIFO pop
    # mgrpo_unsync's pop rule (mgrpo_jax/rl/unsync.py): "chunks" trains on every full chunk waiting (the released
    # code); "step" trains once per step on every record the previous step pushed, in the synchronised mode's batch
    # (Q*K*D rows, weight-0 padding): the same updates on the same number of trajectories, one step late.
    c.rollout.unsync_pop = "chunks"
    # The share of RL steps whose questions are posed in a counterfactual twin of the compact world (the same texts,
    # the twin's facts and answers; one twin per step): rewards then pay for reading the tools, never for a memory
    # of the world's facts. Evaluation always uses the world itself.
    c.rollout.counterfactual_share = 0.0
    # Paged KV for the rollout engine's decode slots (mgrpo_jax/sampling/paged.py): blocks of this many tokens, each
    # episode holding the blocks its length needs, full blocks of a common prefix (a query's K rollouts' prompt, the
    # sub-agent's system prompt) stored once. 0: each slot a KV row of the whole context budget.
    c.rollout.kv_block_size = 0
    # The paged decode's attention: "gather" (the blocks gathered into the contiguous layout, any backend) or "pallas"
    # (JAX's Pallas paged-attention kernel over the block tables, for TPUs; interpreted elsewhere, slowly).
    c.rollout.paged_attention = "gather"
    # A shared-policy mode's weights of its two roles in the pooled batch: "per_role" (each role normalised by its own
    # denominator, the two averaged) or "pooled" (one mean over both, as MATPO's code); ROLE_WEIGHTINGS says more.
    c.rollout.shared_role_weighting = "per_role"

    c.rewards = ml_collections.ConfigDict({"alpha": (0.1, 0.9), "beta": (0.1, 0.4, 0.5)})
    # MATPO's planner reward (credit "matpo", mgrpo_jax/core/matpo.py): weights of correctness and of the format term.
    c.rewards.matpo_correct_weight = 0.9
    c.rewards.matpo_format_weight = 0.1
    # How a step's judged rollouts become both agents' rewards and advantages: a name registered in
    # mgrpo_jax/core/credit.py (`available_credits`); empty: the mode's own (matpo for the matpo mode, mgrpo
    # for every other).
    c.credit = ""
    # Which loss settings the modes train with: "mode" (the matpo mode: MATPO's, MATPO_LOSS_HPARAMS) or "default"
    # (every mode: its agents' own); LOSS_RECIPES says more.
    c.loss_recipe = "mode"
    c.advantages = ml_collections.ConfigDict({"scale": "group", "baseline": "mean", "eps": 1e-6})
    # The estimator of both levels' advantages: a name registered in mgrpo_jax.core.advantages (register_advantage);
    # it receives the other `advantages.*` fields as keyword arguments. "grpo": group-relative (scale, baseline).
    c.advantages.estimator = "grpo"

    c.warmstart = ml_collections.ConfigDict()
    c.warmstart.steps = 200  # supervised steps per agent on the scripted experts' transcripts (0: skip)
    c.warmstart.batch_size = 16
    c.warmstart.examples = 512  # demonstration episodes per agent
    # The warm start stops early once greedy decoding keeps the protocol on this share of `format_questions` training
    # questions for every agent (checked every `check_every` steps; 0 disables the check: always `steps`)...
    c.warmstart.format_target = 0.95
    c.warmstart.min_steps = 0  # ... but not before this many steps
    c.warmstart.check_every = 0
    c.warmstart.format_questions = 64
    # The share of demonstrations drawn in counterfactual twins of the compact world (its names and questions, its
    # facts drawn again: mgrpo_jax/env/compact/world.py): a clone can then answer only by reading its tools.
    c.warmstart.counterfactual_share = 0.0
    # Warm-start checkpoints (<workdir>/warmstart_checkpoints) every this many steps, counted over all agents, and on
    # preemption: a resumed run continues the warm start from there. Dropped once the first RL checkpoint exists.
    c.warmstart.checkpoint_every = 50

    c.train = ml_collections.ConfigDict()
    c.train.steps = 50  # RL steps
    c.train.eval_every = 10
    c.train.eval_runs = 3  # avg@3
    c.train.eval_questions = 30  # per evaluation set (0: the whole set)
    c.train.eval_at_start = False  # also evaluate the starting point (step 0) of a fresh run
    # The question sets an evaluation scores, comma-separated: the held-out sets, `validation`, and `fresh` (new
    # questions of the training distribution: the yardstick of the transfer gap).
    c.train.eval_sets = "eval_gaia,eval_xbench,eval_webwalker"
    # Also score every set with each tool answering "none" (`eval_blind/<set>/accuracy`): the answers a system gives
    # from memory alone, the control that its held-out answers come from reading the tools.
    c.train.eval_blind = False
    c.train.checkpoint_every = 10
    c.train.log_transcripts = 2

    c.store = "memory://mgrpo"  # memory:// | file:///path | gs://bucket/prefix

    # Decoupled mode (--role=main / --role=sub, two jobs sharing only `store`; mgrpo_jax/rl/decoupled.py).
    c.decoupled = ml_collections.ConfigDict()
    c.decoupled.timeout_s = 3600.0  # longest wait on the other job or the store (tokenizer, answers, commits, pops)
    c.decoupled.max_lag = 1  # the main job starts step s once the sub job has trained step s - max_lag
    c.decoupled.worker = "sub_0"  # the sub job's name on its task claims
    # How many RL steps of exchange data (tasks, answers, commits) the store keeps before garbage collection; at
    # least max_lag + 1, since the main job at step s may still read what the sub job wrote at step s - max_lag.
    c.decoupled.keep_steps = 4

    # Asynchronous M-GRPO (mgrpo_jax/rl/asynchronous.py, docs/async.md): a sampler thread keeps rolling out the next
    # steps' questions with the newest weights it holds while the learners train on finished groups.
    c.async_rl = ml_collections.ConfigDict()
    c.async_rl.enabled = False
    # Policy versions (RL updates) between sampling a token and training on it, at most; the sampler waits before a
    # step that would exceed it. 0: step s is sampled after update s - 1, as the synchronous step does.
    c.async_rl.max_staleness = 1
    # An episode in flight when new weights arrive: "continue" (its next tokens are sampled under them, each token
    # tagged with its version) or "restart" (the step's rollouts are sampled again from the start under them).
    c.async_rl.partial_rollouts = "continue"
    # How stale tokens are trained: "decoupled" (decoupled PPO: the clip is centred on the proximal policy, the
    # learner's weights before the update, and each stale token weighted by min(pi_prox / pi_behaviour, is_cap),
    # truncated importance sampling) or "none" (the recorded behaviour log-probs as they are: PPO's clip alone).
    c.async_rl.correction = "decoupled"
    c.async_rl.is_cap = 2.0
    # Devices of each agent's share that sample (taken from the end of its devices; the rest train). 0: the sampler
    # uses the learner's devices (its weights still a copy, so an update never donates what a rollout reads).
    c.async_rl.rollout_devices = 0
    return c


def default_preset() -> str:
    """`local` on a machine without accelerators, `paper` on TPU."""
    import jax

    return "paper" if jax.default_backend() == "tpu" else "local"


# ---- presets by name ----


def resolve(benchmark: str, table: Mapping[str, Callable], arg: str | None = None) -> ml_collections.ConfigDict:
    """The config of `benchmark` for `arg` = "preset" or "preset,mode" from `table` (name -> a function editing the
    defaults in place, e.g. `mgrpo_jax.presets.PRESETS`). None: `default_preset()`, mode mgrpo."""
    name, _, mode = (arg or default_preset()).partition(",")
    if name not in table:
        raise ValueError(f"unknown preset {name!r}; presets are {tuple(table)}")
    c = base_config(benchmark)
    c.preset = name
    if mode:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; modes are {MODES}")
        c.mode = mode
    table[name](c)
    return c


def get_config(benchmark: str = "xbench", preset: str | None = None) -> ml_collections.ConfigDict:
    """`benchmark`'s config for `preset` (default `local`), which may carry a mode after a comma, e.g.
    "local,frozen_sub"; the same as `experiments/<benchmark>.py`'s `get_config(preset)`."""
    return resolve(benchmark, presets.PRESETS, preset or "local")


# ---- validate ----

STAGES = ("stage1", "stage2")
JOBS = ("colocated", "main", "sub")  # --role: the job a process runs
TWO_AGENT_MODES = ("mgrpo", "frozen_sub", "mgrpo_unsync")  # the modes --role=main / --role=sub can split
# Sections whose keys are free (model fields, loss keyword arguments, noise and tokenizer-trainer settings): their
# keys are not compared with the defaults' (the model's are checked against ModelConfig).
OPEN_SECTIONS = ("model_overrides", "loss_hparams", "noise", "trainer_kwargs")
_MISSING = object()


def _did_you_mean(value, options) -> str:
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class _Problems:
    """Collects the problems of one config; each names its field."""

    def __init__(self, config):
        self.config = config
        self.found: list[str] = []

    def add(self, field: str, value, message: str) -> None:
        self.found.append(f"{field}={value!r}: {message}")

    def get(self, field: str):
        node = self.config
        for part in field.split("."):
            try:
                node = node[part]
            except (KeyError, AttributeError, TypeError):
                self.found.append(f"{field}: missing")
                return _MISSING
        return node

    def choice(self, field: str, options, hint: str = "") -> None:
        value = self.get(field)
        if value is not _MISSING and value not in options:
            self.add(field, value, f"not one of {', '.join(map(str, options))}{hint}{_did_you_mean(value, options)}")

    def number(self, field: str, low=None, high=None, *, above=None):
        """The value if it is a number within [low, high] (and > above); else reports it and returns None."""
        value = self.get(field)
        if value is _MISSING:
            return None
        bounds = [f">= {low}" if low is not None else "", f"> {above}" if above is not None else "",
                  f"<= {high}" if high is not None else ""]
        is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        ok = is_number and (low is None or value >= low) and (high is None or value <= high)
        ok = ok and (above is None or value > above)
        if not ok:
            kind = "must be " if is_number else "must be a number "
            self.add(field, value, kind + " and ".join(filter(None, bounds)))
            return None
        return value


def _both_sections(a, b) -> bool:
    return isinstance(a, ml_collections.ConfigDict) and isinstance(b, ml_collections.ConfigDict)


def _unknown_fields(problems: _Problems, config, reference, prefix: str = "") -> None:
    """Fields of `config` the defaults do not have (a misspelling set in code adds a new field silently)."""
    for key in config.keys():
        if key not in reference:
            close = difflib.get_close_matches(key, list(reference.keys()), n=1, cutoff=0.6)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
            problems.found.append(f"{prefix + key}: unknown field{hint}")
        elif key not in OPEN_SECTIONS and _both_sections(config[key], reference[key]):
            _unknown_fields(problems, config[key], reference[key], f"{prefix + key}.")


def _check_model(p: _Problems, name: str) -> None:
    from mgrpo_jax.model.shapes import PRESETS as MODEL_PRESETS
    from mgrpo_jax.model.shapes import ModelConfig, get_model_config

    model, overrides = p.get(f"{name}.model"), p.get(f"{name}.model_overrides")
    if model is _MISSING or overrides is _MISSING:
        return
    overrides = dict(overrides.to_dict() if isinstance(overrides, ml_collections.ConfigDict) else overrides)
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    for key in [k for k in overrides if k not in fields]:
        p.found.append(f"{name}.model_overrides.{key}: not a field of ModelConfig{_did_you_mean(key, fields)}")
        del overrides[key]
    try:
        get_model_config(model, **{"vocab_size": 256, **overrides})  # the tokenizer's vocabulary, at build time
    except ValueError as e:
        if "unknown model preset" in str(e):
            p.add(f"{name}.model", model, f"unknown model preset{_did_you_mean(model, MODEL_PRESETS)}")
        else:
            p.add(f"{name}.model_overrides", overrides, str(e))
    except TypeError as e:  # a field of the wrong type
        p.add(f"{name}.model_overrides", overrides, str(e))


def _check_agent(p: _Problems, name: str) -> None:
    from mgrpo_jax.core.losses import AGGREGATIONS, KL_ESTIMATORS, RATIO_LEVELS, available_losses
    from mgrpo_jax.model.sharding import RULE_SETS

    p.choice(f"{name}.loss", available_losses(),
             hint=" (a loss defined in your own file is registered by --loss_module=FILE)")
    p.choice(f"{name}.sharding_rules", tuple(RULE_SETS))
    _check_model(p, name)
    for field in ("context_tokens", "max_turns", "micro_batches", "decode_phases", "passes"):
        p.number(f"{name}.{field}", 1)
    p.number(f"{name}.warmstart_steps", 0)
    p.number(f"{name}.rollout_slots", 0)
    p.number(f"{name}.rollout_kv_blocks", 0)
    if p.get(f"{name}.router_aux_loss_coef") is not None:
        p.number(f"{name}.router_aux_loss_coef", 0)
    mesh = p.get(f"{name}.mesh")
    if mesh is not _MISSING:
        sizes = dict(mesh.items())
        for axis, size in sizes.items():
            if not isinstance(size, numbers.Integral) or not (size == -1 or size >= 1):
                p.add(f"{name}.mesh.{axis}", size, "must be a positive device count or -1 (the remaining devices)")
        if list(sizes.values()).count(-1) > 1:
            p.add(f"{name}.mesh", sizes, "at most one axis may be -1")
    hparams = p.get(f"{name}.loss_hparams")
    if hparams is not _MISSING:
        if hparams.get("aggregation") is not None:
            p.choice(f"{name}.loss_hparams.aggregation", AGGREGATIONS)
        if hparams.get("ratio_level") is not None:
            p.choice(f"{name}.loss_hparams.ratio_level", RATIO_LEVELS)
        for key in ("eps_low", "eps_high", "kl_coef", "max_tokens"):
            if hparams.get(key) is not None:
                p.number(f"{name}.loss_hparams.{key}", 0)
        if hparams.get("dual_clip") is not None:
            p.number(f"{name}.loss_hparams.dual_clip", above=1)
        if hparams.get("kl_estimator") is not None:
            p.choice(f"{name}.loss_hparams.kl_estimator", KL_ESTIMATORS)
    _check_lora(p, name)
    for optim in ("optim", "sft"):
        p.choice(f"{name}.{optim}.decay", DECAYS)
        p.number(f"{name}.{optim}.lr", 0)
        p.number(f"{name}.{optim}.warmup_steps", 0)
        p.number(f"{name}.{optim}.total_steps", 0)
        p.number(f"{name}.{optim}.weight_decay", 0)
        p.number(f"{name}.{optim}.grad_clip_norm", 0)
        for beta in ("b1", "b2"):
            value = p.number(f"{name}.{optim}.{beta}", 0)
            if value is not None and value >= 1:
                p.add(f"{name}.{optim}.{beta}", value, "must be < 1")


def _check_lora(p: _Problems, name: str) -> None:
    from mgrpo_jax.model.lora import lora_spec

    if p.get(f"{name}.lora") is _MISSING:
        return
    rank = p.number(f"{name}.lora.rank", 0)  # an int field: ml_collections refuses 2.5
    alpha = p.number(f"{name}.lora.alpha", above=0)
    dropout = p.number(f"{name}.lora.dropout", 0)
    if dropout:
        p.add(f"{name}.lora.dropout", dropout, "only 0 is supported (recorded log-probs must be reproducible)")
    if rank and alpha is not None and not dropout:
        try:
            lora_spec(p.get(f"{name}.lora"))
        except ValueError as e:
            p.add(f"{name}.lora.target", p.get(f"{name}.lora.target"), str(e).split(": ", 1)[-1])


def recipe_loss_hparams(config) -> dict:
    """The loss hyper-parameters `config.loss_recipe` puts under the shared model's own settings: MATPO's
    (`MATPO_LOSS_HPARAMS`) for the matpo mode under "mode", none otherwise."""
    if config.mode == "matpo" and config.get("loss_recipe", "mode") == "mode":
        return dict(MATPO_LOSS_HPARAMS)
    return {}


def trained_section(config, name: str) -> ml_collections.ConfigDict:
    """Agent section `name` as its learner trains with it: `config[name]`, or, where the loss recipe sets hyper-
    parameters (`recipe_loss_hparams`), a copy with them in the ones the section leaves unset (None), so a value set
    on the command line still wins. Read at build time, so `--config.loss_recipe=default` takes effect."""
    recipe = recipe_loss_hparams(config) if name == "main" else {}
    section = config[name]
    if not any(section.loss_hparams.get(key) is None for key in recipe):
        return section
    section = section.copy_and_resolve_references()  # typed fields kept; config[name] untouched
    for key, value in recipe.items():
        if section.loss_hparams.get(key) is None:
            section.loss_hparams[key] = value
    return section


def credit_name(config) -> str:
    """The credit assignment of `config`'s run: `config.credit`, else its mode's (`MODE_CREDIT`)."""
    name = config.get("credit") or MODE_CREDIT.get(config.mode, DEFAULT_CREDIT)
    return CREDIT_ALIASES.get(name, name)


def rl_batch_fields(mode: str, agent: str, unsync_pop: str = "chunks",
                    credit: str = DEFAULT_CREDIT) -> tuple[str, ...]:
    """The config fields whose product is the row count of one RL batch of `agent`'s rows (a shared-policy mode's
    model trains on the main rows and the sub rows together: `rl_batch_rows` adds the two)."""
    if agent == "sub":
        if mode == "mgrpo_unsync" and unsync_pop == "chunks":
            return ("rollout.unsync_chunk",)  # one FIFO pop of sub-trajectories
        if credit == "matpo":  # one row per possible call, padding rows of weight 0 (mgrpo_jax/core/matpo.py)
            return ("rollout.queries", "rollout.samples", "rollout.max_sub_calls")
        return ("rollout.queries", "rollout.samples", "rollout.d_max")  # Q*K rollouts x D aligned slots
    return ("rollout.queries", "rollout.samples")  # Q*K episodes


def rl_batch_rows(config, agent: str) -> int:
    """Rows of one RL batch of `agent`'s policy step; the warm start's batches have `warmstart.batch_size`. In a
    shared-policy mode the one model (`main`) trains on the main rows and the sub rows in one batch."""
    def rows(name: str) -> int:
        fields = rl_batch_fields(config.mode, name, _unsync_pop(config), credit_name(config))
        return math.prod(_field(config, field) for field in fields)

    if config.mode in SHARED_MODES and agent == "main":
        return rows("main") + rows("sub")
    return rows(agent)


def _unsync_pop(config) -> str:
    return config.rollout.get("unsync_pop", "chunks") if "rollout" in config else "chunks"


def _field(config, name: str):
    for part in name.split("."):
        config = config[part]
    return config


def _check_micro_batches(p: _Problems, name: str, mode) -> None:
    """Every batch of the agent's train steps (`mgrpo_jax.agent.build.batch_rows`) splits into its micro-batches."""
    micro = p.number(f"{name}.micro_batches", 1)
    warm = p.number("warmstart.batch_size", 1)
    credit = credit_name(p.config) if mode is not _MISSING else DEFAULT_CREDIT
    fields = rl_batch_fields(mode, name, _unsync_pop(p.config), credit)
    rl_label = " x ".join(fields)
    if mode in SHARED_MODES and name == "main":  # the shared model's batch: main rows + sub rows
        sub_fields = rl_batch_fields(mode, "sub", credit=credit)
        rl_label = f"{rl_label} + {' x '.join(sub_fields)}"
        fields += tuple(f for f in sub_fields if f not in fields)
    valid = [p.number(field, 1) for field in fields]  # a bad one is reported; the product is then meaningless
    rl_rows = rl_batch_rows(p.config, name) if all(valid) and mode is not _MISSING else None
    if not micro:
        return
    for rows, label in ((warm, "warmstart.batch_size"), (rl_rows, rl_label)):
        if rows and rows % micro:
            p.add(f"{name}.micro_batches", micro,
                  f"a batch of {rows} rows ({label}) does not split into {micro} micro-batches")


_ENV_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_services(p: _Problems) -> None:
    """The real services' fields (env.search_url, env.visit_url, env.judge_*, env.http_*)."""
    for service in ("search", "visit", "judge"):
        url = p.get(f"env.{service}_url")
        if url is not _MISSING and url:
            parts = urllib.parse.urlsplit(str(url))
            if parts.scheme not in ("http", "https") or not parts.hostname:
                p.add(f"env.{service}_url", url, "must be an http:// or https:// URL with a host (or empty: offline)")
        variable = p.get(f"env.{service}_api_key_env")
        if variable is not _MISSING and not (isinstance(variable, str) and _ENV_VAR.fullmatch(variable)):
            p.add(f"env.{service}_api_key_env", variable, "must name an environment variable (letters, digits, _)")
    if p.get("env.judge_url") and p.get("env.judge_model") in ("", None):
        p.add("env.judge_model", "", "env.judge_url is set: name the judge model the endpoint serves")
    if (p.get("env.search_url") or p.get("env.visit_url")) and p.get("env.grammar") == "compact":
        p.add("env.grammar", "compact", "the compact world's tools are offline only: env.search_url and "
              "env.visit_url need env.grammar=chat")
    p.number("env.visit_max_chars", 0)
    p.number("env.judge_concurrency", 1)
    p.number("env.judge_max_tokens", 1)
    p.number("env.http_timeout_s", above=0)
    p.number("env.http_max_attempts", 1)
    p.number("env.http_backoff_s", 0)


ASYNC_PARTIAL_ROLLOUTS = ("continue", "restart")
ASYNC_CORRECTIONS = ("decoupled", "none")


def _check_async(p: _Problems) -> None:
    """`async_rl.*`: its values, and the mode the asynchronous loop does not run."""
    if "async_rl" not in p.config:  # a config from before the block: synchronous
        return
    p.number("async_rl.max_staleness", 0)
    p.number("async_rl.rollout_devices", 0)
    p.number("async_rl.is_cap", above=0)
    p.choice("async_rl.partial_rollouts", ASYNC_PARTIAL_ROLLOUTS)
    p.choice("async_rl.correction", ASYNC_CORRECTIONS)
    if not p.get("async_rl.enabled"):
        return
    if p.get("mode") == "mgrpo_unsync":
        p.add("async_rl.enabled", True, "not with mode mgrpo_unsync: its sub-agent trains from its own FIFO, whose "
              "records carry no per-token versions to correct")


def validate(config, job: str | None = None) -> None:
    """Raises one ValueError listing every problem of `config` that shows without building anything, each naming
    its field. `job`: the job's side in the decoupled mode (launch/tpu_run.py --role), "colocated" or None for
    one job with both agents."""
    from mgrpo_jax.core import advantages, alignment
    from mgrpo_jax.env.grammar import GRAMMARS, get_grammar
    from mgrpo_jax.store.url import parse_store_url

    p = _Problems(config)
    _unknown_fields(p, config, base_config())
    p.choice("benchmark", BENCHMARKS)
    p.choice("mode", MODES)
    p.choice("stage", STAGES)
    mode = p.get("mode")

    grammar = p.get("env.grammar")
    if grammar is not _MISSING:
        try:
            get_grammar(grammar)
        except ValueError:
            p.add("env.grammar", grammar, f"not one of {', '.join(GRAMMARS)}{_did_you_mean(grammar, GRAMMARS)}")
    for field in ("n_entities", "snippet_chars", "search_top_k", "stage2_filter_samples"):
        p.number(f"env.{field}", 1)
    for field in ("background_sentences", "stage2_filter_pool"):
        p.number(f"env.{field}", 0)
    p.number("env.stage2_max_success", 0, 1)
    if p.get("env.curriculum_file") not in (_MISSING, "", None) and p.get("stage") != "stage2":
        p.add("env.curriculum_file", p.get("env.curriculum_file"), "a stage-2 question pool: needs stage=stage2")
    for section, low, high in (("sizes", 0, None), ("compact", 1, None), ("compact_noise", 0, 1)):
        values = p.get(f"env.{section}")
        for key in () if values is _MISSING else values.keys():
            if (section, key) == ("compact", "search_order"):
                p.choice("env.compact.search_order", SEARCH_ORDERS)
            else:
                p.number(f"env.{section}.{key}", low, high)
    _check_services(p)
    p.number("tokenizer.vocab_size", 0)

    p.choice("rollout.align_mode", alignment.MODES)
    p.choice("rollout.shared_role_weighting", ROLE_WEIGHTINGS)
    p.choice("loss_recipe", LOSS_RECIPES)
    p.choice("rollout.unsync_pop", ("chunks", "step"))
    for field in ("queries", "samples", "d_max", "max_turn_tokens", "unsync_chunk"):
        p.number(f"rollout.{field}", 1)
    p.number("rollout.max_sub_calls", 0)
    p.number("rollout.kv_block_size", 0)
    p.choice("rollout.paged_attention", PAGED_ATTENTIONS)
    p.number("rollout.temperature", 0)

    for field, n in (("rewards.alpha", 2), ("rewards.beta", 3)):
        weights = p.get(field)
        if weights is not _MISSING and (not isinstance(weights, tuple | list) or len(weights) != n):
            p.add(field, weights, f"must be {n} weights")

    p.choice("advantages.estimator", advantages.available_advantages())
    p.choice("advantages.scale", advantages.SCALES)
    p.choice("advantages.baseline", advantages.BASELINES)
    p.number("advantages.eps", 0)

    for field in ("steps", "batch_size", "examples", "min_steps", "check_every", "format_questions"):
        p.number(f"warmstart.{field}", 1 if field in ("batch_size", "examples") else 0)
    p.number("warmstart.checkpoint_every", 1)
    p.number("warmstart.format_target", 0, 1)
    for field in ("warmstart.counterfactual_share", "rollout.counterfactual_share"):
        share = p.number(field, 0, 1)
        if share and p.get("env.grammar") != "compact":
            p.add(field, share, "counterfactual twins exist for the compact world only (env.grammar=compact)")
    share = p.get("rollout.counterfactual_share")
    if share not in (_MISSING, 0, 0.0) and job in ("main", "sub"):
        p.add("rollout.counterfactual_share", share, f"not with --role={job}: the sub job would answer from the "
              "world while the main job's step is posed in a twin; run colocated")
    for field in ("steps", "eval_every", "eval_questions", "checkpoint_every", "log_transcripts"):
        p.number(f"train.{field}", 0)
    p.number("train.eval_runs", 1)
    eval_sets = p.get("train.eval_sets")
    if eval_sets is not _MISSING:
        from mgrpo_jax.env.questions import SPLITS

        for name in str(eval_sets).split(","):
            if name.strip() not in SPLITS:
                p.add("train.eval_sets", eval_sets,
                      f"{name.strip()!r} is not one of {', '.join(SPLITS)}{_did_you_mean(name.strip(), SPLITS)}")

    agents = ("single",) if mode == "single_agent" else ("main", "sub")
    for name in agents:
        _check_agent(p, name)
        if not (mode in SHARED_MODES and name == "sub"):  # the shared model's batches are main's
            _check_micro_batches(p, name, mode)
    from mgrpo_jax.core.credit import available_credits

    credit = p.get("credit")
    if credit not in (_MISSING, "", None, *CREDIT_ALIASES) and credit not in available_credits():
        p.add("credit", credit, f"not a registered credit assignment ({', '.join(available_credits())})"
              f"{_did_you_mean(credit, available_credits())}")
    if mode in SHARED_MODES and p.get("sub.init_from") not in (_MISSING, "", None, p.get("main.init_from")):
        p.add("sub.init_from", p.get("sub.init_from"), f"mode {mode} has one model, built from main: set "
              "main.init_from (sub's must be empty or the same)")

    store = p.get("store")
    if store is not _MISSING:
        try:
            parse_store_url(store)
        except ValueError as e:
            p.add("store", store, str(e))
    p.number("decoupled.timeout_s", above=0)
    max_lag = p.number("decoupled.max_lag", 0)
    keep = p.number("decoupled.keep_steps", 1)
    if max_lag is not None and keep is not None and keep < max_lag + 1:
        p.add("decoupled.keep_steps", keep, f"must be >= decoupled.max_lag + 1 = {max_lag + 1} (the main job at "
              "step s may still read what the sub job wrote at step s - max_lag)")

    _check_async(p)

    if job is not None and job not in JOBS:
        p.add("role", job, f"not one of {', '.join(JOBS)}{_did_you_mean(job, JOBS)}")
    if job in ("main", "sub"):
        if mode in SHARED_MODES:
            p.add("mode", mode, f"--role={job}: mode {mode} trains one model for both agents, which cannot be split "
                  f"across two jobs; run it colocated, or use a two-agent mode ({', '.join(TWO_AGENT_MODES)})")
        elif mode in MODES and mode not in TWO_AGENT_MODES:
            p.add("mode", mode, f"--role={job} needs a two-agent mode ({', '.join(TWO_AGENT_MODES)})")
        if isinstance(store, str) and store.startswith("memory://"):
            p.add("store", store, f"--role={job}: the main and sub jobs share only the store, and a memory:// "
                  "store is private to one process; pass --config.store=file:///shared/path or gs://bucket/prefix")

    found = list(dict.fromkeys(p.found))
    if found:
        raise ValueError(f"invalid config ({len(found)} problem{'s' if len(found) > 1 else ''}):\n  "
                         + "\n  ".join(found))
