"""`nanoserve bench sampler`: the batched sampling chain against a per-request loop doing the same
work (one `Sampler` call per row), in one run, for several batch sizes over a real-size vocabulary with
mixed parameters; then the share of an engine step spent sampling with 64 running requests."""
from __future__ import annotations

import argparse
import os
import time

import torch

from nanoserve.sample.metadata import SamplingMetadata
from nanoserve.sample.penalties import PenaltyState
from nanoserve.sample.sampler import Sampler
from nanoserve.sampling_params import SamplingParams


def mixed_params(batch: int, vocab: int) -> list[SamplingParams]:
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=40, seed=1),
        dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.1),
        dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 2.0, 9: -3.0}),
        dict(temperature=0.6, min_tokens=4, stop_token_ids=[7], allowed_token_ids=list(range(0, vocab, 3))),
    ]
    return [SamplingParams(**kinds[i % len(kinds)]) for i in range(batch)]


def _timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def bench_chain(batch: int, vocab: int, repeats: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, vocab, generator=g) * 3
    params = mixed_params(batch, vocab)
    state = PenaltyState(vocab)
    penalty_rows = {i: state.row(str(i), torch.randint(0, vocab, (64,), generator=g).tolist(), [])
                    for i, p in enumerate(params) if p.has_penalties}
    gens = {i: torch.Generator().manual_seed(i) for i, p in enumerate(params) if p.seed is not None}
    outputs = [2] * batch
    sampler = Sampler(torch.Generator().manual_seed(0))

    def batched():
        md = SamplingMetadata.build(params, gens, vocab, outputs, (0,), penalty_rows)
        sampler.sample(logits, md, state)

    def per_request():
        for i, p in enumerate(params):
            rows = {0: penalty_rows[i]} if i in penalty_rows else {}
            md = SamplingMetadata.build([p], {0: gens[i]} if i in gens else {}, vocab, [2], (0,), rows)
            sampler.sample(logits[i:i + 1], md, state)

    return _timed(batched, repeats), _timed(per_request, max(1, repeats // 4))


def engine_sampling_share(num_requests: int, steps: int) -> float:
    from nanoserve.config import EngineConfig
    from nanoserve.engine.core import EngineCore
    from nanoserve.model.loader import default_model_path
    from nanoserve.protocol import EngineCoreRequest

    engine = EngineCore(EngineConfig(model=default_model_path()))
    vocab = engine.model_config.vocab_size
    for i, p in enumerate(mixed_params(num_requests, vocab)):
        p.max_tokens, p.ignore_eos = steps + 8, True
        engine.add_request(EngineCoreRequest(str(i), list(range(100 + i, 164 + i)), p))
    sampler = engine.runner.sampler
    spent = [0.0]
    original = sampler.sample

    def timed_sample(*args, **kw):
        start = time.perf_counter()
        result = original(*args, **kw)
        spent[0] += time.perf_counter() - start
        return result

    sampler.sample = timed_sample
    while len(engine.scheduler.running) < num_requests or any(
            r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()  # prefill everything first
    spent[0] = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return spent[0] / (time.perf_counter() - start)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="nanoserve bench sampler", description=__doc__)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--engine-requests", type=int, default=64)
    ap.add_argument("--engine-steps", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    print("| rows | batched chain (ms/step) | per-request loop (ms/step) | speed-up |\n|---|---|---|---|")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        batched, looped = bench_chain(b, args.vocab, args.repeats)
        print(f"| {b} | {batched * 1e3:.2f} | {looped * 1e3:.2f} | {looped / batched:.1f}x |", flush=True)
    if args.engine_requests:
        share = engine_sampling_share(args.engine_requests, args.engine_steps)
        print(f"\nsampling share of an engine step with {args.engine_requests} running requests "
              f"(mixed parameters, SmolLM2, float32): {share * 100:.1f}%")
