"""The real-service backends against loopback servers on 127.0.0.1 (mgrpo_jax/env/loopback.py): the judge's strict
verdicts, its batches, retries, timeouts and failures, the page reader, the config fields, the API key kept out of
every message, and a `smoke` run whose search, visit and judge all go over HTTP."""

import email.utils
import json
import logging
import os
import threading
import time
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mgrpo_jax.config import get_config, validate
from mgrpo_jax.env.build import build_environment, reward_judge
from mgrpo_jax.env.judges import AnswerCase, HttpJudge, JudgeError, RuleJudge, SubTaskCase
from mgrpo_jax.env.loopback import LoopbackServer, Reply, chat_judge, chat_reply, world_services
from mgrpo_jax.env.prompts import SYSTEM, USER
from mgrpo_jax.env.protocol import render_answer, render_tool_call
from mgrpo_jax.env.scoring import EQUIVALENCE_PROMPT, EXPERT_PROMPT, XBENCH_PROMPT
from mgrpo_jax.env.services import RETRY_AFTER_MAX_S, ChatEndpoint, ServiceClient, public_url, retry_after_s
from mgrpo_jax.env.tools import HttpPageBackend, VisitTool, WebPage
from mgrpo_jax.rl import evaluation
from mgrpo_jax.rl.trainer import Trainer
from mgrpo_jax.runtime.metrics import read_jsonl
from mgrpo_jax.sampling.sampler import SampleOutput
from mgrpo_jax.store.retry import RetryPolicy

QUICK = RetryPolicy(max_attempts=3, initial_s=0.01, max_delay_s=0.02)
KEY = "sk-loopback-7f3a9c"


class _Question:
    def __init__(self, id, text, answer):
        self.id, self.text, self.answer = id, text, answer


QUESTION = _Question("q-1", "Where was Ada born?", "Varn")


def _judge(url, concurrency=4, timeout_s=2.0, api_key=None, retry=QUICK):
    client = ServiceClient("judge endpoint", api_key=api_key, timeout_s=timeout_s, retry=retry)
    return HttpJudge(ChatEndpoint(url + "/v1", "judge-model", client), EQUIVALENCE_PROMPT, concurrency=concurrency)


def _answers(*predictions):
    return [AnswerCase(f"q-1/rollout{k}", QUESTION, p) for k, p in enumerate(predictions)]


# ---------------------------------------------------------------- verdicts


@pytest.mark.parametrize("prompt, reply, verdict", [
    (EQUIVALENCE_PROMPT, "Same place.\nGRADE: CORRECT", 1.0),
    (EQUIVALENCE_PROMPT, "grade: incorrect.", 0.0),
    (EQUIVALENCE_PROMPT, "**GRADE:** CORRECT", 1.0),
    (EQUIVALENCE_PROMPT, "GRADE: CORRECT\nOn reflection:\nGRADE: INCORRECT", 0.0),  # the last verdict counts
    (EQUIVALENCE_PROMPT, "GRADE: CORRECT or INCORRECT", None),
    (EQUIVALENCE_PROMPT, "The answer is correct.", None),
    (EQUIVALENCE_PROMPT, "", None),
    (XBENCH_PROMPT, "最终答案: 1987\n解释: 一致\n结论: 正确", 1.0),
    (XBENCH_PROMPT, "最终答案: 无\n解释: 没有答案\n结论：错误。", 0.0),
    (XBENCH_PROMPT, "结论: 正确或错误", None),
    (XBENCH_PROMPT, "GRADE: CORRECT", None),
    (EXPERT_PROMPT, "Partly done.\nSCORE: 0.75", 0.75),
    (EXPERT_PROMPT, "SCORE: 1", 1.0),
    (EXPERT_PROMPT, "SCORE: 1.5", None),
    (EXPERT_PROMPT, "SCORE: high", None),
    (EXPERT_PROMPT, "SCORE: nan", None),
])
def test_verdicts_are_read_strictly(prompt, reply, verdict):
    assert prompt.parse_verdict(reply) == verdict


