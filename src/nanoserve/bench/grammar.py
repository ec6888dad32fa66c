"""`nanoserve bench grammar`: the structured-outputs cost. Grammar engines side by side on the real
vocabulary (xgrammar, and llguidance if installed): compile time per schema, and per step at 32 rows the
mask fill, the matcher advance and the mask apply; then engine decode steps at 32 rows, plain against
all rows under a JSON schema."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nanoserve.bench.serve import bench_schema
from nanoserve.sample.metadata import GrammarMasks

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 150}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested arrays": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {
            "type": "string"}, "maxItems": 3}}, "required": ["id"]}, "minItems": 1, "maxItems": 5}},
        "required": ["items"]},
    "recursive $ref": {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "number"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"},
    "enum/format/pattern/anyOf": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "when": {"type": "string", "format": "date-time"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "x": {"anyOf": [{"type": "integer"}, {"type": "null"}, {"type": "string", "maxLength": 8}]}},
        "required": ["color", "when", "code", "x"]},
    "bench serve's": bench_schema(None),
}


WALK_PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "city": {"type": "string"}},
               "required": ["name", "age", "city"], "additionalProperties": False}
# Texts as a model writes them (SmolLM2's greedy output under bench serve's schema, and a person), with
# free and with compact whitespace: every row follows the text, so each step's fill is one grammar state.
TEXT_WALKS = [
    ("strings, free whitespace", bench_schema(None), '[\n\n"The original"\n\n,\n\n'
     + ',\n\n'.join(['"The original"\n\n'] * 7), True),
    ("strings, compact", bench_schema(None), '["The original",' + ','.join(['"The original"'] * 7), False),
    ("person, free whitespace", WALK_PERSON, '{\n  "name": "Monica Bellucci",\n  "age": 30,\n  "city": "Rome"\n}',
     True),
    ("person, compact", WALK_PERSON, '{"name":"Monica Bellucci","age":30,"city":"Rome"}', False),
]


def text_walks(tokenizer, vocab: int, rows: int) -> list[tuple]:
    """Mean and worst mask fill at `rows` rows along each of TEXT_WALKS, xgrammar and (if installed) llguidance."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        import llguidance
        import llguidance.hf
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par
        lltok, executor = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), llguidance.LLExecutor()
    except ImportError:
        llguidance = None
    out = []
    for name, schema, text, free in TEXT_WALKS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        compact = {} if free else {"any_whitespace": False, "separators": (",", ":")}
        matchers = [xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), **compact))
                    for _ in range(rows)]
        masks, fills = GrammarMasks(vocab), []
        for token in ids:
            start = time.perf_counter()
            masks(matchers)
            fills.append(time.perf_counter() - start)
            for m in matchers:
                m.accept_token(token)
        row = [name, len(ids), statistics.mean(fills) * 1e3, max(fills) * 1e3]
        if llguidance is not None:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                   defaults={"whitespace_flexible": free})
            matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
            mask, fills = allocate_token_bitmask(rows, vocab), []
            for token in ids:
                start = time.perf_counter()
                fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
                fills.append(time.perf_counter() - start)
                for m in matchers:
                    m.consume_token(token)
            row += [statistics.mean(fills) * 1e3, max(fills) * 1e3]
        out.append(tuple(row))
    return out


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def run_llguidance(tokenizer, vocab: int, rows: int, steps: int) -> dict:
    """llguidance (not a dependency; measured when installed): its parallel fill, advance and own apply."""
    import llguidance
    import llguidance.hf
    from llguidance.torch import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask_par

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup = time.perf_counter() - start
    compile_ms, grammars = {}, []
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        llguidance.LLMatcher(lltok, grammar).compute_logit_bias()  # the first mask is where work is done
        compile_ms[name] = (time.perf_counter() - start) * 1e3
        grammars.append(grammar)
    matchers = [llguidance.LLMatcher(lltok, grammars[i % len(grammars)]) for i in range(rows)]
    executor, mask, logits = llguidance.LLExecutor(), allocate_token_bitmask(rows, vocab), torch.randn(rows, vocab)
    fill, advance, apply = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)
        fill.append(time.perf_counter() - start)
        step_logits = logits.clone()
        start = time.perf_counter()
        apply_token_bitmask_inplace(step_logits, mask)
        apply.append(time.perf_counter() - start)
        tokens = step_logits.argmax(-1).tolist()
        start = time.perf_counter()
        for m, t in zip(matchers, tokens):
            m.consume_token(t)
            if m.is_stopped() or m.is_error():
                m.reset()
        advance.append(time.perf_counter() - start)
    return {"setup_s": setup, "compile_ms": compile_ms, "fill_ms": ms(fill), "advance_ms": ms(advance),
            "apply_ms": ms(apply)}


