import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mgrpo_jax.env.scoring import (
    EQUIVALENCE_PROMPT,
    XBENCH_PROMPT,
    OpenAICompatibleJudge,
    extract_gaia_final_answer,
    gaia_match,
    score_benchmark_answer,
    xbench_fast_path,
)
from mgrpo_jax.store.retry import RetryPolicy

# What GAIA's official `question_scorer` makes of typical answers: (model answer, gold, counted correct).
GAIA_TABLE = [
    ("17", "17", True), (" 17 ", "17", True), ("$17", "17", True), ("17%", "17", True), ("17.0", "17", True),
    ("1.7e1", "17", True), ("17,000", "17", False), ("17 thousand", "17", False), ("1/10", "0.1", False),
    ("Egalitarian.", "egalitarian", True), ("the egalitarian", "egalitarian", False),
    ("seagull", "sea gull", True), ("Sea-Gull", "sea gull", True), ("paris;london", "Paris, London", True),
    ("London, Paris", "Paris, London", False), ("Paris, London, Rome", "Paris, London", False),
    ("1, 2.50", "1, 2.5", True), ("$3, 4%", "3, 4", True), ("St Louis, Boston", "St. Louis, Boston", False),
    ("1000", "1,000", False), (None, "None", True),
]


@pytest.mark.parametrize(("answer", "gold", "expected"), GAIA_TABLE)
def test_gaia_match_reference_table(answer, gold, expected):
    assert gaia_match(answer, gold) is expected


def test_gaia_match_world_answer_formats():
    assert gaia_match("1921-03-04", "1921-03-04")
    assert gaia_match("federation of toxkler", "Federation of Toxkler")
    assert not gaia_match("1921-03-05", "1921-03-04")
    assert gaia_match("inf", "inf") and not gaia_match("nan", "nan")


def test_extract_gaia_final_answer():
    assert extract_gaia_final_answer("blah FINAL ANSWER: 3\nFINAL ANSWER: Paris ") == "Paris"
    assert extract_gaia_final_answer(" plain ") == "plain"


def test_xbench_fast_path():
    assert xbench_fast_path("推理……\n最终答案: 1987\n", "1987")
    assert xbench_fast_path("最终答案:::1987", "1987") is False  # the text after the first colon is "::1987"
    assert not xbench_fast_path("最终答案: 1988", "1987")
    assert not xbench_fast_path("最终答案 1987", "1987")  # no ASCII colon: leave it to the judge
    assert not xbench_fast_path("1987", "1987")


class _FakeChatServer(BaseHTTPRequestHandler):
    replies: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["temperature"] == 0 and body["messages"][0]["role"] == "system"
        reply = self.replies.pop(0)
        payload = b"garbage" if reply is None else json.dumps({"choices": [{"message": {"content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def chat_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeChatServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_compatible_judge(chat_server):
    _FakeChatServer.replies[:] = ["Same city.\nGRADE: CORRECT", "GRADE: CORRECT... no wait\nGRADE: INCORRECT", None]
    judge = OpenAICompatibleJudge(chat_server, "judge-model", EQUIVALENCE_PROMPT, timeout_s=5,
                                  retry=RetryPolicy(max_attempts=1))
    assert judge("q", "Paris", "It is Paris.")
    assert not judge("q", "Paris", "Lyon")
    assert not judge("q", "Paris", "Paris") and judge.failures == 1
    _FakeChatServer.replies[:] = ["最终答案: 1987\n解释: 一致\n结论: 正确"]
    assert OpenAICompatibleJudge(chat_server, "m", XBENCH_PROMPT, timeout_s=5)("q", "1987", "1987年")


def test_score_benchmark_answer_protocols():
    def always(question, gold, prediction):
        return True

    assert score_benchmark_answer("gaia", "q", "17", "$17")
    assert not score_benchmark_answer("gaia", "q", "17", "seventeen", judge=always)  # GAIA never uses a judge
    assert score_benchmark_answer("xbench", "q", "1987", "最终答案: 1987")
    assert not score_benchmark_answer("xbench", "q", "1987", "大约1987年")
    assert score_benchmark_answer("xbench", "q", "1987", "大约1987年", judge=always)
    assert score_benchmark_answer("webwalker", "q", "Paris", "paris")
    assert score_benchmark_answer("webwalker", "q", "Paris", "The city of Paris", judge=always)
    with pytest.raises(ValueError):
        score_benchmark_answer("mmlu", "q", "a", "a")
