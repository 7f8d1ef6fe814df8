"""The run configuration: one ml_collections ConfigDict, presets by name.

Experiment files (`experiments/xbench.py`, `gaia.py`, `webwalker.py`) call `get_config(benchmark, preset)`
and are what users pass to `launch/tpu_run.py --config=experiments/xbench.py:local`. Presets:

  smoke  the whole pipeline (warm start, RL steps of both agents, eval, checkpoint) in under a minute;
         used by the tests.
  local  runs on a laptop CPU: the compact world (env.grammar=compact), warm start until the agents keep the
         format, then RL, in about 10 minutes on 2 cores.
  figures the compact system for experiments/figures (stage 1, stage 2, avg@3 evaluations).
  paper  the paper's settings (K = 8, D = 8, alpha/beta weights, clip 0.2/0.28, no KL), 8B-class models,
         for a TPU pod slice.

Modes (`config.mode`): mgrpo | frozen_sub | single_agent | mgrpo_unsync (see DESIGN.md section 2).
"""

from __future__ import annotations

import ml_collections

MODES = ("mgrpo", "frozen_sub", "single_agent", "mgrpo_unsync")
PRESETS = ("smoke", "local", "figures", "paper")
BENCHMARKS = ("xbench", "gaia", "webwalker")


def _agent(model: str, *, context_tokens: int, max_turns: int, lr: float) -> ml_collections.ConfigDict:
    agent = ml_collections.ConfigDict()
    agent.model = model  # a preset of mgrpo_jax.model.config.get_model_config
    agent.model_overrides = ml_collections.ConfigDict()
    agent.init_from = ""  # a Hugging Face checkpoint directory (safetensors + config.json), optional
    agent.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})  # -1: the rest
    agent.context_tokens = context_tokens  # episode budget; also the train step's sequence length
    agent.max_turns = max_turns
    agent.micro_batches = 1
    agent.decode_phases = 1  # the sampler's decode loop in this many phases over growing caches (sampling)
    agent.warmstart_steps = 0  # supervised warm-start steps of this agent (0: warmstart.steps)
    agent.passes = 1  # PPO-style optimisation passes (mu) over each RL batch
    agent.loss = "grpo"
    agent.loss_hparams = ml_collections.ConfigDict(
        {"eps_low": 0.2, "eps_high": 0.28, "aggregation": "seq-mean-token-mean", "ratio_level": "token",
         "kl_coef": 0.0})
    agent.optim = ml_collections.ConfigDict(
        {"lr": lr, "warmup_steps": 0, "decay": "constant", "total_steps": 0, "b1": 0.9, "b2": 0.98,
         "weight_decay": 0.1, "grad_clip_norm": 1.0})
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
    c.env.compact = ml_collections.ConfigDict({"n_names": 160, "n_orgs": 40, "n_countries": 10, "search_results": 3})
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
         "eval_webwalker": 680})
    # Systematic expert noise (fractions of fact types / entities / question kinds the experts get wrong).
    c.env.noise = ml_collections.ConfigDict()
    # Stage 2 keeps the questions the starting system (stage-1 checkpoint) solves at most this often, estimated
    # from `stage2_filter_samples` rollouts of each of the first `stage2_filter_pool` questions (1.0: keep all).
    c.env.stage2_max_success = 0.5
    c.env.stage2_filter_pool = 256
    c.env.stage2_filter_samples = 4
    c.env.search_url = ""  # a real search API (HttpSearchBackend); empty: the offline world's BM25
    c.env.visit_url = ""
    c.env.benchmark_path = ""  # real benchmark files for evaluation (see reference/benchmarks.md)

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

    c.rewards = ml_collections.ConfigDict({"alpha": (0.1, 0.9), "beta": (0.1, 0.4, 0.5)})
    c.advantages = ml_collections.ConfigDict({"scale": "group", "baseline": "mean", "eps": 1e-6})

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

    c.train = ml_collections.ConfigDict()
    c.train.steps = 50  # RL steps
    c.train.eval_every = 10
    c.train.eval_runs = 3  # avg@3
    c.train.eval_questions = 30  # per evaluation set (0: the whole set)
    c.train.eval_at_start = False  # also evaluate the starting point (step 0) of a fresh run
    c.train.checkpoint_every = 10
    c.train.log_transcripts = 2

    c.store = "memory://mgrpo"  # memory:// | file:///path | gs://bucket/prefix

    # Decoupled mode (--role=main / --role=sub, two jobs sharing only `store`; mgrpo_jax/train/decoupled.py).
    c.decoupled = ml_collections.ConfigDict()
    c.decoupled.timeout_s = 3600.0  # longest wait for the other job (tokenizer, answers, commits, tasks)
    c.decoupled.max_lag = 1  # the main job starts step s once the sub job has trained step s - max_lag
    c.decoupled.worker = "sub_0"  # the sub job's name on its task claims
    return c


