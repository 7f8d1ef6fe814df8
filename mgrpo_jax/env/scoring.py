"""Answer scorers: GAIA's official normalised exact match, XBench's exact-match fast path, and judges.

`gaia_match` follows the GAIA leaderboard's `question_scorer` rule for rule: numeric gold → strip `$ % ,` and
compare floats exactly; gold with `,`/`;` → positional list compare; otherwise compare with whitespace, case and
ASCII punctuation removed. The offline world's gold answers are written in GAIA's answer format, so the world is scored
with the same function (`world_answer_correct`).

Judges for the LLM-judged benchmarks are any callable `(question, gold, prediction) -> bool`;
`OpenAICompatibleJudge` calls a `/chat/completions` endpoint. Judge prompts here are this project's own
wording of each benchmark's protocol, versioned so scores can record which prompt produced them.
"""

from __future__ import annotations

import json
import re
import string
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

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
    version: str
    system: str
    user_template: str  # formatted with question=, gold=, prediction=
    parse_verdict: Callable[[str], bool]


def _last_grade(reply: str) -> bool:
    grades = re.findall(r"GRADE:\s*(CORRECT|INCORRECT)", reply.upper())
    return bool(grades) and grades[-1] == "CORRECT"


def _xbench_conclusion(reply: str) -> bool:
    conclusions = re.findall(r"结论[:：]\s*(正确|错误)", reply)
    return bool(conclusions) and conclusions[-1] == "正确"


EQUIVALENCE_PROMPT = JudgePrompt(
    version="mgrpo-equivalence-v1",
    system="You grade answers to research questions. Compare the predicted answer with the reference answer "
    "only; do not solve the question yourself.",
    user_template="Question: {question}\nReference answer: {gold}\nPredicted answer: {prediction}\n\n"
    "Does the predicted answer state the same fact as the reference answer? Ignore phrasing, "
    "punctuation and extra detail that does not contradict the reference. Think briefly, then end with "
    "a line 'GRADE: CORRECT' or 'GRADE: INCORRECT'.",
    parse_verdict=_last_grade,
)

XBENCH_PROMPT = JudgePrompt(
    version="mgrpo-xbench-v1",
    system="你是评分员。只比较回答与标准答案，不要自己重新解题。",
    user_template="问题：{question}\n标准答案：{gold}\n回答：{prediction}\n\n"
    "请按三行输出：\n最终答案: 从回答中提取的最终答案（没有则写 无）\n解释: 为什么与标准答案一致或不一致\n"
    "结论: 正确 或 错误（数值答案允许很小的误差）",
    parse_verdict=_xbench_conclusion,
)


class OpenAICompatibleJudge:
    """A judge served by any OpenAI-compatible `/chat/completions` endpoint (vLLM, SGLang, a hosted API).

    Failures (network, malformed reply) count as incorrect, matching the benchmarks' own evaluators,
    and are counted in `failures` so a run can report them.
    """

    def __init__(
        self, base_url: str, model: str, prompt: JudgePrompt = EQUIVALENCE_PROMPT, *,
        api_key: str | None = None, timeout_s: float = 60.0, max_tokens: int = 512,
    ):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.prompt = model, prompt
        self.api_key, self.timeout_s, self.max_tokens = api_key, timeout_s, max_tokens
        self.failures = 0

    def __call__(self, question: str, gold: str, prediction: str) -> bool:
        body = json.dumps({
            "model": self.model,
            "temperature": 0,
            "max_tokens": self.max_tokens,
            "messages": [
                {"role": "system", "content": self.prompt.system},
                {"role": "user", "content": self.prompt.user_template.format(
                    question=question, gold=gold, prediction=prediction)},
            ],
        }).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                reply = json.loads(response.read())["choices"][0]["message"]["content"]
        except (urllib.error.URLError, TimeoutError, OSError, ValueError, KeyError, IndexError, TypeError):
            self.failures += 1
            return False
        return self.prompt.parse_verdict(str(reply))


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
