"""``search``: BM25 over a local document corpus; returns the top-k documents with their ids.

The corpus is fixed by the service config and never named by the policy: ``corpus`` (a folder
of ``.jsonl``/``.txt`` files or one file, see ``tools_env.corpus``) or, when it is null, the
synthetic world of ``corpus_seed`` (default 0) built in memory. Documents are loaded and
indexed once per process. Arguments: ``{"query": str, "k": int (optional, capped at k_max)}``, or, when
the service has experts, ``{"model": alias}`` instead of the query: that expert writes the query from the
task and the tool results so far (ToolOrchestra's ``search``, whose model argument names the model that
writes the query; ``Expert.write_query``), billed and timed on top of the search. Each query costs
``cost_per_query`` dollars ($0.01, the paper's web-search price).

BM25 (Robertson/Sparck Jones, Lucene's idf):
    score(q, d) = sum_t idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections import Counter
from typing import Any

from tools_env.corpus import Document, build_world, load_corpus
from tools_env.tools.base import EpisodeContext, Tool, ToolArgumentError, ToolResult, register_tool
from tools_env.tools.experts import writer_from

_TOKEN = re.compile(r"[a-z0-9]+")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


class BM25Index:
    def __init__(self, docs: list[Document], k1: float = 1.5, b: float = 0.75) -> None:
        self.docs, self.k1, self.b = docs, k1, b
        self.postings: dict[str, list[tuple[int, int]]] = {}
        self.lengths = []
        for i, d in enumerate(docs):
            tf = Counter(tokenize(f"{d.title} {d.text}"))
            self.lengths.append(sum(tf.values()))
            for term, n in tf.items():
                self.postings.setdefault(term, []).append((i, n))
        self.avgdl = sum(self.lengths) / max(len(docs), 1)
        n_docs = len(docs)
        self.idf = {t: math.log(1 + (n_docs - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()}

    def search(self, query: str, k: int) -> list[tuple[Document, float]]:
        scores: dict[int, float] = {}
        for term in set(tokenize(query)):
            idf = self.idf.get(term)
            if idf is None:
                continue
            for i, tf in self.postings[term]:
                norm = self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avgdl)
                scores[i] = scores.get(i, 0.0) + idf * tf * (self.k1 + 1) / (tf + norm)
        best = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:k]  # ties: corpus order
        return [(self.docs[i], s) for i, s in best]


_INDEXES: dict[tuple, BM25Index] = {}
_INDEX_LOCK = threading.Lock()


def get_index(corpus: str | None = None, corpus_seed: int = 0) -> BM25Index:
    """The process-wide index of a corpus path, or of the synthetic world of ``corpus_seed``."""
    key = ("path", os.path.abspath(corpus)) if corpus else ("seed", int(corpus_seed))
    with _INDEX_LOCK:
        if key not in _INDEXES:
            docs = load_corpus(corpus) if corpus else build_world(int(corpus_seed)).docs
            _INDEXES[key] = BM25Index(docs)
        return _INDEXES[key]


@register_tool
class SearchTool(Tool):
    name = "search"
    description = "Search the local document collection (BM25). Returns the best-matching documents with their ids."
    parameters = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "keywords, e.g. a person's or company's name"},
            "k": {"type": "integer", "description": "number of documents to return (default 3)"},
        },
        "required": ["query"],
    }

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.writer = writer_from(self.config)
        if self.writer is not None:
            self.parameters = {
                "type": "object",
                "properties": {
                    **type(self).parameters["properties"],
                    "model": {
                        "type": "string",
                        "enum": self.writer.experts.aliases,
                        "description": "or: the expert (from the expert table) that writes the query",
                    },
                },
                "required": [],
            }
        self.k_default = int(self.config.get("k_default", 3))
        self.k_max = int(self.config.get("k_max", 10))
        self.cost_per_query = float(self.config.get("cost_per_query", 0.01))
        self.snippet_chars = int(self.config.get("snippet_chars", 400))
        self.index = get_index(self.config.get("corpus"), int(self.config.get("corpus_seed", 0)))

    def schema(self, ctx: EpisodeContext | None = None) -> dict[str, Any]:
        s = super().schema(ctx)
        s["function"]["description"] = (
            f"{self.description} Price: ${self.cost_per_query:g} per query; k is at most {self.k_max}."
        )
        return s

    def check_arguments(self, arguments: Any) -> dict[str, Any]:
        args = super().check_arguments(arguments)
        if self.writer is not None and ("query" in args) == ("model" in args):
            raise ToolArgumentError("search: give either 'query' (keywords) or 'model' (an expert that writes them)")
        if "query" in args and not args["query"].strip():
            raise ToolArgumentError("search: 'query' is empty")
        if args.get("k", self.k_default) < 1:
            raise ToolArgumentError("search: 'k' must be >= 1")
        return args

    async def call(self, arguments: dict[str, Any], ctx: EpisodeContext) -> ToolResult:
        t0 = time.perf_counter()
        try:
            arguments = self.check_arguments(arguments)
        except ToolArgumentError as e:
            return ToolResult(observation=f"error: {e}", error=str(e))
        written = None
        if "model" in arguments:
            assert self.writer is not None  # no model argument without experts, so check_arguments refused it
            query, written = await self.writer.write_query(arguments["model"], ctx)
            if query is None:  # the expert failed: its error is the observation, nothing was searched
                return written
        else:
            query = arguments["query"].strip()
        ctx.state.setdefault("searches", []).append(query)
        hits = self.index.search(query, min(arguments.get("k", self.k_default), self.k_max))
        lines = [f"[{d.id}] {d.title}: {d.text[: self.snippet_chars]}" for d, _ in hits]
        observation = "\n".join(lines) if lines else "no documents match the query"
        # the documents, not the query: an endpoint writes that from the context the policy wrote
        meta: dict[str, Any] = {"doc_ids": [d.id for d, _ in hits], "stated": observation if lines else ""}
        if written is None:
            return ToolResult(
                observation=observation, cost=self.cost_per_query, latency_s=time.perf_counter() - t0, meta=meta
            )
        meta.update(model=arguments["model"], query=query)
        return ToolResult(
            observation=f"{arguments['model']} searched for: {query}\n{observation}",
            cost=self.cost_per_query + written.cost,
            latency_s=written.latency_s + time.perf_counter() - t0,
            usage=written.usage,
            meta=meta,
        )
