"""The serving benchmark's load generator: seeded workloads, streamed over HTTP.

A workload is a list of sessions; a session is requests sent one after another (the
rounds of one user's conversation; one request for the single-shot workloads). Closed
loop: `concurrency` sessions run at once, each slot starting the next session when its
last ends. Open loop: sessions start at seeded Poisson arrivals of `rate` per second,
however many are running. Each request is a streamed OpenAI completion (`/v1/completions`,
greedy, `ignore_eos`, usage in the last chunk) whose prompt is text of the demo model's
word tokenizer (`raykv.demo.model.word_text`: word `w<i>` is token i), so routers that
read text (Ray Serve LLM's prefix router) and the engine see the same tokens.

Workloads (scaled to a 2-core machine; the published shapes in brackets):

* `mrqa` multi-round QA [LMCache's multi-round QA benchmark]: users x rounds over one
  shared system prompt, each user with a context of their own; round r sends the system
  prompt, the context, every earlier question and the answer the server gave, and a new
  question.
* `docqa` long-document QA [LMCache's long-doc QA]: documents asked twice, in `tile`
  order (every document, then every document again) and in `random` order.
* `prefix` [vLLM's `prefix_repetition` dataset]: a few long prefixes, each request one of
  them plus a random suffix, shuffled.
* `random` [vLLM's `random` dataset]: random prompts, no reuse.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks._util import percentile
from raykv.demo.model import word_text

VOCAB = 32000  # the demo model's


@dataclass
class Shape:
    """The sizes of one run's workloads (tokens unless named otherwise)."""

    users: int = 6
    rounds: int = 5
    system: int = 512
    context: tuple[int, int] = (1024, 2048)
    question: int = 32
    answer: int = 16
    docs: int = 6
    doc_len: tuple[int, int] = (2048, 4096)
    prefixes: int = 12
    prefix_len: int = 2048
    suffix: int = 128
    prefix_requests: int = 72
    random_requests: int = 32
    random_len: int = 1024

    @classmethod
    def quick(cls) -> Shape:
        return cls(
            users=2,
            rounds=2,
            context=(512, 768),
            docs=2,
            doc_len=(1024, 1536),
            prefixes=2,
            prefix_len=1024,
            prefix_requests=4,
            random_requests=4,
            random_len=512,
        )


@dataclass
class Request:
    """One request's prompt (a function of the session's earlier answers) and labels."""

    build: Callable[[list[list[int]]], list[int]]
    max_tokens: int
    round: int = 0


@dataclass
class Result:
    """What the client saw of one request (times in seconds from the run's start)."""

    workload: str
    session: int
    round: int
    prompt_tokens: int
    sent: float
    ttft: float = float("nan")
    gaps: list[float] = field(default_factory=list)  # inter-token gaps, one per token
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    def row(self) -> dict[str, Any]:
        return asdict(self)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def _fixed(prompt: list[int], _answers: list[list[int]]) -> list[int]:
    return prompt


def _conversation(
    system: list[int], context: list[int], questions: list[list[int]], answers: list[list[int]]
) -> list[int]:
    """Round len(answers): the system prompt, the user's context, every earlier question
    and the answer the server gave, and the next question."""
    out = system + context
    for question, answer in zip(questions, answers, strict=False):
        out += question + answer
    return out + questions[len(answers)]


def fixed(prompt: list[int], max_tokens: int, round_: int = 0) -> Request:
    return Request(functools.partial(_fixed, prompt), max_tokens, round_)


