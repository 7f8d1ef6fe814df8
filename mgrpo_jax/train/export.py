"""Agents as Hugging Face checkpoints: what `transformers` loads, with the agent's tokenizer files.

    python -m mgrpo_jax.train.export --workdir=runs/x --agent=main --out=DIR    # the latest checkpoint's weights

* `record_agents(workdir, agents)` (when a run is built) writes `<workdir>/agents/<name>/`: the agent's
  `model_config.json` (our `ModelConfig`), its `agent.json` (its config, for the optimizer layout of the
  checkpoints) and its tokenizer files (an `init_from` agent: the checkpoint's own, with the tokens appended to it
  and the family's chat template; otherwise the run's SentencePiece model, for `transformers`' `GemmaTokenizer`, with
  our chat template: `tokenizer_hf.write_tokenizer_files`). A LoRA agent's frozen base weights are saved there
  once as well (`base/`, Orbax; kept when a resumed run records again): its checkpoints hold only the adapters
  and their optimizer state, and this is the base they point to.
* `export_agents(trainer)` (when a run finishes) writes every agent's current weights as `<workdir>/export/<name>/`.
* `export_checkpoint(workdir, agent, out)` restores one agent's latest (or a given) checkpoint on this host's first
  device and writes it to `out` (a LoRA agent: its recorded base with the checkpoint's adapters merged in). Paths
  may be local or gs:// URLs.
An agent whose architecture `transformers` has no equivalent for (`checkpoint_hf.config_to_hf` refuses it) is
recorded without an export, with one log line saying why.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import app, flags
from etils import epath
from flax import nnx

from mgrpo_jax.model import abstract_model, get_rules, make_mesh
from mgrpo_jax.model.checkpoint_hf import config_to_hf, save_hf
from mgrpo_jax.model.config import ModelConfig
from mgrpo_jax.model.lora import lora_spec
from mgrpo_jax.tokenizer import Tokenizer
from mgrpo_jax.tokenizer_hf import TOKENIZER_FILES, write_tokenizer_files
from mgrpo_jax.train.checkpoint import Checkpointer
from mgrpo_jax.train.state import abstract_agent_state, abstract_lora_agent_state, merged_params, model_from_state

log = logging.getLogger(__name__)

RECORDS, EXPORTS, LORA_BASE = "agents", "export", "base"


def record_agents(workdir: str, agents: dict) -> dict:
    """Writes each agent's record (module docstring) on process 0 (a LoRA base with every process); returns
    `agents`."""
    for name, learner in agents.items():
        base = epath.Path(workdir) / RECORDS / name / LORA_BASE
        if learner.lora is not None and not base.exists():
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(base, nnx.to_pure_dict(learner.base))
    if jax.process_index() != 0:
        return agents
    for name, learner in agents.items():
        out = epath.Path(workdir) / RECORDS / name
        out.mkdir(parents=True, exist_ok=True)
        (out / "model_config.json").write_text(json.dumps(dataclasses.asdict(learner.model_config), indent=1))
        (out / "agent.json").write_text(learner.config.to_json_best_effort(indent=1))
        if learner.config.get("init_from") or isinstance(learner.tokenizer, Tokenizer):
            write_tokenizer_files(learner.tokenizer, learner.config.get("init_from") or None, out)
    return agents


def _model_config(record: epath.Path) -> ModelConfig:
    fields = json.loads((record / "model_config.json").read_text())
    return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def write_export(model, record: epath.Path, out: str) -> bool:
    """`model` and the tokenizer files of its `record` as an HF directory `out`; False (logged) when transformers
    has no equivalent architecture. Call on every process (a sharded model is gathered); process 0 writes."""
    try:
        config_to_hf(model.cfg)
    except ValueError as e:
        log.warning("%s: not exported (%s)", record.name, e)
        return False
    save_hf(model, out)
    if jax.process_index() == 0:
        for name in TOKENIZER_FILES:
            if (record / name).exists():
                (epath.Path(out) / name).write_bytes((record / name).read_bytes())
    return True


def export_agents(trainer) -> list[str]:
    """Every agent of a finished run written to `<workdir>/export/<name>/`; returns the directories written."""
    written = []
    for name, learner in trainer.agents.items():
        out = str(epath.Path(trainer.workdir) / EXPORTS / name)
        record = epath.Path(trainer.workdir) / RECORDS / name
        if write_export(learner.policy_model(), record, out):
            written.append(out)
    log.info("exported %s", written)
    return written


def export_checkpoint(workdir: str, agent: str, out: str, step: int | None = None) -> str:
    """Agent `agent`'s parameters at `step` (default: the latest checkpoint) of the run in `workdir`, restored on
    this host's first device, written to `out` as an HF directory; returns `out`."""
    record = epath.Path(workdir) / RECORDS / agent
    if not (record / "model_config.json").exists():
        raise FileNotFoundError(f"--agent={agent!r}: {workdir} has no record {record} (agents: "
                                f"{sorted(p.name for p in (epath.Path(workdir) / RECORDS).glob('*'))})")
    agent_cfg = ml_collections.ConfigDict(json.loads((record / "agent.json").read_text()))
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    rules, model_cfg = get_rules(agent_cfg.get("sharding_rules", "default")), _model_config(record)
    lora = lora_spec(agent_cfg.get("lora"))
    if lora is None:
        graphdef, abstract, _ = abstract_agent_state(model_cfg, agent_cfg.optim, mesh, rules)
    else:
        _, abstract, _, _ = abstract_lora_agent_state(model_cfg, lora, agent_cfg.optim, mesh, rules)
    checkpointer = Checkpointer(workdir)
    try:
        states, _ = checkpointer.restore({agent: abstract}, step=step)
    finally:
        checkpointer.close()
    if lora is None:
        model = model_from_state(graphdef, states[agent])
    else:
        graphdef, base = abstract_model(model_cfg, mesh, rules)  # abstract, with shardings: the restore target
        with ocp.StandardCheckpointer() as restorer:
            nnx.replace_by_pure_dict(base, restorer.restore(record / LORA_BASE, nnx.to_pure_dict(base)))
        model = nnx.merge(graphdef, merged_params(states[agent].params, base, lora.scale))
    if not write_export(model, record, out):
        raise ValueError(f"--agent={agent!r}: its architecture has no transformers equivalent")
    return out


def main(argv) -> None:
    del argv
    flag = flags.FLAGS
    print(export_checkpoint(flag.workdir, flag.agent, flag.out, flag.step))


if __name__ == "__main__":
    flags.DEFINE_string("workdir", None, "the run's workdir (local or gs://)", required=True)
    flags.DEFINE_string("agent", "main", "which agent: main, sub or single")
    flags.DEFINE_string("out", None, "the HF directory to write (local or gs://)", required=True)
    flags.DEFINE_integer("step", None, "the checkpoint's step (default: the latest)")
    app.run(main)
