"""The agents' tools behind one interface, and the web backends they read from.

A `Tool` has a name, a JSON-schema for its arguments (`ToolSpec`) and `__call__(arguments) -> str`.
Whatever the agent passes, a tool answers with text: bad arguments, unknown URLs, failed HTTP requests
and calculator errors all come back as an `Error: …` string the agent can read and react to. String
arguments are made valid Unicode (`protocol.valid_unicode`) before a tool sees them, so a lone surrogate can
neither reach a backend (URL encoding would raise) nor come back in the tool's text.

Main agent: `delegate(task, context)` and `reason(problem)`. `delegate` runs a whole sub-agent episode,
so the rollout engine executes it; this module only declares its schema (`DELEGATE_SPEC`).
Sub-agent: `search(query)` and `visit(url)`. Single agent (the baseline): search, visit and reason.

Backends: `WebBackend` is the seam for a real web service. `WorldBackend` serves the offline world with
BM25 (bm25s) over page titles and fact sentences; `HttpSearchBackend` calls a JSON search API, `HttpPageBackend` a
page reader, and `SplitBackend` pairs a search backend with a reader. Page text longer than `VisitTool`'s
`max_chars` (the agent's budget) is cut there.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mgrpo_jax.env import calculator
from mgrpo_jax.env.protocol import ToolCall, valid_unicode
from mgrpo_jax.env.services import DEFAULT_RETRY, ServiceClient, ServiceError
from mgrpo_jax.env.world import World
from mgrpo_jax.store.retry import RetryPolicy

DELEGATE, REASON, SEARCH, VISIT = "delegate", "reason", "search", "visit"
MAIN_AGENT_TOOLS: tuple[str, ...] = (DELEGATE, REASON)
SUB_AGENT_TOOLS: tuple[str, ...] = (SEARCH, VISIT)
SINGLE_AGENT_TOOLS: tuple[str, ...] = (SEARCH, VISIT, REASON)


@dataclass(frozen=True)
class ToolSpec:
    """A tool's name, description and JSON-schema for its `arguments` object."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The OpenAI-style function description that system prompts list."""
        return {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}


def _string_parameters(required: Sequence[str], optional: Sequence[str] = (), **descriptions: str):
    return {
        "type": "object",
        "properties": {
            name: {"type": "string", "description": descriptions[name]} for name in (*required, *optional)
        },
        "required": list(required),
        "additionalProperties": False,
    }


DELEGATE_SPEC = ToolSpec(
    DELEGATE,
    "Hand one focused research sub-task to a sub-agent that can search the web and visit pages. "
    "Returns the sub-agent's short answer.",
    _string_parameters(
        ("task",), ("context",),
        task="the sub-task, self-contained: name the entity and the fact wanted",
        context="optional facts found so far that the sub-agent may need",
    ),
)
REASON_SPEC = ToolSpec(
    REASON,
    "Evaluate arithmetic, comparisons and date differences exactly. Write an expression such as "
    "48210 + 1250, 1921-03-04 < 1930-01-01, or years_between(1921-03-04, 1950-01-02).",
    _string_parameters(("problem",), problem="the expression to evaluate"),
)
SEARCH_SPEC = ToolSpec(
    SEARCH,
    "Search the web. Returns ranked results with title, URL and a snippet.",
    _string_parameters(("query",), query="search keywords"),
)
VISIT_SPEC = ToolSpec(
    VISIT,
    "Open a web page by URL and return its text and links.",
    _string_parameters(("url",), url="a URL from search results or page links"),
)


def validate_arguments(spec: ToolSpec, arguments: Any) -> str | None:
    """Check `arguments` against the spec's schema (object of strings, required keys, no extras);
    returns an error message for the agent, or None when they are valid."""
    if not isinstance(arguments, Mapping):
        return f"Error: arguments of {spec.name} must be a JSON object."
    properties = spec.parameters.get("properties", {})
    missing = [name for name in spec.parameters.get("required", ()) if name not in arguments]
    if missing:
        return f"Error: {spec.name} needs the argument(s) {', '.join(missing)}."
    extra = [name for name in arguments if name not in properties]
    if extra and spec.parameters.get("additionalProperties") is False:
        return f"Error: {spec.name} does not take the argument(s) {', '.join(map(str, extra))}."
    for name, value in arguments.items():
        if properties.get(name, {}).get("type") == "string" and not isinstance(value, str):
            return f"Error: argument {name} of {spec.name} must be a string."
    return None


class BackendError(ServiceError):
    """A backend could not serve a request (bad response); shown to the agent as text, like every `ServiceError`
    (a service unreachable after its retries)."""


@dataclass(frozen=True)
class SearchHit:
    title: str
    url: str
    snippet: str


@dataclass(frozen=True)
class WebPage:
    url: str
    title: str
    text: str


class WebBackend(Protocol):
    """Where search and visit get their data; implement this to plug in a real web service."""

    def search(self, query: str, k: int) -> list[SearchHit]: ...

    def visit(self, url: str) -> WebPage | None:
        """The page at `url`, or None when there is no such page."""
        ...