@given(st.text(alphabet=st.characters(blacklist_characters=":："), max_size=80), st.booleans())
def test_a_closing_grade_line_decides_whatever_precedes_it(reasoning, correct):
    reply = f"{reasoning}\nGRADE: {'CORRECT' if correct else 'INCORRECT'}"
    assert EQUIVALENCE_PROMPT.parse_verdict(reply) == float(correct)


def test_public_url_drops_credentials_and_query():
    assert public_url(f"https://user:{KEY}@judge.example:8443/v1/x?key={KEY}#f") == "https://judge.example:8443/v1/x"


# ---------------------------------------------------------------- the HTTP judge


def test_http_judge_scores_a_batch_and_logs_unparseable_verdicts_by_id(caplog):
    replies = {"Varn, the old city": "GRADE: CORRECT", "Brel": "GRADE: INCORRECT", "dunno": "no idea"}

    def verdict(system_message, user):
        assert system_message == EQUIVALENCE_PROMPT.system
        return replies[user.split("Predicted answer: ")[1].split("\n")[0]]

    with LoopbackServer(chat_judge(verdict)) as server, caplog.at_level(logging.WARNING):
        judge = _judge(server.url)
        scores = judge.correct(_answers("Varn, the old city", "Brel", "varn", "dunno"))
    assert scores == [1.0, 0.0, 1.0, 0.0]  # "varn" matches the gold exactly: no call
    assert len(server.requests) == 3
    body = server.requests[0].json()
    assert (body["model"], body["temperature"], body["messages"][1]["role"]) == ("judge-model", 0, "user")
    metrics = judge.metrics()
    assert (metrics["judge/calls"], metrics["judge/fast_path"], metrics["judge/unparseable"]) == (3, 1, 1)
    assert [r.getMessage() for r in caplog.records if "no mgrpo-equivalence-v1 verdict" in r.getMessage()] == [
        "judge: no mgrpo-equivalence-v1 verdict in the reply for answer q-1/rollout3 (scored 0): 'no idea'"]


def test_expert_scores_use_the_sub_task_prompt():
    seen = []

    def verdict(system_message, user):
        seen.append(user)
        return "SCORE: 0.25" if "Who founded" in user else "SCORE: 1"

    cases = [SubTaskCase("q-1/rollout0/call0", QUESTION, "Who founded Brel?", "Ada"),
             SubTaskCase("q-1/rollout0/call1", QUESTION, "Where was Ada born?", "Varn")]
    with LoopbackServer(chat_judge(verdict)) as server:
        scores = _judge(server.url).expert(cases)
    assert scores == [0.25, 1.0]
    assert sorted(seen)[0] == EXPERT_PROMPT.user_template.format(question="Where was Ada born?",
                                                                 task="Where was Ada born?", answer="Varn")
    assert "Delegated sub-task: Who founded Brel?\nAssistant's answer: Ada\n" in sorted(seen)[1]


def test_rule_judge_is_the_worlds_scorers():
    judge = RuleJudge(lambda task, answer, question: 0.5 if answer in task else 0.0)
    assert judge.correct(_answers("varn", "Brel")) == [1.0, 0.0] and judge.metrics() == {}
    assert judge.expert([SubTaskCase("c", QUESTION, "about Ada", "Ada"), SubTaskCase("d", QUESTION, "x", "y")]) == [
        0.5, 0.0]


def _scripted(*replies):
    """A handler answering with `replies` in turn, then the last one forever."""
    queue, lock = list(replies), threading.Lock()

    def handle(request):
        with lock:
            return queue.pop(0) if len(queue) > 1 else queue[0]

    return handle


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
def test_throttling_and_server_errors_are_retried(status):
    with LoopbackServer(_scripted(Reply(status, {"error": "busy"}), Reply(status, b""),
                                  Reply(body=chat_reply("GRADE: CORRECT")))) as server:
        judge = _judge(server.url, concurrency=1)
        assert judge.correct(_answers("Brel")) == [1.0]
    assert len(server.requests) == 3 and judge.metrics()["judge/retries"] == 2


