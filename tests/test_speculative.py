"""N-gram speculation (`--speculative-ngram`): the proposer, the scheduler's acceptance of drafts on a fake
model (any mistake in counters, KV slots or stops changes the output), and SmolLM2 with and without
drafts: the same greedy text, seeded samples and logprobs, whatever else is in the batch."""
import random

import pytest

from backends import requires_kernels
from nanoserve.config import SchedulerConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.ngram import drafts_per_request, propose_ngram
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import Scheduler
from nanoserve.protocol import FinishReason
from nanoserve.sampling_params import SamplingParams


@pytest.mark.parametrize("tokens,k,expected", [
    ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # the 3-gram 1 2 3 occurred: what followed it
    ([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, [7, 1]),  # the most recent occurrence wins
    ([7, 1, 2, 8, 1, 2], 5, [8, 1, 2]),  # as many as there are after it
    ([3, 1, 2, 9, 4, 1, 2], 2, [9, 4]),
    ([1, 2, 3], 2, []),  # nothing repeats
    ([4, 1, 9, 1], 3, []),  # a 1-gram match is not enough
    ([1, 2, 1, 2], 0, []),
])
def test_propose_ngram(tokens, k, expected):
    assert propose_ngram(tokens, k) == expected


@pytest.mark.parametrize("running, expected", [(0, 4), (1, 4), (2, 3), (3, 1), (4, 1), (5, 0), (32, 0)])
def test_drafts_shrink_as_the_batch_grows(running, expected):
    """--speculative-ngram 4 within 8 rows: one stream drafts 4, two streams 3 each, four 1, five none."""
    assert drafts_per_request(4, 8, running) == expected


def test_propose_ngram_prefers_the_longest_match():
    tokens = [5, 6, 7, 8, 40, 0, 7, 8, 41, 6, 7, 8]  # "7 8" last came before 41, "6 7 8" before 40
    assert propose_ngram(tokens, 1) == [40]


def model_next(context: list[int]) -> int:
    """A fake model: mostly a cycle of period 6 (so drafts are often right), sometimes a token of its own."""
    h = (len(context) * 7919 + 31 * context[-1] + context[-2]) % 5
    return 100 + len(context) % 6 if h else 200 + len(context) % 11


class FakeSpecRunner:
    """Writes every row's token (drafts included) into its KV slot, checks that each row reads back exactly
    the tokens before it, and samples `model_next` of that context."""

    def __init__(self, num_blocks: int, block_size: int):
        self.bs, self.kv = block_size, [[None] * block_size for _ in range(num_blocks)]

    def execute(self, sched) -> list:
        out = []
        for req, n in zip(sched.requests, sched.num_new_tokens):
            start = req.num_computed_tokens
            fed = (req.all_token_ids + req.spec_token_ids)[start:start + n]
            for p, token in enumerate(fed, start):
                self.kv[req.block_ids[p // self.bs]][p % self.bs] = token
            if start + n < req.num_tokens:
                out.append(None)
                continue
            rows = []
            for end in range(req.num_tokens, start + n + 1):
                context = [self.kv[req.block_ids[p // self.bs]][p % self.bs] for p in range(end)]
                assert context == (req.all_token_ids + req.spec_token_ids)[:end]
                rows.append(model_next(context))
            out.append(rows if req.spec_token_ids else rows[0])
        return out


def run(num_draft: int, prompts, max_tokens=40, budget=64, num_blocks=96, **params):
    bm = BlockManager(num_blocks, 4, True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8), bm)
    runner = FakeSpecRunner(num_blocks, 4)
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens, **params), max_tokens,
                    eos_token_ids=(203,)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished():
        so = sched.schedule()
        assert so.total_tokens <= budget
        for r in sched.update_from_output(so, runner.execute(so)):
            if not r.is_finished and num_draft:
                r.spec_token_ids = propose_ngram(r.all_token_ids, min(num_draft, r.max_tokens - r.num_output_tokens - 1))
        steps += 1
    assert bm.num_free_blocks == num_blocks  # every block came back
    return [(r.output_token_ids, r.finish_reason) for r in reqs], steps, sched


@pytest.mark.parametrize("budget,num_blocks", [(64, 96), (6, 96), (64, 14)])  # roomy; tight budget; preemption
def test_drafts_change_nothing_but_the_number_of_steps(budget, num_blocks):
    rng = random.Random(0)
    prompts = [[100 + (i % 6) for i in range(rng.randint(3, 12))] for _ in range(5)]
    plain, plain_steps, _ = run(0, prompts, budget=budget, num_blocks=num_blocks)
    spec, spec_steps, sched = run(4, prompts, budget=budget, num_blocks=num_blocks)
    assert spec == plain
    assert sched.num_accepted_tokens > 0 and sched.num_draft_tokens > sched.num_accepted_tokens
    if budget == 64 and num_blocks == 96:
        assert spec_steps < plain_steps * 0.7


def test_a_stop_inside_accepted_drafts_ends_the_request_there():
    """EOS (203) comes from the model partway through a run of accepted drafts: the request ends on it and
    no token after it is kept, as without drafts; max_tokens is never passed."""
    prompts = [[100, 101, 102, 103, 104, 105] * 3]
    for max_tokens in (5, 17, 40):
        plain = run(0, prompts, max_tokens=max_tokens)[0]
        assert run(4, prompts, max_tokens=max_tokens)[0] == plain
        (tokens, reason), = plain
        assert len(tokens) <= max_tokens and (reason == FinishReason.LENGTH) == (203 not in tokens)


# --- SmolLM2 ---------------------------------------------------------------------------------------------

FRUIT = "apples, pears, plums, cherries, grapes, lemons, melons, figs, dates, limes"
REPEATING = f"List: {FRUIT}.\nThe same list again: {FRUIT}.\nAnd once more: "  # SmolLM2 goes on copying


@pytest.fixture(scope="module")
def spec_llm(smollm_path):
    from nanoserve import LLM
    return LLM(smollm_path, seed=0, activation_dtype="float32", kv_cache_dtype="float32",
               speculative_ngram=4, speculative_max_rows=64, max_model_len=1024, num_kv_blocks=256)


def mixed_params():
    """Greedy, seeded, logprobs, a stop string and a penalty row (which runs without drafts) in one batch."""
    return [SamplingParams(temperature=0, max_tokens=48),
            SamplingParams(temperature=0.8, seed=7, max_tokens=48),
            SamplingParams(temperature=0, max_tokens=40, logprobs=3),
            SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=40, logprobs=2),
            SamplingParams(temperature=0, max_tokens=48, stop=["melons"]),
            SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.3)]


def outputs_of(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             [{t: lp.logprob for t, lp in step.items()} for step in (o.outputs[0].logprobs or [])])
            for o in outs]


def test_drafts_are_accepted_on_a_repetitive_prompt(spec_llm):
    before = spec_llm.engine.scheduler.num_accepted_tokens
    out = spec_llm.generate([REPEATING], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 64
    assert spec_llm.engine.scheduler.num_accepted_tokens - before >= 16


@requires_kernels  # identity needs batch-invariant products: the C kernels' (PyTorch's GEMMs are not)
def test_speculation_changes_no_token_or_logprob(spec_llm, smollm_llm):
    prompts = [REPEATING] * 6
    plain = outputs_of(smollm_llm, prompts, mixed_params())
    spec = outputs_of(spec_llm, prompts, mixed_params())
    assert [o[:3] for o in spec] == [o[:3] for o in plain]
    for (*_, spec_lps), (*_, plain_lps) in zip(spec, plain):  # the same tokens; values within float32 rounding
        assert [step.keys() for step in spec_lps] == [step.keys() for step in plain_lps]
        for a, b in zip(spec_lps, plain_lps):
            assert all(abs(a[t] - b[t]) < 1e-3 for t in a)
    assert spec_llm.engine.scheduler.num_accepted_tokens > 0
    assert plain[4][2] == "stop" and "melons" not in plain[4][1]


def test_speculation_gives_valid_outputs(spec_llm):
    """Without the C kernels products are not batch-invariant, so only the form of the outputs is checked."""
    params = mixed_params()
    for (tokens, text, reason, logprobs), p in zip(outputs_of(spec_llm, [REPEATING] * 6, params), params):
        assert reason in ("stop", "length") and 0 < len(tokens) <= p.max_tokens
        assert (reason == "length") == (len(tokens) == p.max_tokens)
        if p.logprobs is not None:
            assert len(logprobs) == len(tokens) and all(t in step for t, step in zip(tokens, logprobs))