def run_xgrammar(tokenizer, vocab: int, rows: int, steps: int) -> dict:
    """xgrammar, nanoserve's engine: its one-by-one fill and own apply, and nanoserve's path (the batched
    fill of `GrammarMasks`, the packed masks applied inside the sampler's C chain)."""
    import xgrammar as xgr

    from nanoserve.kernels.backend import select_backend
    from nanoserve.sample.metadata import SamplingMetadata
    from nanoserve.sample.sampler import Sampler
    from nanoserve.sampling_params import SamplingParams

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start
    compile_ms, compiled = {}, []
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiled.append(compiler.compile_json_schema(json.dumps(schema)))
        compile_ms[name] = (time.perf_counter() - start) * 1e3
    matchers = [xgr.GrammarMatcher(compiled[i % len(compiled)]) for i in range(rows)]
    mask, logits = xgr.allocate_token_bitmask(rows, vocab), torch.randn(rows, vocab)
    ours = GrammarMasks(vocab)
    sampler = Sampler(select_backend("auto", torch.get_num_threads()))
    greedy = [SamplingParams(temperature=0)] * rows
    plain_md = SamplingMetadata.build(greedy, vocab)
    plain_md.all_greedy = False  # the C chain over every row, without a mask: the apply's baseline
    plain_md.temperature = torch.ones(rows)
    fill, batch_fill, advance, apply, chain_plain, chain_masked = [], [], [], [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        fill.append(time.perf_counter() - start)
        start = time.perf_counter()
        packed = ours(matchers)
        batch_fill.append(time.perf_counter() - start)
        md = SamplingMetadata.build(greedy, vocab, allowed_masks=dict(enumerate(packed)))
        start = time.perf_counter()
        tokens = sampler(logits, md).tolist()
        chain_masked.append(time.perf_counter() - start)
        start = time.perf_counter()
        sampler(logits, plain_md)
        chain_plain.append(time.perf_counter() - start)
        step_logits = logits.clone()
        start = time.perf_counter()
        xgr.apply_token_bitmask_inplace(step_logits, mask)
        apply.append(time.perf_counter() - start)
        start = time.perf_counter()
        for m, t in zip(matchers, tokens):
            if not m.accept_token(t) or m.is_terminated():
                m.reset()
        advance.append(time.perf_counter() - start)
    return {"setup_s": setup, "compile_ms": compile_ms, "fill_ms": ms(fill), "advance_ms": ms(advance),
            "apply_ms": ms(apply), "batch_fill_ms": ms(batch_fill),
            "our_apply_ms": ms(chain_masked) - ms(chain_plain), "chain_ms": ms(chain_plain)}


def engine_steps(rows: int, steps: int, rounds: int = 3) -> dict:
    """Median decode-step time of the engine at `rows` rows: plain, and every row under bench serve's schema
    (the grammar's whole cost: mask fill, the sampler's apply and the matcher advance), alternated `rounds`
    times so that both see the same machine."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.structured import StructuredOutputs

    llm = LLM(max_model_len=512)
    times: dict[str, list[float]] = {"plain": [], "json_schema": []}
    for r in range(rounds):
        for label, spec in (("plain", None), ("json_schema", StructuredOutputs(json=bench_schema(None)))):
            params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True, structured_outputs=spec)
            for i in range(rows):
                llm.engine.add_request(_request(f"{label}-{r}-{i}", params))
            step_times = []
            while llm.engine.has_unfinished():
                start = time.perf_counter()
                llm.engine.step()
                step_times.append(time.perf_counter() - start)
            times[label] += step_times[4:-4]  # without the prefill steps and the ragged end
    out = {label: statistics.median(t) * 1e3 for label, t in times.items()}
    out["share"] = out["json_schema"] / out["plain"] - 1
    return out


def _request(request_id: str, params):
    from nanoserve.protocol import EngineCoreRequest

    return EngineCoreRequest(request_id, [1, 504, 3458, 314, 253, 1345, 28, 9, 506, 2217], params)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="nanoserve bench grammar", description=__doc__)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args(argv)
    from nanoserve.frontend.tokenizer import load_tokenizer
    from nanoserve.model.default import default_model_path

    tokenizer, path = load_tokenizer(default_model_path()), ""
    vocab = len(tokenizer)
    print(f"| engine | tokenizer setup (s) | {' | '.join(f'compile {n} (ms)' for n in SCHEMAS)} | mask fill, "
          f"{args.rows} rows (ms) | advance (ms) | its own apply (ms) |\n|---|---|{'---|' * len(SCHEMAS)}---|---|---|")
    for name, fn in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
        try:
            r = fn(tokenizer, vocab, args.rows, args.steps)
        except ImportError:
            print(f"| {name} | not installed |")
            continue
        print(f"| {name} | {r['setup_s']:.2f} | {' | '.join(f'{v:.1f}' for v in r['compile_ms'].values())} | "
              f"{r['fill_ms']:.2f} | {r['advance_ms']:.2f} | {r['apply_ms']:.2f} |", flush=True)
        if "batch_fill_ms" in r:
            path = (f"nanoserve's path per step at {args.rows} rows: batched fill {r['batch_fill_ms']:.2f} ms + "
                    f"apply in the C sampler {r['our_apply_ms']:+.2f} ms (its chain without a mask: "
                    f"{r['chain_ms']:.2f} ms) + advance {r['advance_ms']:.2f} ms")
    print(f"\n{path}\n\n| text walk, {args.rows} rows | tokens | xgrammar fill mean / max (ms) | "
          f"llguidance fill mean / max (ms) |\n|---|---|---|---|")
    for row in text_walks(tokenizer, vocab, args.rows):
        llg = f"{row[4]:.2f} / {row[5]:.1f}" if len(row) > 4 else "not installed"
        print(f"| {row[0]} | {row[1]} | {row[2]:.2f} / {row[3]:.1f} | {llg} |", flush=True)
    e = engine_steps(args.rows, args.steps)
    print(f"engine decode step at {args.rows} rows: plain {e['plain']:.1f} ms, all rows under a JSON schema "
          f"{e['json_schema']:.1f} ms ({e['share'] * 100:+.1f}%)")