@pytest.mark.parametrize("header", ["1", "date"])
def test_a_retry_after_is_waited_instead_of_the_clients_back_off(header):
    """QUICK's own back-off is 10-20 ms; the server's Retry-After (seconds, or an HTTP-date 2 s ahead, which its
    one-second resolution makes 1-2 s) is what the second attempt waits for."""
    value = header if header != "date" else email.utils.formatdate(time.time() + 2, usegmt=True)
    with LoopbackServer(_scripted(Reply(429, {"error": "slow down"}, headers={"Retry-After": value}),
                                  Reply(body=chat_reply("GRADE: CORRECT")))) as server:
        start = time.perf_counter()
        assert _judge(server.url, concurrency=1).correct(_answers("Brel")) == [1.0]
        waited = time.perf_counter() - start
    assert len(server.requests) == 2 and 0.9 <= waited < 5.0


def test_retry_after_values():
    now = 1_700_000_000.0
    assert retry_after_s("3", now) == 3.0 and retry_after_s(" 0.5 ", now) == 0.5
    assert retry_after_s(email.utils.formatdate(now + 7, usegmt=True), now) == 7.0
    assert retry_after_s(email.utils.formatdate(now - 30, usegmt=True), now) == 0.0  # already past
    assert retry_after_s("86400", now) == retry_after_s(email.utils.formatdate(now + 86400, usegmt=True), now) \
        == RETRY_AFTER_MAX_S == 60.0
    for unreadable in (None, "", "soon", "Mon, 99 Foo 2026", "nan"):
        assert retry_after_s(unreadable, now) is None, unreadable
    assert retry_after_s("-4", now) == 0.0


def test_a_retry_after_past_the_deadline_gives_up_at_once():
    with LoopbackServer(_scripted(Reply(503, b"", headers={"Retry-After": "3600"}))) as server:
        start = time.perf_counter()
        with pytest.raises(JudgeError, match=r"HTTP 503; 1 attempt in"):
            _judge(server.url, retry=RetryPolicy(max_attempts=3, initial_s=0.01, deadline_s=30.0)).correct(
                _answers("Brel"))
    assert time.perf_counter() - start < 2.0 and len(server.requests) == 1


def test_an_endpoint_that_stays_down_fails_the_step_with_a_clear_error():
    with LoopbackServer(_scripted(Reply(503, b"down")), max_requests=20) as server:
        with pytest.raises(JudgeError) as failure:
            _judge(server.url, concurrency=1).correct(_answers("Brel"))
    assert len(server.requests) == QUICK.max_attempts  # bounded: no retry storm
    message = str(failure.value)
    assert message.startswith("the judge endpoint is unreachable (HTTP 503; 3 attempts in ")
    assert "/v1/chat/completions), judging answer q-1/rollout0: the step cannot be scored" in message


def test_a_refused_connection_fails_the_step_too():
    with LoopbackServer(_scripted(Reply())) as server:
        url = server.url
    with pytest.raises(JudgeError, match="judge endpoint is unreachable .*ConnectionRefusedError"):
        _judge(url).correct(_answers("Brel"))


def test_a_non_retryable_status_fails_at_once():
    with LoopbackServer(_scripted(Reply(401, {"error": "bad key"}))) as server:
        with pytest.raises(JudgeError, match="judge endpoint answered HTTP 401"):
            _judge(server.url).correct(_answers("Brel"))
    assert len(server.requests) == 1


