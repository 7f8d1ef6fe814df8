"""A `smoke` run with LoRA on both agents (as `launch/tpu_run.py --config=experiments/xbench.py:smoke
--config.main.lora.rank=4 --config.sub.lora.rank=4` builds it): it trains, its checkpoints hold adapters and their
optimizer state only, an interrupted run resumes with exactly the uninterrupted metrics, and it exports merged HF
weights that `transformers` loads with the same log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import transformers
from flax import nnx

from mgrpo_jax.agent import export
from mgrpo_jax.model import token_logprobs
from mgrpo_jax.rl.trainer import Trainer
from tests.rl.test_trainer import DETERMINISTIC_KEYS, _rl_records, _smoke


def _lora_smoke(steps):
    config = _smoke(steps=steps)
    config.main.lora.rank = config.sub.lora.rank = 4
    return config


def _hf_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(tokens)).logits.double()
    return torch.log_softmax(logits, -1)[:, :-1].gather(2, torch.as_tensor(tokens)[:, 1:, None])[..., 0].numpy()


@pytest.mark.slow
def test_lora_smoke_run_trains_resumes_exactly_and_exports(tmp_path):
    straight = Trainer(_lora_smoke(2), str(tmp_path / "straight"))
    main = straight.agents["main"]
    assert main.lora is not None and straight.agents["sub"].lora is not None
    export.record_agents(straight.workdir, straight.agents)
    base = jax.device_get(main.base)
    summary = straight.run()
    assert "main/train/loss" in summary
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(jax.device_get(main.base)), strict=True):
        assert np.array_equal(a, b)  # the warm start and RL steps trained the adapters only

    # The checkpoint's agent item is the adapters and their optimizer state: nothing of the size of the base.
    item = tmp_path / "straight" / "checkpoints" / "2" / "main"
    shapes = {tuple(m.shape) for m in jax.tree.leaves(ocp.StandardCheckpointer().metadata(item).item_metadata)
              if hasattr(m, "shape")}
    assert shapes and shapes <= {tuple(x.shape) for x in jax.tree.leaves(main.state)}
    assert tuple(main.base["embed"].shape) not in shapes

    # Interrupted after step 1, resumed: the same metrics as the uninterrupted run.
    Trainer(_lora_smoke(1), str(tmp_path / "interrupted")).run()
    Trainer(_lora_smoke(2), str(tmp_path / "interrupted")).run()
    a, b = _rl_records(tmp_path / "straight"), _rl_records(tmp_path / "interrupted")
    assert [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b, strict=True):
        for key in DETERMINISTIC_KEYS:
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), (ra["step"], key)

    # The export: base + adapters merged, loaded by transformers with our policy's log-probs.
    written = export.export_agents(straight)
    out = tmp_path / "straight" / "export" / "main"
    assert str(out) in written
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(1, main.model_config.vocab_size, size=(2, 24)).astype(np.int32)
    positions = jnp.broadcast_to(jnp.arange(24), tokens.shape)
    ours = np.asarray(token_logprobs(main.policy_model(), jnp.asarray(tokens), positions))[:, 1:]
    assert np.abs(ours - _hf_logprobs(hf, tokens)).max() < 1e-5
    plain = nnx.merge(main.sampler.graphdef, main.base)  # the check has teeth: the adapters moved the policy
    assert np.abs(ours - np.asarray(token_logprobs(plain, jnp.asarray(tokens), positions))[:, 1:]).max() > 1e-4
    # The command-line export of the latest checkpoint (recorded base + checkpointed adapters) writes the same.
    cli = export.export_checkpoint(str(tmp_path / "straight"), "main", str(tmp_path / "cli"))
    again = transformers.AutoModelForCausalLM.from_pretrained(cli, dtype=torch.float32).eval()
    for (name, x), (_, y) in zip(hf.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.allclose(x, y, atol=1e-6), name
