"""The presets every benchmark shares: functions that edit the defaults (`mgrpo_jax.config.base_config`) in place,
and `PRESETS`, their table by name. `mgrpo_jax.config.get_config(benchmark, "preset[,mode]")` resolves them, and
each experiment file (`experiments/xbench.py`, `gaia.py`, `webwalker.py`, what
`launch/tpu_run.py --config=experiments/xbench.py:local` loads) starts its own table from this one.

  smoke   the whole pipeline (warm start, RL steps of both agents, eval, checkpoint) in under a minute;
          used by the tests.
  local   runs on a laptop CPU: the compact world (env.grammar=compact), warm start until the agents keep the
          format, then RL, in about 10 minutes on 2 cores.
  figures the compact system for experiments/figures (stage 1, stage 2, avg@3 evaluations).
  paper   the paper's settings (K = 8, D = 8, alpha/beta weights, clip 0.2/0.28, no KL) and its model,
          Qwen3-30B-A3B (mixture of experts, expert-parallel) for both agents, for a TPU pod slice.
  paper_dense  the same settings with a dense 8B model (Qwen3-8B shape) for both agents.
  paper_lora  `paper_dense` with LoRA (rank 64 on every projection) on every agent and the frozen base in bfloat16,
          for smaller slices (README "LoRA").

`compact` (the compact world, grammar and model sized for a CPU) and `small_world` are building blocks of the
presets above.

Why here and not in experiments/: package code, tests and scripts need the presets by name (`get_config`), and the
experiment files import the package. With the presets in experiments/ the package had to load those files by path,
an import cycle (package -> experiment file -> package) that no import statement shows. Here the dependency runs
one way: experiments/ imports the package, the package never loads experiments/ (tests/test_imports.py checks
both). The cost: a preset only one experiment file lists is reachable through that file (`--config=FILE:name`),
not through `get_config`; a preset package code or tests use belongs here. This module imports no other module
of the package, so `mgrpo_jax.config` can import it and stay free of jax.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_collections

Preset = Callable[[ml_collections.ConfigDict], None]


def small_world(c, entities: int) -> None:
    c.env.n_entities = entities
    c.env.background_sentences = 2
    c.env.snippet_chars = 120
    c.env.search_top_k = 3
    c.env.sizes = ml_collections.ConfigDict(
        {"stage1": 400, "stage2": 400, "validation": 40, "eval_gaia": 40, "eval_xbench": 40, "eval_webwalker": 40})


def smoke(c) -> None:
    small_world(c, 300)
    c.tokenizer.vocab_size = 1024
    for agent in (c.main, c.sub, c.single):
        agent.model_overrides = ml_collections.ConfigDict({"d_model": 32, "n_layers": 1, "mlp_dim": 64,
                                                          "n_heads": 2, "n_kv_heads": 1, "head_dim": 16})
        agent.context_tokens = 1024
        agent.max_turns = 3
    c.single.context_tokens = 1024
    c.rollout.queries = 2
    c.rollout.samples = 2
    c.rollout.d_max = 2
    c.rollout.max_turn_tokens = 48
    c.rollout.max_sub_calls = 2
    c.rollout.unsync_chunk = 4
    c.warmstart.steps = 3
    c.warmstart.batch_size = 4
    c.warmstart.examples = 8
    c.train.steps = 2
    c.train.eval_every = 2
    c.train.eval_runs = 1
    c.train.eval_questions = 2
    c.train.checkpoint_every = 1


def compact(c) -> None:
    """The compact world, grammar and word-level tokenizer (README, "The compact miniature"), sized for a 2-core
    CPU: agents of ~0.17M parameters, episodes of ~50 (main), ~50 (sub) and ~100 (single agent) tokens."""
    c.env.grammar = "compact"
    # Stage 1 asks every (entity, fact) of the world (1,080 lookups); stage 2's 3,000 texts are too many for the
    # agents to learn a plan per text (at 600, new texts of the same kinds scored a third of trained ones).
    c.env.sizes = ml_collections.ConfigDict(
        {"stage1": 1200, "stage2": 3000, "validation": 40, "eval_gaia": 40, "eval_xbench": 40, "eval_webwalker": 40,
         "fresh": 40})
    # Training asks the world's counterfactual twins, evaluation the world (mgrpo_jax/env/compact/questions.py):
    # no answer the agents are evaluated on was ever a training target, so answers must come from the tools.
    c.warmstart.counterfactual_share = 1.0
    c.rollout.counterfactual_share = 1.0
    c.tokenizer.vocab_size = 0  # the word model's own size: the world's words, the tags and the byte pieces
    for agent in (c.main, c.sub, c.single):
        agent.model_overrides = ml_collections.ConfigDict({"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4,
                                                          "head_dim": 16, "mlp_dim": 256})
        # RL: a slow second-moment average (b2 0.999) keeps Adam from turning the near-zero gradients of tokens
        # the clone already predicts into full-size noisy steps; at lr 2e-3 (b2 0.98, 4 passes) the clone's
        # copying broke down within 10 steps (README, "The compact miniature").
        agent.optim.lr = 3e-4
        agent.optim.b2 = 0.999
        agent.sft.lr = 3e-3
        agent.passes = 2
    # Noise-free experts finish every question within these (tests/env/test_compact.py replays them): the main
    # agent's 3-hop chains with one re-ask each, the sub-agent's search-open-answer, the single agent's 3 lookups;
    # the noisy experts' stage-2 3-hop chains too (at most 91 tokens, 7 turns and 6 calls on worlds 0-4).
    c.main.context_tokens, c.main.max_turns = 96, 8
    c.sub.context_tokens, c.sub.max_turns = 64, 4
    # The single agent does the main agent's work and every sub-agent's in one context: it gets their budgets
    # together (96 + 6 calls x 64 tokens, 8 + 6 x 4 turns, rounded down), so a limit binds it no more often than
    # the multi-agent system (at 128 tokens, 52-76 % of its stage-2 episodes ended on the context limit).
    c.single.context_tokens, c.single.max_turns = 384, 24
    c.rollout.queries = 16
    c.rollout.samples = 8
    # D covers a 3-hop chain with one re-ask. Stage 2 has 3-hop chains since issue 36: the noisy experts' d_k is
    # above 4 in 3-17 % of worlds 0-4's stage-2 rollouts (p99 5-6, all of them 3-hop chains re-asking), where 4
    # drops calls at random (mgrpo_jax/core/alignment.py); the trained systems' d_k histogram says whether D stays.
    c.rollout.d_max = 4
    c.rollout.max_turn_tokens = 8  # the longest compact turn, `[calc max 31 17 ]`, is 6 tokens with its end
    c.rollout.max_sub_calls = 6
    c.rollout.temperature = 1.0
    c.rollout.unsync_chunk = 128
    # Greedy clones keep the format after ~100 steps, but read their tools only later: cloned in the twins, the
    # system's greedy success on the world was 0.20 at 250 steps and 0.30 at 500 (world 0).
    c.warmstart.steps = 1000
    c.warmstart.min_steps = 500
    c.warmstart.batch_size = 64
    c.warmstart.examples = 6000
    c.warmstart.check_every = 250
    c.warmstart.format_questions = 64


def local(c) -> None:
    """The README's laptop run: the compact system, warm start until the format is kept, then RL; ~10 minutes."""
    compact(c)
    c.rollout.d_max = 2  # stage 1 (1-hop lookups, one re-ask at most): d_k is 1 or 2
    c.train.steps = 40
    c.train.eval_every = 20
    c.train.eval_runs = 1
    c.train.eval_questions = 40
    c.train.checkpoint_every = 20