class WorldBackend:
    """BM25 search and page lookup over an offline `World`.

    The index covers each page's title (twice, so a name query ranks the entity's own page first) and its
    fact sentences; background prose is left out because it carries no information and would only slow
    indexing. Snippets start at the fact sentence that best matches the query, like a web engine's.
    """

    def __init__(self, world: World, snippet_chars: int = 300):
        import bm25s  # imported here: only the offline backend needs it

        self._bm25s = bm25s
        self.world = world
        self.snippet_chars = snippet_chars
        self._urls = [entity.url for entity in world.entities]
        documents = []
        for url in self._urls:
            page = world.pages[url]
            documents.append(f"{page.title} {page.title} " + " ".join(page.fact_sentences))
        tokens = bm25s.tokenize(documents, stopwords="en", show_progress=False)
        self._retriever = bm25s.BM25()
        self._retriever.index(tokens, show_progress=False)

    def _query_tokens(self, text: str) -> list[str]:
        return self._bm25s.tokenize([text], stopwords="en", return_ids=False, show_progress=False)[0]

    def search(self, query: str, k: int) -> list[SearchHit]:
        tokens = self._query_tokens(query)
        if not tokens:
            return []
        k = min(k, len(self._urls))
        documents, scores = self._retriever.retrieve(
            [tokens], k=k, show_progress=False, backend_selection="numpy", n_threads=0
        )
        hits = []
        for document, score in zip(np.asarray(documents)[0], np.asarray(scores)[0], strict=True):
            if score <= 0:
                continue
            page = self.world.pages[self._urls[int(document)]]
            hits.append(SearchHit(page.title, page.url, self._snippet(page.url, set(tokens))))
        return hits

    def _snippet(self, url: str, query_tokens: set[str]) -> str:
        page = self.world.pages[url]

        def overlap(sentence: str) -> int:
            return len(query_tokens & set(self._query_tokens(sentence)))

        best = max(page.fact_sentences, key=overlap)
        start = page.text.find(best)
        snippet = page.text[start : start + self.snippet_chars].replace("\n", " ")
        return snippet + ("…" if start + self.snippet_chars < len(page.text) else "")

    def visit(self, url: str) -> WebPage | None:
        page = self.world.pages.get(url.strip())
        return None if page is None else WebPage(page.url, page.title, page.text)


class HttpSearchBackend:
    """A JSON search API over HTTP (e.g. a self-hosted search proxy), with an optional page reader.

    Search: `GET {search_url}?{query_param}=<query>&{count_param}=<k>` answering
    `{"results": [{"title": …, "url": …, "snippet": …}, …]}` (the list key and the snippet key are
    configurable, e.g. `snippet_key="content"` for SearxNG). Visit: `HttpPageBackend` on `visit_url`, with the
    same key, timeout and retries. Requests retry and time out as `mgrpo_jax.env.services.ServiceClient` does; what
    still fails reaches the agent as an `Error: …` text.
    """

    def __init__(
        self,
        search_url: str,
        visit_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout_s: float = 10.0,
        query_param: str = "q",
        count_param: str = "k",
        results_key: str = "results",
        snippet_key: str = "snippet",
        retry: RetryPolicy = DEFAULT_RETRY,
    ):
        self.search_url = search_url
        self.client = ServiceClient("search service", api_key=api_key, timeout_s=timeout_s, retry=retry)
        self.pages = (HttpPageBackend(visit_url, api_key=api_key, timeout_s=timeout_s, retry=retry)
                      if visit_url else None)
        self.query_param, self.count_param = query_param, count_param
        self.results_key, self.snippet_key = results_key, snippet_key

    def search(self, query: str, k: int) -> list[SearchHit]:
        response = self.client.get(self.search_url, {self.query_param: query, self.count_param: str(k)})
        if response.status != 200:
            raise BackendError(f"the search service answered HTTP {response.status}")
        try:
            results = json.loads(response.body)[self.results_key]
            return [
                SearchHit(str(item.get("title", "")), str(item["url"]), str(item.get(self.snippet_key, "")))
                for item in results[:k]
            ]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise BackendError("the search service sent a response in an unexpected format") from None

    def visit(self, url: str) -> WebPage | None:
        if self.pages is None:
            raise BackendError("this search service has no page-fetch endpoint configured")
        return self.pages.visit(url)


_URL_CHARACTERS = ":/?#[]@!$&'()*+,;=%~-._"


