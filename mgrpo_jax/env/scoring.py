"""Answer scorers: GAIA's official normalised exact match, XBench's exact-match fast path, and judges.

`gaia_match` follows the GAIA leaderboard's `question_scorer` rule for rule: numeric gold → strip `$ % ,` and
compare floats exactly; gold with `,`/`;` → positional list compare; otherwise compare with whitespace, case and
ASCII punctuation removed. The offline world's gold answers are written in GAIA's answer format, so the world is scored
with the same function (`world_answer_correct`).

Judges for the LLM-judged benchmarks are any callable `(question, gold, prediction) -> bool`;
`OpenAICompatibleJudge` calls a `/chat/completions` endpoint. Judge prompts here are this project's own
wording of each benchmark's protocol (and of the paper's sub-task expert score, `EXPERT_PROMPT`), versioned so
scores can record which prompt produced them. Verdicts are read strictly: the reply's last `GRADE:` / `结论:` /
`SCORE:` line must hold exactly one of the allowed values, anything else is no verdict (None).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from dataclasses import dataclass

from mgrpo_jax.env.services import DEFAULT_RETRY, ChatEndpoint, ServiceClient, ServiceError
from mgrpo_jax.store.retry import RetryPolicy

_WHITESPACE = re.compile(r"\s")
_LIST_SEPARATORS = re.compile(r"[,;]")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _gaia_number(text: str) -> float:
    for character in "$%,":
        text = text.replace(character, "")
    try:
        return float(text)
    except ValueError:
        return float("inf")


def _gaia_string(text: str, remove_punctuation: bool) -> str:
    text = _WHITESPACE.sub("", text).lower()
    return text.translate(_PUNCTUATION) if remove_punctuation else text


def gaia_match(model_answer: str | None, gold: str) -> bool:
    """GAIA's official `question_scorer`: True when `model_answer` counts as `gold` (no tolerance)."""
    model_answer = "None" if model_answer is None else str(model_answer)
    if _is_float(gold):
        return _gaia_number(model_answer) == float(gold)
    if _LIST_SEPARATORS.search(gold):
        gold_items = _LIST_SEPARATORS.split(gold)
        answer_items = _LIST_SEPARATORS.split(model_answer)
        if len(gold_items) != len(answer_items):
            return False
        for answer_item, gold_item in zip(answer_items, gold_items, strict=True):
            if _is_float(gold_item):
                if _gaia_number(answer_item) != float(gold_item):
                    return False
            elif _gaia_string(answer_item, False) != _gaia_string(gold_item, False):
                return False
        return True
    return _gaia_string(model_answer, True) == _gaia_string(gold, True)


def extract_gaia_final_answer(response: str) -> str:
    """The text after the last `FINAL ANSWER:` (GAIA's answer prompt), or the whole response stripped."""
    marker = "FINAL ANSWER:"
    index = response.rfind(marker)
    return (response[index + len(marker) :] if index >= 0 else response).strip()


_XBENCH_FINAL = re.compile(r"最终答案:*(.*)")


def xbench_fast_path(response: str, gold: str) -> bool:
    """XBench's exact-match fast path: the text after the colon of the first `最终答案:` line, stripped,
    equals the gold answer. False means "ask the judge", not "wrong"."""
    match = _XBENCH_FINAL.search(response)
    if match is None or ":" not in match.group(0):
        return False
    return match.group(0).split(":", 1)[1].strip() == gold


def world_answer_correct(prediction: str, gold: str) -> bool:
    """Correctness in the offline world: GAIA normalised exact match against the gold answer."""
    return gaia_match(prediction, gold)


# ---------------------------------------------------------------- judges

Judge = Callable[[str, str, str], bool]  # (question, gold answer, prediction) -> correct


@dataclass(frozen=True)
class JudgePrompt:
    """A judge's instructions and the strict reading of its reply: `parse_verdict(reply)` is 1.0 / 0.0 for a
    yes / no verdict (a score in [0, 1] for `EXPERT_PROMPT`), None when the reply does not end in one."""

    version: str
    system: str
    user_template: str  # formatted with the case's fields: question, gold, prediction (or task, answer)
    parse_verdict: Callable[[str], float | None]

    def render(self, **fields: str) -> tuple[str, str]:
        """(system, user) messages for one case."""
        return self.system, self.user_template.format(**fields)


def _last_labelled(reply: str, label: re.Pattern) -> str | None:
    """The value of the reply's last line `<label>: value` (markdown emphasis and trailing full stops ignored)."""
    values = [match.group(1) for line in str(reply).splitlines()
              if (match := label.match(line.translate(_EMPHASIS).strip()))]
    return values[-1].strip().rstrip(".。").strip() if values else None


_EMPHASIS = str.maketrans("", "", "*_`")
_GRADE = re.compile(r"GRADE\s*:\s*(.*)$", re.IGNORECASE)
_CONCLUSION = re.compile(r"结论\s*[:：]\s*(.*)$")
_SCORE = re.compile(r"SCORE\s*:\s*(.*)$", re.IGNORECASE)