def figures(c) -> None:
    """The paper's figures in miniature (experiments/figures/): the compact system, stage 1 then stage 2 from that
    seed's stage-1 checkpoint (each seed its own world), avg@3 evaluations on the held-out, validation and fresh
    sets and the blind control."""
    compact(c)
    # Stage 2's mgrpo reward rose most in the first 40 steps of a 60-step pilot (world 0, posed in twins: 0.26 over
    # steps 1-5, 0.37 over 36-40, 0.41 over 56-60); 40 steps per stage fit the set's 2.5-hour budget on 2 cores.
    c.train.steps = 40
    c.train.eval_every = 20
    c.train.eval_runs = 3  # avg@3, as in the paper
    c.train.eval_questions = 0  # every question of each set
    # The transfer gap's two sets, 160 questions each, with the same kinds in the same numbers (stratified): on a
    # world the figures never use (100, experiments/figures/transfer_probe.py) the failures were entity-specific
    # sub-agent misreads shared by all samples of a question, and its 40-question sets of a random kind mix
    # differed by +0.075 where 120 trained texts and 78 new ones differed by -0.015 (docs/experiments.md).
    c.env.sizes.validation = 160
    c.env.sizes.fresh = 160
    c.train.eval_at_start = True
    # The held-out sets, plus the transfer gap's two (validation: stage-2 kinds over held-out facts; fresh: the same
    # kinds over training facts) and the blind control (every tool answering "none").
    c.train.eval_sets = "eval_gaia,eval_xbench,eval_webwalker,validation,fresh"
    c.train.eval_blind = True
    c.train.checkpoint_every = 20
    # Stage 2 trains the 160 fresh texts (unfiltered) and those of 512 other stage-2 texts that the stage-1 system
    # solves at most half the time (4 samples each), measured in seeded twins as RL poses its steps
    # (mgrpo_jax/rl/curriculum.py): with a pool of 256 the unfiltered fresh texts were 40-50 % of what stage 2
    # trains; `env.curriculum_file` makes every lineage of a world train on one such filter's pool.
    c.env.stage2_filter_pool = 512
    c.env.stage2_filter_samples = 4
    c.rollout.unsync_pop = "step"  # Fig. 8 at equal work (mgrpo_jax/rl/unsync.py)
    # A longer warm start: with each twin's own search order the clones read their tools only after ~1,000 steps
    # (the greedy system's success on world 105: 0.16 at 500 steps, 0.22 at 1,000, 0.30 at 1,250 and 1,500), and
    # the whole lineage follows it: stage 2's XBench-style accuracy was 0.167 from a 500-step warm start and 0.358
    # from a 1,500-step one (world 105, never a figure world; docs/experiments.md). Fixed length, no early stop.
    c.warmstart.steps = 1500
    c.warmstart.min_steps = 1500