def test_malformed_replies_are_retried_then_fail():
    good = Reply(body=chat_reply("GRADE: INCORRECT"))
    for malformed in (Reply(body=b"<html>gateway</html>", content_type="text/html"), Reply(body={"choices": []}),
                      Reply(body={"choices": [{"message": {"content": None}}]})):
        with LoopbackServer(_scripted(malformed, good)) as server:
            assert _judge(server.url).correct(_answers("Brel")) == [0.0]
        with LoopbackServer(_scripted(malformed)) as server:
            with pytest.raises(JudgeError, match="not a chat completion|without text content"):
                _judge(server.url).correct(_answers("Brel"))


def test_slow_replies_time_out_and_are_retried():
    slow, fast = Reply(body=chat_reply("GRADE: CORRECT"), delay_s=1.0), Reply(body=chat_reply("GRADE: CORRECT"))
    with LoopbackServer(_scripted(slow, fast)) as server:
        assert _judge(server.url, timeout_s=0.2).correct(_answers("Brel")) == [1.0]
    with LoopbackServer(_scripted(slow)) as server:
        start = time.perf_counter()
        with pytest.raises(JudgeError, match=r"no answer within 0.2 s; 2 attempts"):
            _judge(server.url, timeout_s=0.2, retry=RetryPolicy(max_attempts=2, initial_s=0.01)).correct(
                _answers("Brel"))
    assert time.perf_counter() - start < 2.0


def test_requests_in_flight_stay_within_the_concurrency():
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def handle(request):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.05)
        with lock:
            state["now"] -= 1
        return Reply(body=chat_reply("GRADE: INCORRECT"))

    with LoopbackServer(handle) as server:
        scores = _judge(server.url, concurrency=3).correct(_answers(*[f"guess {i}" for i in range(12)]))
    assert scores == [0.0] * 12 and len(server.requests) == 12
    assert 2 <= state["most"] <= 3


# ---------------------------------------------------------------- the page reader


def test_page_reader_formats_errors_and_truncation():
    pages = {"https://a.example/x": Reply(body={"title": "X", "text": "Alpha beta gamma delta."}),
             "https://a.example/plain": Reply(body="plain words here", content_type="text/plain"),
             "https://a.example/broken": Reply(body=b"{not json"),
             "https://a.example/forbidden": Reply(403, b"")}

    def handle(request):
        url = request.query.get("url") or request.path.removeprefix("/r/")
        return pages.get(url, Reply(404, b""))

    with LoopbackServer(handle) as server:
        reader = HttpPageBackend(server.url + "/read", timeout_s=2, retry=QUICK)
        assert reader.visit("https://a.example/x") == WebPage("https://a.example/x", "X", "Alpha beta gamma delta.")
        assert reader.visit("https://a.example/missing") is None
        template = HttpPageBackend(server.url + "/r/{url}", timeout_s=2, retry=QUICK)
        assert template.visit("https://a.example/plain").text == "plain words here"
        asked = len(server.requests)
        assert template.visit("https://a.example/a page\n") is None  # a model-written URL: escaped, asked once
        assert [r.path for r in server.requests[asked:]] == ["/r/https://a.example/a%20page%0A"]
        visit = VisitTool(reader, max_chars=10)
        assert visit({"url": "https://a.example/x"}) == "Page: https://a.example/x\n\nAlpha beta\n[page truncated]"
        assert "no page at" in visit({"url": "https://a.example/missing"})
        assert visit({"url": "https://a.example/broken"}) == (
            "Error: the page service sent a response in an unexpected format")
        assert visit({"url": "https://a.example/forbidden"}) == "Error: the page service answered HTTP 403"
    with LoopbackServer(_scripted(Reply(502, b""), Reply(body={"title": "", "text": "ok"}))) as server:
        assert VisitTool(HttpPageBackend(server.url, retry=QUICK))({"url": "u"}) == "Page: u\n\nok"
    with LoopbackServer(_scripted(Reply(503, b""))) as server:
        output = VisitTool(HttpPageBackend(server.url, retry=QUICK))({"url": "u"})
    assert output.startswith("Error: the page service is unreachable (HTTP 503; 3 attempts in ")


