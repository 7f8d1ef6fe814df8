"""Jitted batched sampling with a donated KV cache (see ``sampler.py`` for the log-prob convention).

Public API::

    from mgrpo_jax.sampling import Sampler, generate, sample_logits, filter_logits, pad_prompts, bucket
    sampler = Sampler(model, pad_id=tok.pad_id, top_k=0, top_p=1.0)
    out = sampler.sample(list_of_id_lists, max_new=128, rng=seed, temperature=1.0,
                         stop_tokens=tok.stop_ids, budgets=None)   # -> SampleOutput (numpy)
    out.tokens [B, max_new], out.logprobs [B, max_new], out.lengths [B], out.stopped [B]
    sampler.update_weights(model)  # new parameters, no recompilation
    sampler.caches                 # its CachePool: one donated KV cache per shape (cache.py), the decode slots' too
    PagedSlots(sampler, n_slots, max_len, block_size=16)  # decode slots on paged KV with shared prefixes (paged.py)
    with observe(observer): ...    # the compiled calls' times, for benchmarks (observe.py)
"""

from mgrpo_jax.sampling.buckets import (
    DEFAULT_BATCH_BUCKETS,
    DEFAULT_LENGTH_BUCKETS,
    bucket,
    pad_prompts,
    pow2_buckets,
)
from mgrpo_jax.sampling.cache import CachePool
from mgrpo_jax.sampling.layout import decode_layout
from mgrpo_jax.sampling.observe import CallObserver, observe
from mgrpo_jax.sampling.paged import BlockPool, PagedSlots
from mgrpo_jax.sampling.sampler import (
    NO_STOP,
    SampleOutput,
    Sampler,
    decode_windows,
    filter_logits,
    generate,
    inverse_cdf,
    sample_logits,
    stop_table,
)

__all__ = [
    "BlockPool",
    "CachePool",
    "CallObserver",
    "DEFAULT_BATCH_BUCKETS",
    "DEFAULT_LENGTH_BUCKETS",
    "NO_STOP",
    "PagedSlots",
    "SampleOutput",
    "Sampler",
    "bucket",
    "decode_layout",
    "decode_windows",
    "filter_logits",
    "generate",
    "inverse_cdf",
    "observe",
    "pad_prompts",
    "pow2_buckets",
    "sample_logits",
    "stop_table",
]
