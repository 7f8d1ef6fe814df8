"""How a LoRA agent's sampler should see its adapters: merged into the base once per policy update, or unmerged.

    python -m mgrpo_jax.bench.lora                     # the model benchmark's 'bench' shape, rank 16, all projections
    python -m mgrpo_jax.bench.lora --rank 64 --new-tokens 64
    python -m mgrpo_jax.bench.lora --quick             # the 'tiny' shape, rank 2, 2 x (8 + 4) tokens: seconds

On the ``bench`` model shape (mgrpo_jax/model/shapes.py) with adapters of ``--rank`` on every projection (B random,
so the two paths compute the same non-trivial policy), ``--prompts`` prompts of ``--prompt-len`` random ids are
sampled for ``--new-tokens`` tokens (every row the full budget) through ``Sampler.generate``:

* ``merged``: the sampler holds a plain model; each policy update costs one ``merged_params`` (``W + s A B`` for
  every targeted projection: ``merge_s``), then sampling runs at the base model's speed (``merged_sample_s``).
* ``unmerged``: the sampler holds the LoRA model itself; every decoded token pays the two extra thin products per
  projection (``unmerged_sample_s``).

``merged_per_update_s = merge_s + merged_sample_s`` is what a policy update's sampling costs with merging;
``choice`` names the faster path (the one ``Learner.publish`` uses is ``merged``). Medians of ``--repeats`` timed
calls after one compiling call. The last stdout line is one JSON object (``mgrpo_jax.bench.common.emit``).
"""

from __future__ import annotations

import argparse
import sys

import jax
import ml_collections
import numpy as np
import optax
from flax import nnx

from mgrpo_jax.agent.state import create_lora_agent_state, merged_params
from mgrpo_jax.bench.common import emit, time_call
from mgrpo_jax.model import abstract_model, get_model_config, make_mesh
from mgrpo_jax.model.lora import lora_spec
from mgrpo_jax.sampling import Sampler

QUICK = ["--model", "tiny", "--rank", "2", "--prompts", "2", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1"]


def run(args) -> dict:
    cfg = get_model_config(args.model)
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    spec = lora_spec(ml_collections.ConfigDict({"rank": args.rank, "alpha": float(args.rank), "target": ".",
                                                "dropout": 0.0}))
    graphdef, state, _, base = create_lora_agent_state(cfg, spec, optax.identity(), mesh, seed=0)
    # A trained adapter (B != 0), so both paths compute the same non-trivial policy.
    adapters = jax.tree.map(lambda x: x + 0.01, state.params)
    plain_graphdef = abstract_model(cfg, mesh)[0]
    merged_sampler = Sampler(nnx.merge(plain_graphdef, merged_params(adapters, base, spec.scale)), pad_id=0)
    unmerged_sampler = Sampler(nnx.merge(graphdef, adapters, base), pad_id=0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, cfg.vocab_size, size=(args.prompts, args.prompt_len), dtype=np.int32)
    lengths = np.full((args.prompts,), args.prompt_len, np.int32)

    def sample(sampler):
        return lambda: sampler.generate(prompts, lengths, max_new=args.new_tokens, rng=0).tokens

    merge = time_call(lambda: merged_params(adapters, base, spec.scale), repeats=args.repeats)["median_s"]
    merged = time_call(sample(merged_sampler), repeats=args.repeats)["median_s"]
    unmerged = time_call(sample(unmerged_sampler), repeats=args.repeats)["median_s"]
    same = np.mean(np.asarray(sample(merged_sampler)()) == np.asarray(sample(unmerged_sampler)()))
    return {"model": args.model, "rank": args.rank, "prompts": args.prompts, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "backend": jax.default_backend(), "merge_s": merge,
            "merged_sample_s": merged, "merged_per_update_s": merge + merged, "unmerged_sample_s": unmerged,
            "same_tokens_frac": float(same),
            "choice": "merged" if merge + merged <= unmerged else "unmerged"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds: " + " ".join(QUICK))
    args = parser.parse_args(argv)
    if args.quick:  # the quick sizes first, so flags given beside --quick still override them
        args = parser.parse_args([*QUICK, *(argv if argv is not None else sys.argv[1:])])
    emit(run(args))


if __name__ == "__main__":
    main()