class HttpPageBackend:
    """A page reader over HTTP: the text of the page at a URL (for `visit`).

    `GET {visit_url}?url=<url>`, or, when `visit_url` contains `{url}`, that template with the URL in its place
    (readers such as `https://r.jina.ai/{url}`). The answer is `{"title": …, "text": …}` as JSON, or any plain-text
    body; 404 means no such page. It has no search: pair it with a search backend (`SplitBackend`).
    """

    def __init__(self, visit_url: str, *, api_key: str | None = None, timeout_s: float = 10.0,
                 retry: RetryPolicy = DEFAULT_RETRY):
        self.visit_url = visit_url
        self.client = ServiceClient("page service", api_key=api_key, timeout_s=timeout_s, retry=retry)

    def search(self, query: str, k: int) -> list[SearchHit]:
        raise BackendError("a page reader has no search")

    def visit(self, url: str) -> WebPage | None:
        if "{url}" in self.visit_url:  # the page's URL as a path: only what a URL may not hold is escaped
            response = self.client.get(self.visit_url.replace("{url}", urllib.parse.quote(url, safe=_URL_CHARACTERS)))
        else:
            response = self.client.get(self.visit_url, {"url": url})
        if response.status == 404:
            return None
        if response.status != 200:
            raise BackendError(f"the page service answered HTTP {response.status}")
        if response.content_type == "application/json":
            try:
                payload = json.loads(response.body)
                return WebPage(url, str(payload.get("title", "")), str(payload["text"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise BackendError("the page service sent a response in an unexpected format") from None
        return WebPage(url, "", response.text())


@dataclass(frozen=True)
class SplitBackend:
    """Search from one backend, pages from another (a search API with a separate reader)."""

    searcher: WebBackend
    reader: WebBackend

    def search(self, query: str, k: int) -> list[SearchHit]:
        return self.searcher.search(query, k)

    def visit(self, url: str) -> WebPage | None:
        return self.reader.visit(url)


class Tool:
    """Base class: validates arguments against `spec`, then runs `_run`; expected failures are text."""

    spec: ToolSpec

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        error = validate_arguments(self.spec, arguments)
        if error is not None:
            return error
        arguments = {name: valid_unicode(value) if isinstance(value, str) else value
                     for name, value in arguments.items()}
        try:
            return self._run(**arguments)
        except ServiceError as failure:
            return f"Error: {failure}"

    def _run(self, **arguments: str) -> str:
        raise NotImplementedError


class SearchTool(Tool):
    spec = SEARCH_SPEC

    def __init__(self, backend: WebBackend, top_k: int = 5):
        self.backend, self.top_k = backend, top_k

    def _run(self, query: str) -> str:
        return self.search_with_hits(query)[0]

    def search_with_hits(self, query: str) -> tuple[str, list[SearchHit]]:
        """The tool's text and the hits behind it (scripted experts choose among the hits)."""
        if not query.strip():
            return "Error: the search query is empty.", []
        try:
            hits = self.backend.search(query, self.top_k)
        except ServiceError as failure:
            return f"Error: {failure}", []
        return self._format(query, hits), hits

    @staticmethod
    def _format(query: str, hits: list[SearchHit]) -> str:
        if not hits:
            return f'No results for "{query}". Try other keywords.'
        lines = [f'Search results for "{query}":']
        for rank, hit in enumerate(hits, start=1):
            lines.append(f"{rank}. {hit.title}\n   URL: {hit.url}\n   {hit.snippet}")
        return "\n".join(lines)


class VisitTool(Tool):
    spec = VISIT_SPEC

    def __init__(self, backend: WebBackend, max_chars: int | None = None):
        self.backend, self.max_chars = backend, max_chars

    def _run(self, url: str) -> str:
        page = self.backend.visit(url)
        if page is None:
            return f"Error: there is no page at {url!r}. Use a URL from search results or a page's links."
        text = page.text
        if self.max_chars is not None and len(text) > self.max_chars:
            text = text[: self.max_chars] + "\n[page truncated]"
        return f"Page: {page.url}\n\n{text}"


class ReasonTool(Tool):
    """The offline world's `reason`: the deterministic calculator (see `calculator.evaluate`)."""

    spec = REASON_SPEC

    def _run(self, problem: str) -> str:
        try:
            return calculator.evaluate(problem)
        except calculator.CalculatorError as error:
            return f"Error: {error}"


class ToolBox:
    """The tools one agent may call, executed by name; unknown names are an error message."""

    def __init__(self, tools: Sequence[Tool], declared: Sequence[ToolSpec] = ()):
        self._tools = {tool.name: tool for tool in tools}
        self.specs: tuple[ToolSpec, ...] = tuple(declared) + tuple(tool.spec for tool in tools)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.specs)

    def execute(self, call: ToolCall) -> str:
        tool = self._tools.get(call.name)
        if tool is None:
            if call.name in self.names:
                raise ValueError(f"{call.name} is declared but executed by the caller (the rollout engine)")
            return f"Error: unknown tool {call.name!r}. Available tools: {', '.join(self.names)}."
        return tool(call.arguments)


def main_agent_toolbox() -> ToolBox:
    """`delegate` (declared; the rollout engine runs it) and `reason`."""
    return ToolBox([ReasonTool()], declared=[DELEGATE_SPEC])


def sub_agent_toolbox(backend: WebBackend, top_k: int = 5, page_chars: int | None = None) -> ToolBox:
    return ToolBox([SearchTool(backend, top_k), VisitTool(backend, page_chars)])


def single_agent_toolbox(backend: WebBackend, top_k: int = 5, page_chars: int | None = None) -> ToolBox:
    return ToolBox([SearchTool(backend, top_k), VisitTool(backend, page_chars), ReasonTool()])