# ---------------------------------------------------------------- config and the API key


def _http_config(urls: dict | None = None):
    config = get_config("xbench", "smoke")
    for field, value in (urls or {}).items():
        config.env[field] = value
    return config


def test_config_checks_the_service_fields():
    validate(_http_config())
    validate(_http_config({"judge_url": "http://127.0.0.1:8000/v1", "judge_model": "m",
                           "search_url": "https://search.example/api", "visit_url": "https://r.example/{url}"}))
    bad = {"judge_url": "ftp://judge/v1", "visit_url": "r.example", "judge_api_key_env": "MY KEY",
           "judge_concurrency": 0, "http_timeout_s": 0}
    with pytest.raises(ValueError) as problems:
        validate(_http_config(bad))
    text = str(problems.value)
    for field in ("env.judge_url='ftp://judge/v1': must be an http", "env.visit_url='r.example'",
                  "env.judge_api_key_env='MY KEY'", "env.judge_concurrency=0", "env.http_timeout_s=0",
                  "env.judge_model='': env.judge_url is set"):
        assert field in text, field


def test_the_api_key_goes_only_into_the_authorization_header(monkeypatch, caplog):
    monkeypatch.setenv("MGRPO_JUDGE_API_KEY", KEY)
    with LoopbackServer(_scripted(Reply(body=chat_reply("GRADE: maybe")), Reply(503, b""))) as server:
        config = _http_config({"judge_url": server.url + "/v1", "judge_model": "m", "http_max_attempts": 2,
                               "http_backoff_s": 0.01, "http_timeout_s": 2.0})
        judge = reward_judge(config, env=None)
        with caplog.at_level(logging.DEBUG):
            assert judge.correct(_answers("Brel")) == [0.0]
            with pytest.raises(JudgeError) as failure:
                judge.correct(_answers("Ada"))
    assert {r.headers.get("Authorization") for r in server.requests} == {f"Bearer {KEY}"}
    shown = [caplog.text, str(failure.value), repr(judge), repr(judge.endpoint.client), json.dumps(judge.metrics()),
             json.dumps(config.to_dict())]
    assert all(KEY not in text for text in shown)
    assert "api_key=set" in repr(judge.endpoint.client)


# ---------------------------------------------------------------- a smoke run over HTTP