def get_config(benchmark: str = "xbench", preset: str | None = None) -> ml_collections.ConfigDict:
    """`preset` may carry a mode after a comma, e.g. "local,frozen_sub"."""
    preset = preset or "local"
    name, _, mode = preset.partition(",")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets are {PRESETS}")
    c = base_config(benchmark)
    c.preset = name
    if mode:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; modes are {MODES}")
        c.mode = mode
    {"smoke": _smoke, "local": _local, "figures": _figures, "paper": _paper}[name](c)
    return c


def _small_world(c, entities: int) -> None:
    c.env.n_entities = entities
    c.env.background_sentences = 2
    c.env.snippet_chars = 120
    c.env.search_top_k = 3
    c.env.sizes = ml_collections.ConfigDict(
        {"stage1": 400, "stage2": 400, "validation": 40, "eval_gaia": 40, "eval_xbench": 40, "eval_webwalker": 40})


def _smoke(c) -> None:
    _small_world(c, 300)
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


def _compact(c) -> None:
    """The compact world, grammar and word-level tokenizer (DESIGN.md section 4), sized for a 2-core CPU: agents of
    ~0.17M parameters, episodes of ~50 (main), ~50 (sub) and ~100 (single agent) tokens."""
    c.env.grammar = "compact"
    c.env.sizes = ml_collections.ConfigDict(
        {"stage1": 600, "stage2": 600, "validation": 40, "eval_gaia": 40, "eval_xbench": 40, "eval_webwalker": 40})
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
    # agent's 3-hop chains with one re-ask each, the sub-agent's search-open-answer, the single agent's 3 lookups.
    c.main.context_tokens, c.main.max_turns = 96, 8
    c.sub.context_tokens, c.sub.max_turns = 64, 4
    c.single.context_tokens, c.single.max_turns = 128, 10
    c.rollout.queries = 16
    c.rollout.samples = 8
    c.rollout.d_max = 4  # the 99th percentile of the stage-2 experts' d_k (bench.env: 2-4 calls)
    c.rollout.max_turn_tokens = 8  # the longest compact turn, `[calc max 31 17 ]`, is 6 tokens with its end
    c.rollout.max_sub_calls = 6
    c.rollout.temperature = 1.0
    c.rollout.unsync_chunk = 128
    # Greedy clones keep the format after ~100 steps but copy names and values (the content) only after ~500.
    c.warmstart.steps = 1000
    c.warmstart.min_steps = 500
    c.warmstart.batch_size = 64
    c.warmstart.examples = 2000
    c.warmstart.check_every = 250
    c.warmstart.format_questions = 64


def _local(c) -> None:
    """The README's laptop run: the compact system, warm start until the format is kept, then RL; ~10 minutes."""
    _compact(c)
    c.rollout.d_max = 2  # stage 1 (1-hop lookups, one re-ask at most): d_k is 1 or 2
    c.train.steps = 40
    c.train.eval_every = 20
    c.train.eval_runs = 1
    c.train.eval_questions = 40
    c.train.checkpoint_every = 20


def _figures(c) -> None:
    """The paper's figures in miniature (experiments/figures/): the compact system, stage 1 then stage 2 from one
    stage-1 checkpoint, avg@3 evaluations on the three held-out sets."""
    _compact(c)
    c.train.steps = 16
    c.train.eval_every = 8
    c.train.eval_runs = 3  # avg@3, as in the paper
    c.train.eval_questions = 40
    c.train.eval_at_start = True
    c.train.checkpoint_every = 8
    c.env.stage2_filter_pool = 256
    c.env.stage2_filter_samples = 4


def _paper(c) -> None:
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


def default_preset() -> str:
    """`local` on a machine without accelerators, `paper` on TPU."""
    import jax

    return "paper" if jax.default_backend() == "tpu" else "local"
