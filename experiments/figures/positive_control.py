"""Positive controls for the compact miniature: do a few RL steps move the warm-started agents?

    python -m experiments.figures.positive_control --init runs/figures/warm_mgrpo [--steps 8] [--lr 5e-4]

Two checks from a warm-started checkpoint (any run of the `figures` or `local` preset):

1. **The sub-agent alone.** Tasks whose fact is in the sub-agent expert's wrong-kind subset (the clone copies the
   mistake there), K = 8 samples per task, reward = the expert judge's score only, `--steps` updates of the
   sub-agent's RL step. Reported: greedy and sampled success on those tasks before and after.
2. **The same mistake inside the system.** One M-GRPO step's sub-agent batch, as the trainer builds it (R_S with
   the main agent's correctness, pooled over the query's aligned slots with duplicates): the mean advantage of
   rows that open the right namesake and of rows that open the wrong one, on affected and on clean facts. The
   gap between right and wrong is the signal co-training gets for this mistake; compare it with check 1's.

The last line is one JSON object.

`gate(root)` is the cheap control `run_all` runs on the first seed's warm start and stage 1 before it trains
anything else: do the agents keep the format, do rewards vary within a group, do the RL steps move the policy?
"""

from __future__ import annotations

import argparse
import collections
import json
import re

import numpy as np

from mgrpo_jax.config import get_config
from mgrpo_jax.core import group_advantages
from mgrpo_jax.env.build import noise_config
from mgrpo_jax.env.compact.world import FACTS
from mgrpo_jax.rl.trainer import Trainer
from mgrpo_jax.rollout import batches


def _sub_episodes(trainer: Trainer, tasks: list[str], samples: int, seed: int, temperature: float):
    subs = [trainer.engine.start_sub(task, question_index=i, rollout=k, invocation=0)
            for i, task in enumerate(tasks) for k in range(samples)]
    trainer.engine.run_subs(subs, seed=seed, temperature=temperature)
    return subs


def _success(trainer: Trainer, subs) -> float:
    return float(np.mean([trainer.env.judge.score(s.task, s.answer) for s in subs]))


def sub_alone(trainer: Trainer, tasks: list[str], steps: int, queries: int = 16, samples: int = 8) -> dict:
    agent = trainer.agents["sub"]
    out = {"greedy_before": _success(trainer, _sub_episodes(trainer, tasks, 1, 0, 0.0)),
           "sampled_before": _success(trainer, _sub_episodes(trainer, tasks, 4, 1, 1.0))}
    for step in range(steps):
        chosen = [tasks[(step * queries + i) % len(tasks)] for i in range(queries)]
        subs = _sub_episodes(trainer, chosen, samples, 100 + step, 1.0)
        reward = np.asarray([trainer.env.judge.score(s.task, s.answer) for s in subs], np.float32)
        reward = reward.reshape(queries, samples)
        adv = np.asarray(group_advantages(reward, np.ones_like(reward)))
        rows = batches.top_batch([subs[i * samples:(i + 1) * samples] for i in range(queries)], adv,
                                 agent.config.context_tokens, trainer.tokenizer.pad_id)
        agent.train(rows)
    out["greedy_after"] = _success(trainer, _sub_episodes(trainer, tasks, 1, 0, 0.0))
    out["sampled_after"] = _success(trainer, _sub_episodes(trainer, tasks, 4, 1, 1.0))
    return out


def _opened(trainer: Trainer, text: str):
    """(fact, right namesake opened?) of a rendered sub-agent row, or None if it opened nothing readable."""
    messages = [re.sub(r"^<\|[a-z]+\|>", "", seg).replace("<|im_end|>", "") for seg in text.split("<|im_start|>")]
    task = next((m.split() for m in messages if m.startswith("?")), [])
    results = next((m.split()[1:] for m in messages if m.startswith("=> r1")), [])
    opened = next((m.split() for m in messages if m.startswith("[open")), [])
    if len(task) != 3 or task[1] not in FACTS or len(opened) < 2:
        return None
    listed = {results[i]: (results[i + 1], results[i + 2]) for i in range(0, len(results) - 2, 3)}
    if opened[1] not in listed:
        return None
    return task[1], listed[opened[1]] == (task[2], FACTS[task[1]][0])