def workload(name: str, shape: Shape, seed: int) -> list[list[Request]]:
    """The sessions of workload `name`, seeded (a repeat passes another seed: no reuse
    between repeats)."""
    rng = random.Random(f"{name}-{seed}")
    if name == "mrqa":
        system = _tokens(rng, shape.system)
        sessions = []
        for _ in range(shape.users):
            context = _tokens(rng, rng.randint(*shape.context))
            questions = [_tokens(rng, shape.question) for _ in range(shape.rounds)]
            build = functools.partial(_conversation, system, context, questions)
            sessions.append([Request(build, shape.answer, r) for r in range(shape.rounds)])
        return sessions
    if name in ("docqa", "docqa-random"):
        docs = [_tokens(rng, rng.randint(*shape.doc_len)) for _ in range(shape.docs)]
        order = list(range(shape.docs)) * 2
        if name == "docqa-random":
            rng.shuffle(order)
        asks = []
        for i, d in enumerate(order):
            prompt = docs[d] + _tokens(rng, shape.question)
            asks.append([fixed(prompt, shape.answer, i // shape.docs)])
        return asks
    if name == "prefix":
        prefixes = [_tokens(rng, shape.prefix_len) for _ in range(shape.prefixes)]
        picks = [i % shape.prefixes for i in range(shape.prefix_requests)]
        rng.shuffle(picks)
        return [[fixed(prefixes[i] + _tokens(rng, shape.suffix), shape.answer)] for i in picks]
    if name == "random":
        return [
            [fixed(_tokens(rng, shape.random_len), shape.answer)]
            for _ in range(shape.random_requests)
        ]
    raise ValueError(f"unknown workload {name!r}; known: {WORKLOADS}")


WORKLOADS = ("mrqa", "docqa", "docqa-random", "prefix", "random")


async def _one(
    http: Any, url: str, model: str, req: Request, prompt: list[int], out: Result, t0: float
) -> list[int]:
    """Send one streamed completion; fills `out`; returns the answer's tokens."""
    body = {
        "model": model,
        "prompt": word_text(prompt),
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer: list[int] = []
    last = None
    generated = None  # the server's count (the usage block), beside the words streamed
    async with http.post(url, json=body) as reply:
        if reply.status != 200:
            out.error = f"HTTP {reply.status}: {(await reply.text())[:200]}"
            return answer
        async for raw in reply.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            now = time.perf_counter() - t0
            if chunk.get("error"):  # vLLM reports a failure mid-stream under HTTP 200
                out.error = f"in the stream: {str(chunk['error'])[:200]}"
                break
            usage = chunk.get("usage")
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens = int(details.get("cached_tokens") or 0)
                generated = usage.get("completion_tokens")
            for choice in chunk.get("choices") or []:
                words = [int(w[1:]) for w in (choice.get("text") or "").split()]
                if not words:
                    continue
                if last is None:
                    out.ttft = now - out.sent
                else:
                    out.gaps += [(now - last) / len(words)] * len(words)
                last = now
                answer += words
    out.output_tokens = len(answer)
    if not out.error and len(answer) != req.max_tokens:  # ignore_eos: every answer is whole
        # The server's count tells a token whose text is empty (a special token the
        # model produced: `ignore_eos` does not stop it) from a token lost on the way.
        out.error = f"{len(answer)} of {req.max_tokens} tokens streamed (usage: {generated})"
    return answer


async def _session(
    http: Any,
    url: str,
    model: str,
    name: str,
    index: int,
    session: list[Request],
    results: list[Result],
    t0: float,
) -> None:
    answers: list[list[int]] = []
    for req in session:
        prompt = req.build(answers)
        out = Result(name, index, req.round, len(prompt), time.perf_counter() - t0)
        results.append(out)
        try:
            answers.append(await _one(http, url, model, req, prompt, out, t0))
        except Exception as exc:  # counted, never fatal: the run goes on
            out.error = f"{type(exc).__name__}: {exc}"[:200]
        if out.error:
            return  # the user gives up (a later round would not be the same prompt)


async def drive(
    port: int,
    model: str,
    name: str,
    sessions: list[list[Request]],
    *,
    concurrency: int = 4,
    rate: float | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> tuple[list[Result], float]:
    """Run `sessions` against `http://127.0.0.1:port`: (results, wall seconds)."""
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    results: list[Result] = []
    t0 = time.perf_counter()
    limits = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=limits, timeout=timeout) as http:

        def run(i: int) -> Any:
            return _session(http, url, model, name, i, sessions[i], results, t0)

        if rate is None:  # closed loop
            queue = list(range(len(sessions)))[::-1]

            async def slot() -> None:
                while queue:
                    await run(queue.pop())

            await asyncio.gather(*(slot() for _ in range(concurrency)))
        else:  # open loop: seeded Poisson arrivals
            rng = random.Random(f"arrivals-{seed}")
            tasks = []
            for i in range(len(sessions)):
                tasks.append(asyncio.ensure_future(run(i)))
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def summarize(results: list[Result], wall: float, hit_tokens: int) -> dict[str, Any]:
    """The figures users compare, from one workload run. `hit_tokens`: a request whose
    cached prompt tokens reach it counts as a hit."""
    ok = [r for r in results if not r.error]
    hits = [r.ttft for r in ok if r.cached_tokens >= hit_tokens]
    misses = [r.ttft for r in ok if r.cached_tokens < hit_tokens]
    ttft = [r.ttft for r in ok]
    gaps = [g for r in ok for g in r.gaps]
    rounds: dict[int, list[float]] = {}
    for r in ok:
        rounds.setdefault(r.round, []).append(r.ttft)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "wall_s": wall,
        "rps": len(ok) / wall if wall else 0.0,
        "prompt_tps": sum(r.prompt_tokens for r in ok) / wall if wall else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p90": percentile(ttft, 0.9),
        "ttft_p99": percentile(ttft, 0.99),
        "ttft_hit_p50": percentile(hits, 0.5),
        "ttft_miss_p50": percentile(misses, 0.5),
        "hit_requests": len(hits),
        "ttft_by_round_p50": {k: percentile(v, 0.5) for k, v in sorted(rounds.items())},
        "itl_p50": percentile(gaps, 0.5),
        "itl_p99": percentile(gaps, 0.99),
        "ttfts": sorted(ttft),
    }
