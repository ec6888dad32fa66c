"""`nanoserve bench serve --url URL`: an async load generator for any OpenAI-compatible server.
Streams `/v1/completions` (or chat, plain or calling a tool: `--chat-tools`) with random prompts of a
given length and a fixed output length (EOS ignored and banned), `--concurrency` requests in flight, and reports requests/s, output tokens/s, time to first
token and inter-token latency (p50/p99); for nanoserve also the engine core's idle share. The client is
aiohttp, light on CPU: on a small machine the load generator shares the cores with the server."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import aiohttp

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government "
         "number night point home water room mother area money story fact month lot right study book "
         "eye job word business issue side kind head house service friend father power hour game line "
         "end member law car city community name president team minute idea kid body information back "
         "parent face others level office door health person art war history party result change "
         "morning reason research girl guy moment air teacher force education").split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def make_prompt(rng: random.Random, input_len: int, workload: str = "random") -> str:
    """`random`: `input_len` random common words (one token each with their leading space in BPE
    vocabularies). `copy`: a list of input_len / 2 random words, the same list again, then a cue to write it
    once more, a workload whose output repeats its prompt (as editing or quoting a given text does)."""
    if workload == "random":
        return " ".join(rng.choice(WORDS) for _ in range(input_len))
    words = " ".join(rng.choice(WORDS) for _ in range(max(1, input_len // 2)))
    return f"List:{words}.\nThe same list again:{words}.\nAnd once more:"


def make_prompts(rng: random.Random, num_prompts: int, input_len: int, workload: str = "random",
                 num_prefixes: int = 4, prefix_len: int = 400) -> list[str]:
    """`make_prompt`'s workloads, and `shared-prefix`: `num_prefixes` system prompts of `prefix_len`
    random words, each request one of them (at random) followed by its own `input_len` words, as many
    users of a few applications are."""
    if workload != "shared-prefix":
        return [make_prompt(rng, input_len, workload) for _ in range(num_prompts)]
    systems = [make_prompt(rng, prefix_len) for _ in range(num_prefixes)]
    return [f"{rng.choice(systems)}\nUser: {make_prompt(rng, input_len)}" for _ in range(num_prompts)]


def bench_schema(index: Optional[int]) -> dict:
    """The JSON schema of the structured requests: a list of short strings longer than any output (so that
    max_tokens ends it, as it ends the others). `index`: a variant of its own (no compiled-grammar reuse)."""
    return {"type": "array", "items": {"type": "string", "maxLength": 12 + (index or 0)}, "minItems": 1000}


def bench_tool() -> dict:
    """The tool of `--chat-tools required` requests: its arguments hold `bench_schema`'s list, so that every
    call runs to max_tokens like the plain requests."""
    return {"type": "function", "function": {"name": "record", "description": "Record a list of phrases",
                                             "parameters": {"type": "object", "properties": {"items": bench_schema(None)},
                                                            "required": ["items"], "additionalProperties": False}}}


def chunk_text(payload: dict) -> str:
    """The generated text of one SSE chunk: completion text, chat content or tool-call arguments."""
    text = ""
    for c in payload.get("choices") or ():
        delta = c.get("delta") or {}
        text += c.get("text") or delta.get("content") or ""
        text += "".join((t.get("function") or {}).get("arguments") or "" for t in delta.get("tool_calls") or ())
    return text


async def one_request(http: aiohttp.ClientSession, url: str, model: Optional[str], prompt: str, output_len: int,
                      ban: dict, schema: Optional[dict] = None, chat_tools: Optional[str] = None) -> Result:
    """`chat_tools`: None for /v1/completions; "none" for a plain chat request, "required" for one that
    must call `bench_tool`."""
    body = {"max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True, "min_tokens": output_len, "logit_bias": ban,
            "stream_options": {"include_usage": True}}
    if chat_tools is None:
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
        if chat_tools == "required":
            body["tools"], body["tool_choice"] = [bench_tool()], "required"
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    result, last, chunks = Result(ok=True), None, 0
    try:
        async with http.post(f"{url}/v1/{'completions' if chat_tools is None else 'chat/completions'}",
                             json=body) as r:
            if r.status != 200:
                return Result(ok=False, error=f"HTTP {r.status}: {(await r.read())[:200]!r}")
            async for raw in r.content:  # one SSE line at a time
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if payload.get("usage"):
                    result.output_tokens = payload["usage"].get("completion_tokens", 0)
                if not chunk_text(payload):
                    continue
                now = time.perf_counter()
                chunks += 1
                if last is None:
                    result.ttft = now - start
                else:
                    result.gaps.append(now - last)
                last = now
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Result(ok=False, error=repr(exc))
    result.output_tokens = result.output_tokens or chunks
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def server_metric(http: aiohttp.ClientSession, url: str, name: str) -> Optional[float]:
    """One unlabelled nanoserve metric from /metrics; None for a server without it."""
    try:
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def engine_idle_seconds(http: aiohttp.ClientSession, url: str) -> Optional[float]:
    return await server_metric(http, url, "nanoserve:engine_idle_seconds")


async def spec_counts(http: aiohttp.ClientSession, url: str) -> tuple[Optional[float], Optional[float]]:
    """Speculative draft tokens verified and accepted since the server started (None without them)."""
    return (await server_metric(http, url, "nanoserve:spec_decode_num_draft_tokens"),
            await server_metric(http, url, "nanoserve:spec_decode_num_accepted_tokens"))


async def prefix_counts(http: aiohttp.ClientSession, url: str) -> tuple[Optional[float], Optional[float]]:
    """Prompt tokens looked up in nanoserve's prefix cache and found there, since it started."""
    return (await server_metric(http, url, "nanoserve:prefix_cache_queries"),
            await server_metric(http, url, "nanoserve:prefix_cache_hits"))