def system_signal(trainer: Trainer, steps: int = 2) -> dict:
    captured = []
    for _ in range(steps):  # the batches as the trainer builds them; no update
        trainer.rl_step(update=False)
        main_rows, sub_rows = trainer.dry_rows
        captured += [(trainer.top_name, main_rows)] + ([("sub", sub_rows)] if sub_rows else [])
    affected = noise_config(trainer.config).wrong_kind
    advantages = collections.defaultdict(list)
    for name, rows in captured:
        for batch in (rows if isinstance(rows, list) else [rows]):
            if name != "sub":
                continue
            for row in np.flatnonzero(batch["weights"] > 0):
                opened = _opened(trainer, trainer.tokenizer.decode(batch["tokens"][row][batch["attention_mask"][row]]))
                if opened is not None:
                    key = f"{'affected' if opened[0] in affected else 'clean'}_{'right' if opened[1] else 'wrong'}"
                    advantages[key].append(float(batch["advantages"][row]))
    return {key: {"rows": len(v), "mean_advantage": round(float(np.mean(v)), 3)}
            for key, v in sorted(advantages.items())}


def gate(warm_rows: list[dict], stage1_rows: list[dict], format_target: float) -> list[str]:
    """The problems that make a long set of runs pointless, from a warm start's and its stage 1's metric rows (empty:
    go). Every agent's last greedy format check reaches `format_target`; in stage 1 some groups have rewards that
    vary (not every group has zero std), the main agent's reward is not constant, and its updates move the policy
    (a gradient and an approximate KL above 0 on some step)."""
    problems = []
    checks = {}
    for row in warm_rows:
        checks.update({k: v for k, v in row.items() if k.startswith("warmstart/") and k.endswith("/format_ok")})
    if not checks:
        problems.append("the warm start logged no greedy format check")
    problems += [f"{key} = {value:.2f} < {format_target}" for key, value in sorted(checks.items())
                 if value < format_target]
    rl = [row for row in stage1_rows if "main/reward" in row]
    if not rl:
        return problems + ["stage 1 logged no RL step"]
    queries = max(row.get("main/zero_std_groups", 0.0) for row in rl)
    if all(row.get("main/zero_std_groups", 0.0) >= queries and queries > 0 for row in rl) and \
            len({row["main/reward"] for row in rl}) == 1:
        problems.append("stage 1: every group's rewards are equal at every step (no learning signal)")
    if len({round(row["main/reward"], 6) for row in rl}) == 1:
        problems.append(f"stage 1: main/reward is {rl[0]['main/reward']} at every step")
    if not any(row.get("main/train/grad_norm", 0.0) > 0 and row.get("main/train/approx_kl", 0.0) > 0 for row in rl):
        problems.append("stage 1: no update moved the main agent (grad_norm or approx_kl 0 at every step)")
    return problems


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", required=True, help="a warm-started workdir (its latest checkpoint)")
    parser.add_argument("--workdir", default="runs/positive_control")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    args = parser.parse_args(argv)
    config = get_config("xbench", "figures")
    config.init_checkpoint = args.init
    config.sub.optim.lr = args.lr
    trainer = Trainer(config, args.workdir)
    trainer.init_from_checkpoint(args.init)
    signal = system_signal(trainer)
    trainer.init_from_checkpoint(args.init)
    affected = noise_config(config).wrong_kind
    tasks = [q.decomposition[0].description for q in trainer.env.questions.stage1
             if q.decomposition[0].fact in affected][:64]
    figures = {"sub_alone": sub_alone(trainer, tasks, args.steps), "system_sub_advantages": signal,
               "steps": args.steps, "lr": args.lr, "tasks": len(tasks)}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
