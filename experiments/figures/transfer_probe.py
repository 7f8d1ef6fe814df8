"""Why new texts of trained kinds lose accuracy: the transfer gap read question by question (issue 36, item 3).

    python -m experiments.figures.transfer_probe --run RUN_DIR [--questions 120] [--samples 3] [--out OUT.json]

`RUN_DIR` is a finished stage-2 run's workdir (the final system of a world). The probe asks that system three sets
in the world, `--samples` rollouts each at the rollout temperature: `trained` (up to `--questions` of the stage-2
texts the run trained on: its curriculum's kept ids), `fresh` (the run's fresh set) and `validation` (`--questions`
new texts of the stage-2 kinds, drawn by the run's own world and question generator with a larger validation size,
minus any text of the run's training splits), so a probe world need not be one the figures use. It reads every
rollout against the question's gold decomposition. Each rollout gets one outcome:

  correct          the final answer matches the gold answer;
  format           the main agent broke the protocol or hit a limit before answering;
  first_call       the first delegated task is not the gold first step (wrong fact or wrong name copied);
  sub_answer       a delegated task was a gold step but the sub-agent's answer was not that step's answer;
  chaining         every call so far was right, but a later call does not ask the next gold step (the
                   previous answer was not carried into the next hop, or a step was skipped or repeated);
  final_answer     every gold step was asked and answered, but the final answer is not the gold one (a
                   comparison computed wrongly, or the last answer not copied).

The result gives, per set and per question kind and hop count, the accuracy and the outcome shares, and the gap
(trained - validation; `gap_fresh`: fresh - validation) per kind with the kinds' counts, so a gap from a different
mix of kinds is told from a gap within a kind. `--transcripts N` prints N validation failures and N successes on
trained texts.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import tempfile

from mgrpo_jax.env.scoring import world_answer_correct

OUTCOMES = ("correct", "format", "first_call", "sub_answer", "chaining", "final_answer")


def _norm(text: str | None) -> str:
    return " ".join((text or "").split()).lower()


def delegated_task(sub) -> str:
    """The task a sub-agent episode was given: the delegate call's own `task` field, else the episode's task text."""
    return sub.call.get("task") or sub.task or ""


def outcome(question, episode) -> str:
    """One rollout's outcome against the question's gold decomposition (module docstring)."""
    if episode.answer is not None and world_answer_correct(episode.answer, question.answer):
        return "correct"
    if episode.answer is None or episode.format_error:
        return "format"
    gold = [step for step in question.decomposition if step.fact is not None]
    calls = [(_norm(delegated_task(sub)), sub.answer) for sub in episode.subs]
    asked = {_norm(step.description): step for step in gold}
    for i, (task, answer) in enumerate(calls):
        step = asked.get(task)
        if step is None:
            return "first_call" if i == 0 else "chaining"
        if not world_answer_correct(answer or "", step.answer):
            return "sub_answer"
    done = {task for task, _ in calls}
    if any(_norm(step.description) not in done for step in gold):
        return "chaining" if calls else "first_call"
    return "final_answer"


def summarize(questions, episodes_by_question) -> dict:
    """Accuracy and outcome shares overall and per (kind, hops)."""
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for question, episodes in zip(questions, episodes_by_question, strict=True):
        for episode in episodes:
            result = outcome(question, episode)
            groups["all"].append(result)
            groups[f"{question.kind}/{question.hops}"].append(result)
    counts = collections.Counter(f"{q.kind}/{q.hops}" for q in questions)
    out = {}
    for key, results in sorted(groups.items()):
        tally = collections.Counter(results)
        out[key] = {"questions": len(questions) if key == "all" else counts[key], "rollouts": len(results),
                    "accuracy": tally["correct"] / len(results),
                    "outcomes": {name: tally[name] / len(results) for name in OUTCOMES}}
    return out


def gap(fresh: dict, validation: dict) -> dict:
    """`fresh` - `validation` accuracy (any two sets' summaries) overall and per kind, with the kinds' question
    counts in each set."""
    kinds = sorted(set(fresh) | set(validation))
    return {kind: {"fresh": fresh.get(kind, {}).get("accuracy"),
                   "validation": validation.get(kind, {}).get("accuracy"),
                   "gap": (fresh[kind]["accuracy"] - validation[kind]["accuracy"])
                   if kind in fresh and kind in validation else None,
                   "counts": [fresh.get(kind, {}).get("questions", 0), validation.get(kind, {}).get("questions", 0)]}
            for kind in kinds}


@contextlib.contextmanager
def saved_system(run_dir: str):
    """Yields (trainer, config): the system saved in `run_dir` (any finished run's workdir: its latest checkpoint),
    rebuilt at the `figures` preset in its own world and seed, in a scratch workdir that is removed afterwards."""
    from mgrpo_jax.config import get_config
    from mgrpo_jax.rl.trainer import Trainer

    with open(os.path.join(run_dir, "summary.json")) as f:
        saved = json.load(f)["run"]["config"]
    config = get_config("xbench", f"figures,{saved['mode']}")
    config.seed, config.env.seed = saved["seed"], saved["env"]["seed"]
    config.train.log_transcripts = 0
    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(config, scratch)
        trainer.init_from_checkpoint(run_dir)
        yield trainer, config


def rollouts(trainer, questions, samples: int, seed: int = 0) -> list[list]:
    """`samples` whole-system rollouts of each question, at the rollout temperature: [[episode] per question]."""
    result = trainer.engine.run(questions, samples, seed=seed)
    by_question = [[] for _ in questions]
    for row in result.top:
        for episode in row:
            by_question[episode.question_index].append(episode)
    return by_question


def probe(run_dir: str, questions: int, samples: int, seed: int = 0):
    """(sets {name: questions}, episodes {name: [[episode] per question]}, config) of the system saved in run_dir.

    Sets: `trained` (up to `questions` of the stage-2 texts the run trained on, its curriculum's kept ids, asked in
    the world), `fresh` (the run's own fresh set) and `validation` (`questions` new texts of the stage-2 kinds:
    drawn by the world's generator with a larger validation size, minus any text the run's training splits hold)."""
    from mgrpo_jax.config import get_config
    from mgrpo_jax.env.build import build_environment

    with open(os.path.join(run_dir, "curriculum.json")) as f:
        kept = json.load(f)["kept"]
    sets, episodes = {}, {}
    with saved_system(run_dir) as (trainer, config):
        wide = get_config("xbench", "figures")
        wide.env.seed = config.env.seed
        wide.env.sizes.validation = questions
        splits = trainer.env.questions
        by_id = {q.id: q for q in splits.stage2}
        seen = {q.text for q in (*splits.stage1, *splits.stage2)}
        sets["trained"] = [by_id[i] for i in kept][:questions]
        sets["fresh"] = list(splits.fresh)
        sets["validation"] = [q for q in build_environment(wide).questions.validation if q.text not in seen]
        for name, chosen in sets.items():
            episodes[name] = rollouts(trainer, chosen, samples, seed)
    return sets, episodes, config


def render(question, episode) -> str:
    calls = "; ".join(f"[{delegated_task(sub)}] -> {sub.answer}" for sub in episode.subs) or "no calls"
    gold = " / ".join(f"{s.description} = {s.answer}" for s in question.decomposition)
    return (f"{question.kind}/{question.hops} `{question.text}` gold `{question.answer}` ({gold}) | {calls} | "
            f"answer `{episode.answer}` ({outcome(question, episode)})")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a finished run's workdir (its final checkpoint is probed)")
    parser.add_argument("--questions", type=int, default=120, help="questions per set (fresh, validation)")
    parser.add_argument("--samples", type=int, default=3, help="rollouts per question")
    parser.add_argument("--transcripts", type=int, default=0, help="validation failures and fresh successes shown")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args(argv)
    if not os.path.exists(os.path.join(args.run, "summary.json")):
        raise SystemExit(f"--run {args.run}: no summary.json there; pass a finished run's workdir")
    sets, episodes, config = probe(args.run, args.questions, args.samples)
    result = {"run": os.path.abspath(args.run), "world": int(config.env.seed), "samples": args.samples,
              "sets": {name: summarize(sets[name], episodes[name]) for name in sets}}
    result["gap"] = gap(result["sets"]["trained"], result["sets"]["validation"])
    result["gap_fresh"] = gap(result["sets"]["fresh"], result["sets"]["validation"])
    for kind, row in result["gap"].items():
        print(f"[transfer] {kind}: fresh {row['fresh']} validation {row['validation']} gap {row['gap']} "
              f"counts {row['counts']}")
    for name in sets:
        print(f"[transfer] {name} outcomes: {result['sets'][name]['all']['outcomes']}")
    if args.transcripts:
        for name, want in (("validation", False), ("trained", True)):
            shown = 0
            for question, rollouts in zip(sets[name], episodes[name], strict=True):
                for episode in rollouts:
                    if (outcome(question, episode) == "correct") == want and shown < args.transcripts:
                        print(f"[{name}] {render(question, episode)}")
                        shown += 1
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    return result


if __name__ == "__main__":
    main()