async def run(url: str, model: Optional[str], concurrency: int, num_prompts: int, input_len: int, output_len: int,
              ban: dict, seed: int = 0, schema_share: float = 0.0, distinct_schemas: bool = False,
              chat_tools: Optional[str] = None, workload: str = "random", num_prefixes: int = 4,
              prefix_len: int = 400, request_rate: float = 0.0) -> dict:
    """`schema_share`: the fraction of requests (spread evenly) sent with a JSON schema (`bench_schema`);
    `workload`: how prompts are made (`make_prompts`); `request_rate` > 0: requests arrive as a Poisson
    process of that many a second (still at most `concurrency` in flight), else all at once."""
    rng = random.Random(seed)
    prompts = make_prompts(rng, num_prompts, input_len, workload, num_prefixes, prefix_len)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(request_rate) if request_rate > 0 else 0.0
    structured = [int((i + 1) * schema_share) > int(i * schema_share) for i in range(num_prompts)]
    schemas = [bench_schema(i + seed * num_prompts if distinct_schemas else None) if s else None
               for i, s in enumerate(structured)]
    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=concurrency + 8, force_close=True)) as http:
        async def limited(p, schema, arrival):
            await asyncio.sleep(start + arrival - time.perf_counter())
            async with semaphore:
                return await one_request(http, url, model, p, output_len, ban, schema, chat_tools)

        idle_before = await engine_idle_seconds(http, url)
        if idle_before is not None:
            # An idle engine adds its waiting time when a wait ends (every 0.5 s): start right after
            # one ends, so that the wait in progress at the start is not counted as this run's.
            deadline = time.perf_counter() + 1.0
            while time.perf_counter() < deadline:
                await asyncio.sleep(0.02)
                latest = await engine_idle_seconds(http, url)
                if latest != idle_before:
                    idle_before = latest
                    break
        drafts_before, accepted_before = await spec_counts(http, url)
        prefix_before = await prefix_counts(http, url)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p, s, a) for p, s, a in zip(prompts, schemas, arrivals)))
        wall = time.perf_counter() - start
        idle_after = await engine_idle_seconds(http, url)
        await asyncio.sleep(0.5)  # engine gauges follow the engine's stats a little after the last answer
        drafts_after, accepted_after = await spec_counts(http, url)
        prefix_after = await prefix_counts(http, url)
    good = [r for r in results if r.ok]
    structured_ttfts = [r.ttft for r, s in zip(results, schemas) if r.ok and s is not None]
    gaps = [g for r in good for g in r.gaps]
    ttfts = [r.ttft for r in good]
    report = {"concurrency": concurrency, "request_rate": request_rate, "requests": len(results), "failed": len(results) - len(good),
              "wall_s": wall, "req_per_s": len(good) / wall, "output_tok_per_s": sum(r.output_tokens for r in good) / wall,
              "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
              "itl_p50": percentile(gaps, 50), "itl_p99": percentile(gaps, 99),
              "errors": sorted({r.error for r in results if not r.ok})[:3]}
    if structured_ttfts:
        report["structured_ttft_p50"] = percentile(structured_ttfts, 50)
        report["structured_ttft_p99"] = percentile(structured_ttfts, 99)
    if idle_before is not None and idle_after is not None:
        report["engine_idle_share"] = (idle_after - idle_before) / wall
    if drafts_after and accepted_after is not None and drafts_after > (drafts_before or 0):
        report["spec_drafts"] = drafts_after - (drafts_before or 0)
        report["spec_acceptance"] = (accepted_after - (accepted_before or 0)) / report["spec_drafts"]
    if None not in prefix_before + prefix_after and prefix_after[0] > prefix_before[0]:
        report["prefix_hit_rate"] = (prefix_after[1] - prefix_before[1]) / (prefix_after[0] - prefix_before[0])
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="nanoserve bench serve", description=__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name to send (default: none)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    ap.add_argument("--num-prompts", type=int, default=0, help="per level (default: 2 x concurrency)")
    ap.add_argument("--input-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ban-token-ids", default="0,2", help="EOS ids banned by logit_bias, for servers "
                    "without ignore_eos (SmolLM2: 0 and 2)")
    ap.add_argument("--label", default="server")
    ap.add_argument("--json-schema-share", type=float, default=0.0,
                    help="fraction of requests sent with response_format json_schema (0 to 1)")
    ap.add_argument("--distinct-schemas", action="store_true",
                    help="each structured request a schema of its own (its grammar compiled first-seen)")
    ap.add_argument("--chat-tools", choices=("none", "required"), default=None,
                    help="chat requests instead of completions: plain (none), or each calling a tool (required; "
                         "needs a template that renders tools, e.g. --chat-template chatml-tools)")
    ap.add_argument("--workload", choices=("random", "copy", "shared-prefix"), default="random",
                    help="prompts of random words; a word list given twice that the output repeats (where "
                         "--speculative-ngram applies); or one of a few shared system prompts before each "
                         "request's own words (where the prefix cache and data-parallel routing apply)")
    ap.add_argument("--request-rate", type=float, default=0.0,
                    help="requests a second, arriving as a Poisson process (default 0: all at once, so that "
                         "--concurrency are always in flight)")
    ap.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: how many system prompts")
    ap.add_argument("--prefix-len", type=int, default=400, help="shared-prefix: words per system prompt")
    ap.add_argument("--seed", type=int, default=0, help="prompts of the warm-up; level i takes seed + 1 + i, so "
                    "that no level repeats another's prompts (which a prefix cache would serve from memory)")
    ap.add_argument("--warmup", type=int, default=2, help="requests sent (at once) before the first level and "
                    "not reported: a server's first requests pay one-time costs (measured on nanoserve: ITL "
                    "p50 8.0 ms over its first 2 requests, 6.0 ms after)")
    ap.add_argument("--json", action="store_true", help="print one JSON line per level")
    args = ap.parse_args(argv)
    ban = {t: -100 for t in args.ban_token_ids.split(",") if t}
    if not args.json:
        print("| server | concurrency | req/s | output tok/s | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | "
              "ITL p99 (ms) | engine idle |\n|---|---|---|---|---|---|---|---|---|")
    workload = dict(schema_share=args.json_schema_share, distinct_schemas=args.distinct_schemas,
                    chat_tools=args.chat_tools, workload=args.workload, num_prefixes=args.num_prefixes,
                    prefix_len=args.prefix_len)
    if args.warmup > 0:
        asyncio.run(run(args.url.rstrip("/"), args.model, args.warmup, args.warmup, args.input_len, args.output_len,
                        ban, seed=args.seed, **workload))
    for i, level in enumerate(int(c) for c in args.concurrency.split(",")):
        report = asyncio.run(run(args.url.rstrip("/"), args.model, level, args.num_prompts or 2 * level,
                                 args.input_len, args.output_len, ban, seed=args.seed + 1 + i,
                                 request_rate=args.request_rate, **workload))
        report["label"] = args.label
        if args.json:
            print(json.dumps(report), flush=True)
            continue
        idle = f"{report['engine_idle_share'] * 100:.1f}%" if "engine_idle_share" in report else "n/a"
        failed = f" ({report['failed']} failed: {report['errors']})" if report["failed"] else ""
        if "prefix_hit_rate" in report:
            failed += f" (prefix cache: {report['prefix_hit_rate'] * 100:.0f}% of prompt tokens hit)"
        if "spec_acceptance" in report:
            failed += f" (speculation: {report['spec_acceptance'] * 100:.0f}% of {report['spec_drafts']:.0f} drafts accepted)"
        print(f"| {args.label} | {level} | {report['req_per_s']:.2f} | {report['output_tok_per_s']:.1f} | "
              f"{report['ttft_p50']:.2f} | {report['ttft_p99']:.2f} | {report['itl_p50'] * 1e3:.0f} | "
              f"{report['itl_p99'] * 1e3:.0f} | {idle} |{failed}", flush=True)
