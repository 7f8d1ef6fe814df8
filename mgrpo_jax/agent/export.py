"""Agents as Hugging Face checkpoints: what `transformers` loads, with the agent's tokenizer files.

    python -m mgrpo_jax.agent.export --workdir=runs/x --agent=main --out=DIR    # the latest checkpoint's weights

The command (`--help`: `HELP`) checks its inputs before it reads a checkpoint (`check_export`): a workdir that is
not a run's, an unknown agent (with a did-you-mean), a step without a checkpoint (listing those there) or a missing
`--out` is one `error:` line on stderr and exit status 2. It prints the folder it wrote, nothing else
(`--verbose`: the libraries' INFO lines too).

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

import argparse
import dataclasses
import difflib
import json
import logging
import sys

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from mgrpo_jax.agent.state import abstract_agent_state, abstract_lora_agent_state, merged_params, model_from_state
from mgrpo_jax.model import abstract_model, get_rules, make_mesh
from mgrpo_jax.model.checkpoint_hf import config_to_hf, save_hf
from mgrpo_jax.model.lora import lora_spec
from mgrpo_jax.model.shapes import ModelConfig
from mgrpo_jax.runtime.backend import choose_platform
from mgrpo_jax.runtime.checkpoint import Checkpointer
from mgrpo_jax.tokenizer import Tokenizer
from mgrpo_jax.tokenizer_hf import TOKENIZER_FILES, write_tokenizer_files

log = logging.getLogger(__name__)

RECORDS, EXPORTS, LORA_BASE = "agents", "export", "base"
CHECKPOINTS = "checkpoints"  # Checkpointer's default subdir
EXIT_USAGE = 2


class ExportError(ValueError):
    """An input `export_checkpoint` cannot export (a workdir, agent, step or output folder); the message names it."""


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
    for name, learner in trainer.learners.items():
        out = str(epath.Path(trainer.workdir) / EXPORTS / name)
        record = epath.Path(trainer.workdir) / RECORDS / name
        if write_export(learner.policy_model(), record, out):
            written.append(out)
    log.info("exported %s", written)
    return written


def checkpoint_steps(workdir: str) -> list[int]:
    """The steps of the complete checkpoints in `workdir` (Orbax writes a step under a temporary name and renames
    it when complete, so a step-named folder is a complete one), read without opening Orbax."""
    folder = epath.Path(workdir) / CHECKPOINTS
    return sorted(int(p.name) for p in folder.glob("*") if p.name.isdigit()) if folder.exists() else []


def check_export(workdir: str, agent: str, step: int | None = None, out: str | None = None) -> int:
    """The step `export_checkpoint` would export (`step`, or the latest), or an `ExportError` naming the input that
    cannot be exported; reads only folder listings and the agent's record."""
    root = epath.Path(workdir)
    if out is not None and epath.Path(out).is_file():
        raise ExportError(f"--out={out}: is a file; the export is a folder")
    if not root.exists():
        raise ExportError(f"--workdir={workdir}: no such folder")
    records = root / RECORDS
    agents = sorted(p.name for p in records.glob("*") if (p / "model_config.json").exists()) \
        if records.exists() else []
    if not agents:
        raise ExportError(f"--workdir={workdir}: not a run's workdir (no {RECORDS}/<agent>/model_config.json in "
                         "it; a run records its agents when it starts)")
    if agent not in agents:
        close = difflib.get_close_matches(agent, agents, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ExportError(f"--agent={agent}: no such agent in {workdir}{hint} (agents: {', '.join(agents)})")
    try:
        config_to_hf(_model_config(records / agent))
    except ValueError as e:
        raise ExportError(f"--agent={agent}: its architecture has no transformers equivalent ({e})") from None
    steps = checkpoint_steps(workdir)
    if not steps:
        raise ExportError(f"--workdir={workdir}: no checkpoint yet (in {root / CHECKPOINTS}; a run writes one every "
                         "train.checkpoint_every steps and when it stops)")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ExportError(f"--step={step}: no checkpoint of that step in {workdir} (steps: "
                         f"{', '.join(map(str, steps))})")
    return step


def export_checkpoint(workdir: str, agent: str, out: str, step: int | None = None) -> str:
    """Agent `agent`'s parameters at `step` (default: the latest checkpoint) of the run in `workdir`, restored on
    this host's first device, written to `out` as an HF directory; returns `out`. Inputs that cannot be exported
    raise `ExportError` (`check_export`) before anything is read."""
    step = check_export(workdir, agent, step, out)
    record = epath.Path(workdir) / RECORDS / agent
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
    write_export(model, record, out)
    return out


HELP = """Write one agent of a training run as a Hugging Face checkpoint (config.json,
safetensors weights, tokenizer files) that transformers' AutoModelForCausalLM and
AutoTokenizer load. A run that finishes exports every agent's final weights to
<workdir>/export/<agent>/; this command exports any checkpoint of a run, finished
or not."""

EPILOG = """examples:
  python -m mgrpo_jax.agent.export --workdir=runs/local --out=hf/main
  python -m mgrpo_jax.agent.export --workdir=gs://bucket/run --agent=sub \\
      --step=200 --out=gs://bucket/hf/sub

A LoRA agent is exported with its adapters merged into its recorded base.
Exit status: 0 when written; 2 for a bad input (one error: line on stderr);
1 for anything else."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as launch/tpu_run.py reports a usage error
        _exit_usage(message)


def _exit_usage(message) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(EXIT_USAGE)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m mgrpo_jax.agent.export", description=HELP, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="the run's workdir (a local folder or gs:// URL)")
    p.add_argument("--out", required=True, help="the folder to write (local or gs://); created if missing")
    p.add_argument("--agent", default="main", help="which agent: main or sub, single for the single-agent mode "
                   "(default: main)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the latest)")
    p.add_argument("--verbose", action="store_true", help="show the libraries' INFO lines (Orbax's, JAX's)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    choose_platform()  # as the launcher does: no libtpu probe and its errors where there is no TPU
    # Orbax logs every file it reads at INFO through absl; an export's output is the one folder it wrote.
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for name in ("absl", "orbax", "jax"):
        logging.getLogger(name).setLevel(level)
    try:
        print(export_checkpoint(args.workdir, args.agent, args.out, args.step))
    except ExportError as e:
        _exit_usage(e)


if __name__ == "__main__":
    main()