def _binary(label: re.Pattern, yes: str, no: str) -> Callable[[str], float | None]:
    def parse(reply: str) -> float | None:
        value = _last_labelled(reply, label)
        value = value.upper() if value is not None else None
        return 1.0 if value == yes else 0.0 if value == no else None

    return parse


def _unit_score(reply: str) -> float | None:
    value = _last_labelled(reply, _SCORE)
    try:
        score = float(value) if value is not None else None
    except ValueError:
        return None
    return score if score is not None and 0.0 <= score <= 1.0 else None


EQUIVALENCE_PROMPT = JudgePrompt(
    version="mgrpo-equivalence-v1",
    system="You grade answers to research questions. Compare the predicted answer with the reference answer "
    "only; do not solve the question yourself.",
    user_template="Question: {question}\nReference answer: {gold}\nPredicted answer: {prediction}\n\n"
    "Does the predicted answer state the same fact as the reference answer? Ignore phrasing, "
    "punctuation and extra detail that does not contradict the reference. Think briefly, then end with "
    "a line 'GRADE: CORRECT' or 'GRADE: INCORRECT'.",
    parse_verdict=_binary(_GRADE, "CORRECT", "INCORRECT"),
)

XBENCH_PROMPT = JudgePrompt(
    version="mgrpo-xbench-v1",
    system="你是评分员。只比较回答与标准答案，不要自己重新解题。",
    user_template="问题：{question}\n标准答案：{gold}\n回答：{prediction}\n\n"
    "请按三行输出：\n最终答案: 从回答中提取的最终答案（没有则写 无）\n解释: 为什么与标准答案一致或不一致\n"
    "结论: 正确 或 错误（数值答案允许很小的误差）",
    parse_verdict=_binary(_CONCLUSION, "正确", "错误"),
)

# The paper's r_expert: how well the sub-agent carried out the one sub-task the main agent delegated (its own work,
# not whether the whole question was answered).
EXPERT_PROMPT = JudgePrompt(
    version="mgrpo-expert-v1",
    system="You grade a research assistant's work on one sub-task that a lead researcher delegated to it. Judge "
    "only the sub-task: is the answer responsive, specific and supported, without padding?",
    user_template="The lead researcher's question (context only): {question}\nDelegated sub-task: {task}\n"
    "Assistant's answer: {answer}\n\nHow well does the answer fulfil the sub-task? Think briefly, then end with "
    "a line 'SCORE: s' where s is a number from 0 (useless or wrong) to 1 (complete and correct).",
    parse_verdict=_unit_score,
)


def answer_prompt(benchmark: str) -> JudgePrompt:
    """The judging prompt of `benchmark`'s protocol: XBench's three-line Chinese verdict, else the GRADE equivalence
    prompt (WebWalkerQA's CoT-QA grade; GAIA and the offline world when a run asks for a judge)."""
    return XBENCH_PROMPT if benchmark == "xbench" else EQUIVALENCE_PROMPT


class OpenAICompatibleJudge:
    """A `Judge` served by any OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang, a hosted API), one
    call per answer (evaluation scripts; training batches its calls through `mgrpo_jax.env.judges.HttpJudge`).

    An endpoint that stays unavailable, and a reply without a verdict, count as incorrect, matching the
    benchmarks' own evaluators; the former are counted in `failures` so a run can report them.
    """

    def __init__(
        self, base_url: str, model: str, prompt: JudgePrompt = EQUIVALENCE_PROMPT, *,
        api_key: str | None = None, timeout_s: float = 60.0, max_tokens: int = 512, retry: RetryPolicy = DEFAULT_RETRY,
    ):
        client = ServiceClient("judge endpoint", api_key=api_key, timeout_s=timeout_s, retry=retry)
        self.endpoint, self.prompt = ChatEndpoint(base_url, model, client, max_tokens), prompt
        self.failures = 0

    def __call__(self, question: str, gold: str, prediction: str) -> bool:
        try:
            reply = self.endpoint.complete(*self.prompt.render(question=question, gold=gold, prediction=prediction))
        except ServiceError:
            self.failures += 1
            return False
        return self.prompt.parse_verdict(reply) == 1.0


def score_benchmark_answer(
    benchmark: str, question: str, gold: str, prediction: str, judge: Judge | None = None
) -> bool:
    """Correctness under each benchmark's protocol: `gaia` official exact match (never a judge);
    `xbench` fast path, then the judge; `webwalker` the judge (normalised exact match without one);
    `world` the offline world's exact match."""
    if benchmark in ("gaia", "world"):
        return gaia_match(prediction, gold)
    if benchmark == "xbench":
        if xbench_fast_path(prediction, gold) or prediction.strip() == gold:
            return True
        return judge(question, gold, prediction) if judge is not None else False
    if benchmark == "webwalker":
        return judge(question, gold, prediction) if judge is not None else gaia_match(prediction, gold)
    raise ValueError(f"unknown benchmark {benchmark!r}")
