import json
import threading
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mgrpo_jax.env import calculator
from mgrpo_jax.env.protocol import ToolCall
from mgrpo_jax.env.tools import (
    DELEGATE,
    HttpSearchBackend,
    ReasonTool,
    SearchTool,
    VisitTool,
    WorldBackend,
    main_agent_toolbox,
    single_agent_toolbox,
    sub_agent_toolbox,
)
from mgrpo_jax.env.world import generate_world
from mgrpo_jax.store.retry import RetryPolicy


@cache
def backend():
    return WorldBackend(generate_world(5, 800))


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("48210 + 1250", "49460"),
        ("3 * (4 + 5) - 2 ** 3", "19"),
        ("7 / 2", "3.5"),
        ("10 / 4 * 2", "5"),
        ("abs(120 - 450)", "330"),
        ("max(3, 9, 4)", "9"),
        ("round(2.567, 2)", "2.57"),
        ("1921-03-04 < 1930-01-01", "true"),
        ("'1950-01-02' - '1950-01-01'", "1"),
        ("years_between(1921-03-04, 1950-03-03)", "28"),
        ("years_between(1921-03-04, 1950-03-04)", "29"),
        ("abs(years_between(1990-06-01, 1960-07-01))", "29"),
        ("days_between(2000-02-28, 2000-03-01)", "2"),
        ("5 > 3 > 1", "true"),
        ("not (2 == 2) or 1 >= 2", "false"),
        ("6 ÷ 3 × 2 ^ 2", "8"),
    ],
)
def test_calculator(expression, expected):
    assert calculator.evaluate(expression) == expected


@pytest.mark.parametrize(
    "expression",
    ["", "1/0", "__import__('os')", "open('x')", "x + 1", "(1).__class__", "2 ** 1000", "10 ** 40",
     "'abc'", "1921-02-30 < 1", "1921-03-04 < 5", "years_between(3, 4)", "max()", "lambda: 1",
     "[i for i in range(9)]", "(" * 300 + "1" + ")" * 300, "9" * 600, "1 +", "abs(1, 2)",
     # Each of these once raised something other than a CalculatorError, hung, or answered nonsense.
     "(1,2) < 3", "max(1,2) < (3,4)", "1 < 2 < (1,)", "[1,2] < [3]", "(1,2) == (1,2)",  # TypeError
     "round(10**30, -10**30)",  # ran for ever (10 ** 10 ** 30)
     "round(1.5, 10**5)", "round(5, 1.5)",  # digits out of range, or not whole
     "(-8) ** 0.5", "(-8) ** (1/3)",  # complex results
     "max(1921-03-04, 3)", "min(1, (2, 3))", "max(1, True)",  # mixed kinds ("wrong number of arguments" before)
     "()", "\ud800", "1\x00"],
)
def test_calculator_rejects_with_a_message(expression):
    with pytest.raises(calculator.CalculatorError):
        calculator.evaluate(expression)
    assert ReasonTool()({"problem": expression}).startswith("Error: ")


def test_calculator_min_max_of_dates_and_arity():
    assert calculator.evaluate("max(1921-03-04, 1922-01-01)") == "1922-01-01"
    assert calculator.evaluate("min((1921-03-04, 1922-01-01))") == "1921-03-04"
    assert calculator.evaluate("round(1234.5, -2)") == "1200"
    with pytest.raises(calculator.CalculatorError, match="wrong number of arguments for round"):
        calculator.evaluate("round(1, 2, 3)")


_atoms = st.sampled_from(["0", "1", "-1", "2.5", "1e30", "10**30", "1921-03-04", "'1950-01-02'", "()", "(1, 2)",
                          "[3]", "True", "x", "'a'", "None", "1j", "max", "round"])
_operators = st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "^", "<", "<=", "==", "!=", ">", " and ",
                              " or ", " not ", ",", " if ", "@", "<<"])
_calls = st.sampled_from(["abs", "min", "max", "sum", "round", "days_between", "years_between", "date", "len"])


@st.composite
def _expressions(draw, depth=0):
    """Random expressions over the calculator's syntax and beyond: atoms, operators, calls, brackets."""
    kind = draw(st.integers(0, 3 if depth < 3 else 0))
    if kind == 0:
        return draw(_atoms)
    if kind == 1:
        return draw(_expressions(depth + 1)) + draw(_operators) + draw(_expressions(depth + 1))
    if kind == 2:
        arguments = draw(st.lists(_expressions(depth + 1), max_size=3))
        return f"{draw(_calls)}({', '.join(arguments)})"
    return f"({draw(_expressions(depth + 1))})"


@settings(max_examples=500, deadline=None)
@given(st.one_of(_expressions(), st.text(max_size=40)))
def test_calculator_is_total(expression):
    """Any expression: a result, or a CalculatorError with a message for the agent; nothing else, nothing slow."""
    try:
        result = calculator.evaluate(expression)
    except calculator.CalculatorError as error:
        assert str(error)
    else:
        assert isinstance(result, str) and "j" not in result


