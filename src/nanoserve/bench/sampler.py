"""`nanoserve bench sampler`: the batched sampling chain against per-request loops doing the same work
(one call per row, with the same C kernel and with the PyTorch chain), in one run, for several batch
sizes over SmolLM2's real next-token logits (64 text prompts) with mixed parameters; then the share of
an engine step spent sampling with 64 running requests."""
from __future__ import annotations

import argparse
import time

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.core import EngineCore
from nanoserve.frontend.tokenizer import load_tokenizer
from nanoserve.kernels import TorchBackend
from nanoserve.model.loader import default_model_path
from nanoserve.protocol import EngineCoreRequest
from nanoserve.sample.metadata import SamplingMetadata, allowed_token_mask
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


TOPICS = ["the ocean", "a small robot", "the history of Rome", "baking bread", "a rainy day in Paris",
          "quantum computers", "my grandmother's garden", "the first moon landing"]
FORMS = ["Write a short story about {}.", "Explain {} to a child.", "Three facts about {}:",
         "A poem about {}\n"]
PROMPTS = [form.format(topic) for form in FORMS for topic in TOPICS]


def model_logits(engine, tokenizer, num: int) -> torch.Tensor:
    """The model's next-token logits after `num` real text prompts (a real distribution is peaked;
    random logits are not, and would send every top-p row to the full-sort fallback)."""
    captured = []
    sampler = engine.runner.sampler
    original = sampler.sample
    sampler.sample = lambda logits, *a, **k: (captured.append(logits.clone()), original(logits, *a, **k))[1]
    for i in range(num):
        text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        engine.add_request(EngineCoreRequest(f"capture-{i}", list(ids), SamplingParams(temperature=0, max_tokens=1)))
    while engine.has_unfinished():
        engine.step()
    sampler.sample = original
    return torch.cat(captured)[:num]


def bench_chain(backend, all_logits: torch.Tensor, batch: int, repeats: int) -> tuple[float, float, float]:
    """Seconds per call: the batch on `backend`, the loop of rows on it, and the loop on PyTorch."""
    g = torch.Generator().manual_seed(batch)
    logits = all_logits[:batch].contiguous()
    vocab = logits.shape[1]
    params = mixed_params(batch, vocab)
    state = PenaltyState(vocab)
    penalty_rows = {i: state.row(str(i), torch.randint(0, vocab, (64,), generator=g).tolist(), [])
                    for i, p in enumerate(params) if p.has_penalties}
    outputs = [[3, 4]] * batch
    # Like the engine: a request's allowed-token mask is built once and kept.
    masks = {i: allowed_token_mask(p, vocab) for i, p in enumerate(params) if p.allowed_token_ids}
    sampler = Sampler(backend, torch.Generator().manual_seed(0))
    torch_sampler = Sampler(TorchBackend(), torch.Generator().manual_seed(0))

    def batched():
        md = SamplingMetadata.build(params, vocab, eos_token_ids=(0,), penalty_state_rows=penalty_rows,
                                    output_token_ids=outputs, allowed_masks=masks)
        sampler.sample(logits, md, state)

    def per_request(one_row_sampler):
        for i, p in enumerate(params):
            md = SamplingMetadata.build([p], vocab, eos_token_ids=(0,),
                                        penalty_state_rows={0: penalty_rows[i]} if i in penalty_rows else {},
                                        output_token_ids=[outputs[i]],
                                        allowed_masks={0: masks[i]} if i in masks else {})
            one_row_sampler.sample(logits[i:i + 1], md, state)

    loops = max(1, repeats // 4)
    return (_timed(batched, repeats), _timed(lambda: per_request(sampler), loops),
            _timed(lambda: per_request(torch_sampler), loops))


def engine_sampling_share(engine, num_requests: int, steps: int) -> float:
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
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--engine-requests", type=int, default=64)
    ap.add_argument("--engine-steps", type=int, default=16)
    args = ap.parse_args(argv)
    engine = EngineCore(EngineConfig(model=default_model_path()))  # the default weights, as served
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    logits = model_logits(engine, load_tokenizer(default_model_path()), max(sizes))
    print("| rows | batched chain (ms/step) | loop, same kernel per row (ms) | speed-up "
          "| loop, PyTorch chain per row (ms) | speed-up |\n|---|---|---|---|---|---|")
    for b in sizes:
        batched, looped, torch_loop = bench_chain(engine.backend, logits, b, args.repeats)
        print(f"| {b} | {batched * 1e3:.2f} | {looped * 1e3:.2f} | {looped / batched:.1f}x "
              f"| {torch_loop * 1e3:.2f} | {torch_loop / batched:.1f}x |", flush=True)
    if args.engine_requests:
        share = engine_sampling_share(engine, args.engine_requests, args.engine_steps)
        print(f"\nsampling share of an engine step with {args.engine_requests} running requests "
              f"(mixed parameters, SmolLM2, default weights): {share * 100:.1f}%")
