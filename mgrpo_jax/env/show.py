"""Print one question per split with its expert transcripts, i.e. exactly what each agent sees.

    python -m mgrpo_jax.env.show [--seed 0] [--entities 2000] [--mode multi|single|both]
"""

from __future__ import annotations

import argparse

from mgrpo_jax.env.environment import build_offline_environment
from mgrpo_jax.env.experts import Episode, Transcript
from mgrpo_jax.env.questions import QuestionSetSizes


def format_episode(episode: Episode, title: str) -> str:
    lines = [f"---- {title} ----"]
    for role, text in episode.as_chat():
        lines.append(f"[{role}]\n{text}")
    return "\n".join(lines)


def format_transcript(transcript: Transcript) -> str:
    question = transcript.question
    header = (f"==== {question.split} / {question.id}: {question.kind}, {question.hops} hop(s) ====\n"
              f"Q: {question.text}\nGold: {question.answer}\nExpert ({transcript.mode}): {transcript.answer} "
              f"-> {'correct' if transcript.correct else 'wrong'}")
    parts = [header, format_episode(transcript.top, f"{transcript.top.agent} agent")]
    for index, (sub, score) in enumerate(zip(transcript.subs, transcript.sub_scores, strict=True)):
        parts.append(format_episode(sub, f"sub-agent episode {index + 1} (r_expert = {score:.2f})"))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--entities", type=int, default=2000)
    parser.add_argument("--mode", choices=("multi", "single", "both"), default="multi")
    args = parser.parse_args(argv)
    environment = build_offline_environment(args.seed, args.entities, QuestionSetSizes(20, 20, 5, 5, 5, 5))
    experts = environment.experts()
    for _, questions in environment.questions.items():
        question = questions[0]
        if args.mode in ("multi", "both"):
            print(format_transcript(experts.main_agent(question)), end="\n\n")
        if args.mode in ("single", "both"):
            print(format_transcript(experts.single_agent(question)), end="\n\n")


if __name__ == "__main__":
    main()