def test_tools_validate_arguments_and_answer_with_text():
    reason = ReasonTool()
    assert reason({"problem": "2+2"}) == "4"
    assert "needs the argument" in reason({})
    assert "does not take" in reason({"problem": "1", "extra": "x"})
    assert "must be a string" in reason({"problem": 4})
    assert "JSON object" in reason(["2+2"])


def test_tool_arguments_reach_the_tool_as_valid_unicode():
    """A lone surrogate (JSON `"\\ud800"`) can neither reach a backend (URL encoding raises on it) nor come back."""
    seen = []

    class Recording:
        def search(self, query, k):
            seen.append(query)
            return []

        def visit(self, url):
            seen.append(url)
            return None

    toolbox = single_agent_toolbox(Recording())
    output = toolbox.execute(ToolCall("search", {"query": "a\ud800b"}))
    assert output == 'No results for "a\ufffdb". Try other keywords.'
    assert "a\ufffdb" in toolbox.execute(ToolCall("visit", {"url": "a\ud800b"}))
    assert seen == ["a\ufffdb", "a\ufffdb"]
    assert toolbox.execute(ToolCall("reason", {"problem": "\ud800"})).startswith("Error: could not parse")


def test_search_ranks_the_named_entitys_page_first():
    world_backend = backend()
    search = SearchTool(world_backend, top_k=5)
    for entity in world_backend.world.entities[::97]:
        output, hits = search.search_with_hits(f"{entity.name} founded born population")
        assert hits[0].url == entity.url
        assert output.startswith("Search results for") and entity.url in output
        assert len(hits) == 5 and all(len(hit.snippet) > 100 for hit in hits)
    assert search({"query": "   "}) == "Error: the search query is empty."
    assert search({"query": "the of and"}).startswith("No results")


def test_visit_returns_page_text_and_readable_errors():
    world_backend = backend()
    entity = world_backend.world.entities[10]
    output = VisitTool(world_backend)({"url": entity.url})
    assert output.startswith(f"Page: {entity.url}") and world_backend.world.page_of(10).text in output
    assert "no page at" in VisitTool(world_backend)({"url": "https://wiki.offline/person/nobody"})
    truncated = VisitTool(world_backend, max_chars=100)({"url": entity.url})
    assert truncated.endswith("[page truncated]")


def test_toolboxes_per_agent():
    assert main_agent_toolbox().names == ("delegate", "reason")
    assert sub_agent_toolbox(backend()).names == ("search", "visit")
    assert single_agent_toolbox(backend()).names == ("search", "visit", "reason")
    box = main_agent_toolbox()
    assert box.execute(ToolCall("reason", {"problem": "1+1"})) == "2"
    assert box.execute(ToolCall("search", {"query": "x"})).startswith("Error: unknown tool")
    with pytest.raises(ValueError, match="rollout engine"):
        box.execute(ToolCall(DELEGATE, {"task": "x"}))


class _FakeSearchApi(BaseHTTPRequestHandler):
    pages = {"https://example.org/a": {"title": "A page", "text": "Alpha facts."}}

    def do_GET(self):  # noqa: N802 (http.server's naming)
        parsed = urlparse(self.path)
        params = parse_qs(parsed.query)
        if parsed.path == "/search":
            if self.headers.get("Authorization") != "Bearer secret":
                return self._reply(401, b"")
            if params["q"][0] == "broken":
                return self._reply(200, b"not json")
            count = int(params["k"][0])
            results = [{"title": f"T{i}", "url": f"https://example.org/{i}", "snippet": f"s{i}"} for i in range(9)]
            return self._reply(200, json.dumps({"results": results[:count]}).encode())
        if parsed.path == "/fetch":
            page = self.pages.get(params["url"][0])
            if page is None:
                return self._reply(404, b"")
            return self._reply(200, json.dumps(page).encode(), "application/json")
        return self._reply(500, b"")

    def _reply(self, status, body, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def search_api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSearchApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_backend_against_a_local_server(search_api):
    http = HttpSearchBackend(f"{search_api}/search", f"{search_api}/fetch", api_key="secret", timeout_s=5)
    output = SearchTool(http, top_k=3)({"query": "alpha"})
    assert "3. T2" in output and "4. T3" not in output and "https://example.org/1" in output
    assert SearchTool(http)({"query": "broken"}) == "Error: the search service sent a response in an unexpected format"
    visit = VisitTool(http)
    assert "Alpha facts." in visit({"url": "https://example.org/a"})
    assert "no page at" in visit({"url": "https://example.org/missing"})
    unauthorised = HttpSearchBackend(f"{search_api}/search", timeout_s=5)
    assert SearchTool(unauthorised)({"query": "x"}) == "Error: the search service answered HTTP 401"
    assert "no page-fetch endpoint" in VisitTool(unauthorised)({"url": "https://example.org/a"})


def test_http_backend_unreachable_is_text():
    quick = RetryPolicy(max_attempts=2, initial_s=0.01)
    http = HttpSearchBackend("http://127.0.0.1:9/search", timeout_s=1, retry=quick)
    assert SearchTool(http)({"query": "x"}).startswith("Error: the search service is unreachable")