def paper(c) -> None:
    """The paper's settings and its model, Qwen3-30B-A3B (128 experts, 8 per token) for both agents, for a TPU pod
    slice: 32 chips per agent (v5p-64 for the pair, the paper's 32 GPUs per agent)."""
    paper_dense(c)
    for agent in (c.main, c.sub, c.single):
        agent.model = "qwen3-30b-a3b"
        # Experts over an 8-way `expert` axis, every parameter FSDP over the rest (mgrpo_jax/model/moe.py);
        # planned by `python -m mgrpo_jax.bench.plan` (README).
        agent.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1, "expert": 8})
        # One 32k-token row per chip per micro-batch: the rows split over data x fsdp x expert (32 chips: the
        # sub-agent's 128 rows in 4 micro-batches; the main agent's 16 in 4, over data x fsdp only).
        agent.micro_batches = 4
        # The MoE block in chunks of one row's tokens: its dropless dispatch buffers are N * 8 rows of the tokens
        # gathered over the expert axis (8 rows of 32k per chip in the train step) without it.
        agent.model_overrides.moe_chunk = 32_768


def paper_dense(c) -> None:
    """The paper's settings (K = 8, D = 8, alpha/beta weights, clip 0.2/0.28, no KL), 8B-class dense models, for a
    TPU pod slice."""
    c.env.n_entities = 10_000
    c.tokenizer.vocab_size = 32_000
    for agent in (c.main, c.sub, c.single):
        agent.model = "qwen3-8b"
        # Planned for v5p-128 (64 chips) by the TPU compiler (`python -m mgrpo_jax.bench.plan`, README): FSDP over
        # 16 x 4-way tensor parallelism, one 32k-token row per row shard per micro-batch, every layer
        # rematerialised, attention in 1024-query chunks.
        agent.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 4})
        agent.micro_batches = 8
        agent.optim.lr = 1e-6
        agent.optim.weight_decay = 0.1
        agent.model_overrides = ml_collections.ConfigDict({"remat": True, "dtype": "bfloat16", "attn_chunk": 1024})
    c.main.micro_batches = 1  # Q*K = 16 rows: one per row shard
    c.main.context_tokens = 32_768
    c.sub.context_tokens = 32_768
    c.single.context_tokens = 32_768
    c.main.max_turns = c.sub.max_turns = 20
    c.single.max_turns = 40
    c.rollout.queries = 2  # the released scripts' rollout batch (2 prompts x 8 samples)
    c.rollout.samples = 8
    c.rollout.d_max = 8
    c.rollout.max_turn_tokens = 1024
    c.warmstart.steps = 0
    c.warmstart.batch_size = 128  # (no warm start by default) splits over the row shards like the RL batches
    c.train.steps = 100_000
    c.train.eval_every = 25
    c.train.eval_runs = 3
    c.train.eval_questions = 0
    c.train.checkpoint_every = 25


def paper_lora(c) -> None:
    """`paper_dense` (the 8B shape: LoRA adapts the dense projections; an MoE layer's experts take no adapters yet)
    with LoRA rank 64 (alpha 64) on every projection of every agent, the frozen base held in bfloat16 and a learning
    rate for adapters."""
    paper_dense(c)
    for agent in (c.main, c.sub, c.single):
        agent.lora.update({"rank": 64, "alpha": 64.0, "target": "."})
        agent.model_overrides.param_dtype = "bfloat16"  # never updated, so no float32 master copy is needed
        agent.optim.lr = 10 * agent.optim.lr  # adapters take ~10x full fine-tuning's rate (LoRA practice)


# name -> preset; the order is the one `--help` lists.
PRESETS: dict[str, Preset] = {"smoke": smoke, "local": local, "figures": figures, "paper": paper,
                              "paper_dense": paper_dense, "paper_lora": paper_lora}