class _Script:
    """A sampler that writes the given turns in order (turn i of an episode: `turns[i]`), stopping each on the
    end-of-turn token; log-probs 0."""

    top_k, top_p = 0, 1.0  # no filters: the engine records them on each episode

    def __init__(self, tokenizer, turns):
        self.eot = tokenizer.end_of_turn_id
        self.opening = tokenizer.render_chat([(SYSTEM, "s"), (USER, "u")])[0].count(self.eot)
        self.turns = [tokenizer.encode(text) + [self.eot] for text in turns]

    def sample(self, prompts, *, max_new, budgets=None, **kwargs):
        tokens = np.zeros((len(prompts), max_new), np.int32)
        lengths = np.zeros(len(prompts), np.int32)
        for row, prompt in enumerate(prompts):
            turn = self.turns[min((list(prompt).count(self.eot) - self.opening) // 2, len(self.turns) - 1)]
            assert len(turn) <= max_new, "a scripted turn longer than rollout.max_turn_tokens"
            tokens[row, :len(turn)], lengths[row] = turn, len(turn)
        return SampleOutput(tokens, np.zeros(tokens.shape, np.float32), lengths, np.ones(len(prompts), bool))


@pytest.mark.slow
def test_a_smoke_run_with_http_search_visit_and_judge(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MGRPO_JUDGE_API_KEY", KEY)
    config = _http_config()
    config.warmstart.steps, config.train.steps, config.train.eval_every = 0, 1, 0
    config.rollout.max_turn_tokens = 96
    env = build_environment(config)
    page = env.world.entities[0]

    def verdict(system_message, user):
        return "结论: 正确" if system_message == XBENCH_PROMPT.system else "SCORE: 0.5"

    with LoopbackServer(world_services(env.backend)) as web, LoopbackServer(chat_judge(verdict)) as judge:
        config.env.search_url, config.env.visit_url = web.url + "/search", web.url + "/read"
        config.env.judge_url, config.env.judge_model, config.env.visit_max_chars = judge.url + "/v1", "m", 40
        validate(config)
        trainer = Trainer(config, str(tmp_path))
        tok = trainer.tokenizer
        trainer.engine.top.sampler = _Script(tok, [render_tool_call("delegate", {"task": f"Who is {page.name}?"}),
                                                   render_answer("nobody knows")])
        trainer.engine.sub.sampler = _Script(tok, [render_tool_call("search", {"query": page.name}),
                                                   render_tool_call("visit", {"url": page.url}),
                                                   render_answer("a person")])
        with caplog.at_level(logging.INFO):
            summary = trainer.run()
    q_k = config.rollout.queries * config.rollout.samples
    assert sorted(r.path for r in web.requests) == ["/read"] * q_k + ["/search"] * q_k
    assert len(judge.requests) == 2 * q_k  # every answer and every sub-task answer, none by the fast path
    assert (summary["judge/calls"], summary["judge/fast_path"], summary["judge/unparseable"]) == (2 * q_k, 0, 0)
    assert summary["main/correct"] == 1.0 and summary["sub/expert"] == 0.5
    step = [r for r in read_jsonl(os.path.join(tmp_path, "metrics.jsonl")) if "step" in r][-1]
    assert step["judge/calls"] == 2 * q_k
    saved = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.suffix in (".json", ".jsonl"))
    assert KEY not in saved and KEY not in caplog.text


# ---------------------------------------------------------------- evaluation through the judge


class _EvalEngine:
    """Answers question i of every set with `answers[i]` (one run each), as `RolloutEngine.run` lays them out."""

    def __init__(self, answers):
        self.answers = answers

    def run(self, questions, runs, seed=0):
        return types.SimpleNamespace(top=[[types.SimpleNamespace(answer=self.answers[qi], question_index=qi)
                                           for _ in range(runs)] for qi in range(len(questions))])


def _evaluate(judge_url=None):
    config = _http_config({"judge_url": judge_url} if judge_url else None)
    config.train.eval_runs, config.train.eval_questions = 1, 0
    questions = [_Question(f"q-{i}", f"Where was person {i} born?", "Varn") for i in range(3)]
    env = types.SimpleNamespace(questions=types.SimpleNamespace(split=lambda name: questions))
    return evaluation.evaluate(config, env, _EvalEngine(["varn", "the town of Varn", None]), step=0)


def test_evaluation_is_judged_by_the_configured_judge_after_the_exact_match():
    seen = []

    def verdict(system_message, user):
        seen.append(system_message)
        return "结论: 正确" if system_message == XBENCH_PROMPT.system else "GRADE: CORRECT"

    with LoopbackServer(chat_judge(verdict)) as server:
        judged = _evaluate(server.url + "/v1")
    # "varn" is an exact match (no call), "the town of Varn" is judged correct, no answer is wrong without a call;
    # GAIA keeps its own exact match.
    assert judged == pytest.approx({"eval/eval_gaia/accuracy": 1 / 3, "eval/eval_xbench/accuracy": 2 / 3,
                                    "eval/eval_webwalker/accuracy": 2 / 3})
    assert sorted(seen) == sorted([XBENCH_PROMPT.system, EQUIVALENCE_PROMPT.system])
    assert "the town of Varn" in server.requests[0].json()["messages"][1]["content"]


def test_evaluation_without_a_judge_is_exact_match():
    assert set(_evaluate().values()) == {1 / 3}
