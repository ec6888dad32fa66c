"""The batched sampler against per-row reference code: min_p, top-k and top-p with mixed per-row
parameters (including disabled and greedy rows), the exponential race's frequencies, and seeded rows
that do not depend on the rest of the batch."""
import torch

import pytest

from backends import C, KERNELS_ON, TORCH, requires_kernels
from nanoserve.sample.metadata import SamplingMetadata
from nanoserve.sample.sampler import Sampler, apply_min_p, apply_top_k_top_p
from nanoserve.sampling_params import SamplingParams

# Both implementations of the chain: the C backend's kernel and the PyTorch backend's code.
PATHS = [pytest.param(True, marks=requires_kernels, id="kernel"), pytest.param(False, id="torch")]


def make_sampler(use_kernels: bool, seed: int = 0) -> Sampler:
    """A sampler on the C backend (use_kernels) or the PyTorch one."""
    return Sampler(C if use_kernels else TORCH, torch.Generator().manual_seed(seed))

NEG = float("-inf")


def _reference_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The same filters as the sampler, written for one row at a time."""
    row = logits / (1.0 if p.greedy else p.temperature)
    if p.min_p > 0:
        probs = torch.softmax(row, -1)
        row = torch.where(probs < p.min_p * probs.max(), torch.tensor(NEG), row)
    if p.top_k > 0:
        kth = torch.sort(row, descending=True).values[min(p.top_k, row.numel()) - 1]
        row = torch.where(row < kth, torch.tensor(NEG), row)
    if p.top_p < 1:  # keep a token while the mass of the tokens ranked above it is below p
        lse = torch.logsumexp(row, -1)
        values, order = torch.sort(row, descending=True)
        probs = torch.exp(values - lse)
        above = probs.cumsum(-1) - probs
        keep = [bool(above[j] < p.top_p) or j == 0 for j in range(row.numel())]
        dropped = order[[not x for x in keep]]
        row = row.clone()
        row[dropped] = NEG
    return row


MIXED = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.9),
         SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_k=0, top_p=1.0),
         SamplingParams(temperature=0.5, top_k=50, top_p=0.5, min_p=0.05),
         SamplingParams(temperature=1.0, top_k=-1, min_p=0.2), SamplingParams(temperature=0.9, top_k=1),
         SamplingParams(temperature=1.0, top_p=0.01)]


def test_batched_filters_equal_per_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MIXED), 1000, generator=g) * 3
    md = SamplingMetadata.build(MIXED, vocab_size=1000)
    batched = logits / md.temperature.unsqueeze(1)
    batched = apply_top_k_top_p(apply_min_p(batched, md.min_p), md.top_k, md.top_p)
    for i, p in enumerate(MIXED):
        ref = _reference_row(logits[i], p)
        assert torch.equal(torch.isinf(batched[i]), torch.isinf(ref)), i
        finite = ~torch.isinf(ref)
        assert torch.equal(batched[i][finite], ref[finite]), i
    assert (~torch.isinf(batched[0])).sum() == 5 and (~torch.isinf(batched[6])).sum() == 1


@requires_kernels
def test_kernel_chain_equals_per_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MIXED), 1000, generator=g) * 3
    md = SamplingMetadata.build(MIXED, vocab_size=1000)
    md.need_processed = True
    tokens, processed = make_sampler(True).sample(logits, md)
    for i, p in enumerate(MIXED):
        ref = _reference_row(logits[i], p)
        assert torch.equal(torch.isinf(processed[i]), torch.isinf(ref)), i
        finite = ~torch.isinf(ref)
        assert torch.equal(processed[i][finite], ref[finite]), i
        assert finite[tokens[i]], i
    # Without processed logits wanted, each row works in a per-thread buffer: the same tokens.
    md.need_processed = False
    again, none = make_sampler(True).sample(logits, md)
    assert none is None and torch.equal(again, tokens)


def test_fast_paths_leave_stages_off():
    md = SamplingMetadata.build([SamplingParams(temperature=0.8)] * 3, vocab_size=10)
    assert md.top_k is None and md.top_p is None and md.min_p is None and md.greedy_mask is None
    assert SamplingMetadata.build([SamplingParams(temperature=0)] * 2, 10).all_greedy


@pytest.mark.parametrize("use_kernels", PATHS)
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_all_greedy_batch_equals_torch_argmax(use_kernels, rows):
    """An all-greedy batch without processors (the kernel's argmax from 2 rows): the first index of each
    row's maximum, ties and a row of -inf included, whatever path takes it."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-4, 4, (rows, 1003), generator=g).float()  # many ties
    if rows > 1:
        logits[-1] = NEG  # no finite value: index 0
    md = SamplingMetadata.build([SamplingParams(temperature=0)] * rows, vocab_size=1003)
    ids, processed = make_sampler(use_kernels).sample(logits, md)
    assert torch.equal(ids, logits.argmax(dim=-1)) and processed is logits


@pytest.mark.parametrize("use_kernels", PATHS)
def test_greedy_rows_take_argmax_and_filters_restrict_samples(use_kernels):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(MIXED), 1000, generator=g) * 3
    md = SamplingMetadata.build(MIXED, vocab_size=1000)
    allowed = [~torch.isinf(_reference_row(logits[i], p)) for i, p in enumerate(MIXED)]
    sampler = make_sampler(use_kernels, seed=2)
    for _ in range(50):
        out = sampler(logits, md)
        assert out[2] == logits[2].argmax() and out[6] == logits[6].argmax()
        assert all(allowed[i][t] for i, t in enumerate(out.tolist()))


@pytest.mark.parametrize("use_kernels", PATHS)
def test_exponential_race_matches_probabilities(use_kernels):
    probs = torch.tensor([0.05, 0.3, 0.02, 0.13, 0.25, 0.0, 0.15, 0.1])
    rows = 200_000
    logits = probs.log().expand(rows, -1).contiguous()
    md = SamplingMetadata.build([SamplingParams(temperature=1.0)] * rows, vocab_size=8)
    tokens = make_sampler(use_kernels, seed=3)(logits, md)
    freq = torch.bincount(tokens, minlength=8).float() / rows
    assert (freq - probs).abs().max() < 0.01
    assert freq[5] == 0  # a zero-probability token is never drawn


@requires_kernels
def test_kernel_race_over_the_whole_vocabulary_draws_what_the_pytorch_race_draws():
    """Untruncated rows: the kernel computes keys only for tokens whose noise can still win; the tokens
    must be those of the PyTorch race, which computes every key."""
    g = torch.Generator().manual_seed(8)
    vocab = 6000
    logits = torch.randn(32, vocab, generator=g) * 4
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([1.0, 0.6, 1.5, 2.0] * 8)]
    drawn = {True: [], False: []}
    for kernel in (True, False):
        sampler = make_sampler(kernel)
        for step in range(10):
            md = SamplingMetadata.build(params, vocab, num_output_tokens=[step] * len(params))
            drawn[kernel].append(sampler(logits, md))
    assert torch.equal(torch.stack(drawn[True]), torch.stack(drawn[False]))
    assert len(set(torch.stack(drawn[True])[:, 3].tolist())) > 5  # temperature 2: varied draws


@pytest.mark.parametrize("use_kernels", PATHS)
def test_seeded_row_is_independent_of_the_batch(use_kernels):
    g = torch.Generator().manual_seed(4)
    row = torch.randn(1, 500, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=7, top_p=0.95)

    def draw(batch_logits, position, engine_seed, steps=20, kernel=use_kernels):
        params = [SamplingParams(temperature=0.9)] * batch_logits.shape[0]
        params[position] = seeded
        sampler = make_sampler(kernel, seed=engine_seed)
        out = []
        for step in range(steps):  # the row's output position advances one token per step
            md = SamplingMetadata.build(params, vocab_size=500, num_output_tokens=[step] * len(params))
            out.append(sampler(batch_logits, md)[position].item())
        return out

    alone = draw(row, 0, 99)
    others = torch.randn(6, 500, generator=g)
    assert alone == draw(torch.cat([others[:3], row, others[3:]]), 3, 5)
    assert len(set(alone)) > 3  # not one token repeated: the position moves the noise
    if use_kernels:  # the C kernel and the PyTorch code draw the same numbers
        assert alone == draw(row, 0, 99, kernel=False)


def test_penalties_equal_per_row_reference_and_counts_are_incremental():
    from nanoserve.sample.penalties import PenaltyState, apply_penalties

    g = torch.Generator().manual_seed(5)
    vocab = 50
    state = PenaltyState(vocab, initial_rows=2)  # grows while rows are added
    prompts = [torch.randint(0, vocab, (12,), generator=g).tolist() for _ in range(4)]
    rows = [state.row(str(i), p, []) for i, p in enumerate(prompts)]
    outputs = [[] for _ in prompts]
    for _ in range(30):  # tokens recorded one step at a time, as the runner does
        tokens = torch.randint(0, vocab, (4,), generator=g)
        state.record(torch.tensor(rows), tokens)
        for o, t in zip(outputs, tokens.tolist()):
            o.append(t)
    for r, o in zip(rows, outputs):
        assert torch.equal(state.output_counts[r], torch.bincount(torch.tensor(o), minlength=vocab).int())
    logits = torch.randn(4, vocab, generator=g) * 4
    rep, freq, pres = torch.tensor([1.0, 1.5, 0.7, 2.0]), torch.tensor([0.0, 0.5, -0.3, 1.2]), \
        torch.tensor([0.0, 1.0, 0.4, -1.5])
    idx = torch.tensor(rows)
    out = apply_penalties(logits, state.prompt_mask[idx], state.output_counts[idx], rep, freq, pres)
    for i in range(4):
        for t in range(vocab):
            x = logits[i, t].item()
            if t in prompts[i] or t in outputs[i]:
                x = x / rep[i].item() if x > 0 else x * rep[i].item()
            c = outputs[i].count(t)
            x -= freq[i].item() * c + pres[i].item() * (c > 0)
            assert abs(out[i, t].item() - x) < 1e-5
    if KERNELS_ON:  # the kernel applies the same penalties to greedy rows' logits
        params = [SamplingParams(temperature=0, repetition_penalty=r.item(), frequency_penalty=f.item(),
                                 presence_penalty=q.item()) for r, f, q in zip(rep, freq, pres)]
        md = SamplingMetadata.build(params, vocab, penalty_state_rows=dict(enumerate(rows)))
        md.need_processed = True
        tokens, processed = make_sampler(True).sample(logits, md, state)
        assert torch.allclose(processed, out, atol=1e-5) and torch.equal(tokens, out.argmax(dim=-1))
    state.remove("0")
    assert state.row("new", [1], []) == rows[0]  # rows are reused


@requires_kernels
def test_kernel_processors_equal_the_dense_pytorch_processors():
    """The kernel touches only the banned, biased and seen tokens; its processed logits must equal the
    dense PyTorch processors exactly, also where the lists overlap and where the row's top token is
    penalized (its max moves)."""
    from nanoserve.sample.penalties import PenaltyState
    from nanoserve.sample.sampler import apply_processors

    g = torch.Generator().manual_seed(6)
    vocab = 300
    logits = torch.randn(6, vocab, generator=g) * 4
    top = logits.argmax(dim=-1)
    params = [SamplingParams(temperature=0, repetition_penalty=1.8, logit_bias={int(top[0]): -1.0, 3: 2.0}),
              SamplingParams(temperature=0.7, frequency_penalty=0.6, presence_penalty=0.4, min_tokens=9,
                             stop_token_ids=[5], logit_bias={5: 3.0}),
              SamplingParams(temperature=1.0, repetition_penalty=0.8, allowed_token_ids=list(range(0, vocab, 2))),
              SamplingParams(temperature=0.9),
              SamplingParams(temperature=0, allowed_token_ids=[1, 2, 3], logit_bias={2: -100.0}),
              SamplingParams(temperature=1.3, top_k=20, repetition_penalty=1.3, presence_penalty=-0.5)]
    state = PenaltyState(vocab, initial_rows=1)
    outputs = [[] for _ in params]
    prompts = [[int(top[i]), 7, 7, 11] + torch.randint(0, vocab, (20,), generator=g).tolist() for i in range(6)]
    pen = [i for i, p in enumerate(params) if p.has_penalties]
    rows = {i: state.row(str(i), prompts[i], []) for i in pen}
    for _ in range(300):  # enough new tokens to grow the seen lists past their first width
        tokens = torch.randint(0, vocab, (len(pen),), generator=g)
        state.record(torch.tensor([rows[i] for i in pen]), tokens)
        for i, t in zip(pen, tokens.tolist()):
            outputs[i].append(t)
    for i in pen:
        seen = state.seen_tokens[rows[i], :int(state.num_seen[rows[i]])].tolist()
        assert sorted(seen) == sorted(set(prompts[i]) | set(outputs[i])) and len(seen) == len(set(seen))
    md = SamplingMetadata.build(params, vocab, num_output_tokens=[2] * 6, eos_token_ids=(0,),
                                penalty_state_rows=rows)
    md.need_processed = True
    tokens, processed = make_sampler(True).sample(logits, md, state)
    dense = apply_processors(logits, md, state)
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params]).unsqueeze(1)
    expected = dense / temperature
    for i, p in enumerate(params):
        if p.top_k:  # truncated rows keep their top-k values
            kept = ~torch.isinf(processed[i])
            assert kept.sum() >= 20 and torch.equal(processed[i][kept], expected[i][kept]), i
        else:
            assert torch.equal(processed[i], expected[i]), i
    assert tokens[0] == dense[0].argmax() and tokens[4] == 3


@pytest.mark.parametrize("use_kernels", PATHS)
def test_processors_bias_allowed_and_min_tokens(use_kernels):
    logits = torch.zeros(3, 10)
    params = [SamplingParams(temperature=0, logit_bias={7: 100.0}),
              SamplingParams(temperature=0, allowed_token_ids=[2, 3]),
              SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[4])]
    logits[1, 9] = 5.0
    logits[2, 0] = logits[2, 4] = 10.0  # token 0 is EOS here
    md = SamplingMetadata.build(params, 10, num_output_tokens=[0, 0, 2], eos_token_ids=(0,))
    out = make_sampler(use_kernels)(logits, md)
    assert out[0] == 7 and out[1] in (2, 3) and out[2] not in (0, 4)
    md = SamplingMetadata.build(params, 10, num_output_tokens=[0, 0, 5], eos_token_ids=(0,))
    assert make_sampler(use_kernels)(logits, md)[2] in (0, 4)  # min_tokens reached: EOS allowed again


def test_new_fields_validated():
    import pytest

    for field, value in [("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("logit_bias", {-1: 1.0}), ("allowed_token_ids", []), ("allowed_token_ids", [-5])]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    assert SamplingParams(logit_bias={3: 500}).logit_bias == {3: 100.0}


def test_bench_sampler_runs_both_paths():
    from nanoserve.bench.sampler import bench_chain

    times = bench_chain(C or TORCH, torch.randn(6, 300) * 3, batch=6, repeats=2)
    assert len(times) == 3 and min(times) > 0


def test_top_k_top_p_fall_back_to_a_full_sort_when_candidates_are_not_enough():
    vocab = 5000
    flat = torch.zeros(3, vocab)  # uniform: 1024 candidates hold ~20% of the mass
    g = torch.Generator().manual_seed(9)
    flat[0] = torch.randn(vocab, generator=g) * 0.01  # distinct values: top-p has one right answer
    flat[2] = torch.randn(vocab, generator=g) * 0.01
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=1.0, top_p=0.5)]
    md = SamplingMetadata.build(params, vocab_size=vocab)
    out = apply_top_k_top_p(flat, md.top_k, md.top_p)
    for i, p in enumerate(params):
        ref = _reference_row(flat[i], p)
        assert torch.equal(torch.isinf(out[i]), torch.isinf(ref)), i
    assert (~torch.isinf(out[1])).sum() == vocab  # a tie at the k-th value keeps every tied token
    assert 4000 < (~torch.isinf(out[0])).sum() < 5000
    if KERNELS_ON:  # the kernel widens its candidate cut the same way
        md.need_processed = True
        processed = make_sampler(True).sample(flat, md)[1]
        assert torch.equal(torch.isinf(processed), torch.isinf(out))


def test_packed_masks_round_trip_and_the_kernel_reads_every_bit():
    """Allowed-token masks are packed 32 tokens per int32 word (xgrammar's layout); a vocabulary that is
    not a multiple of 32 and sparse, dense and sign-bit words give the kernel the PyTorch processors' rows."""
    from nanoserve.sample.metadata import mask_words, pack_bits, unpack_bits
    from nanoserve.sample.sampler import apply_processors

    g = torch.Generator().manual_seed(3)
    vocab = 1003
    bits = torch.rand(5, vocab, generator=g) < torch.tensor([[0.01], [0.5], [0.99], [0.2], [0.0]])
    bits[4, vocab - 1] = bits[4, 31] = True  # the last token and a sign bit alone
    words = pack_bits(bits)
    assert words.dtype == torch.int32 and words.shape == (5, mask_words(vocab)) and (words < 0).any()
    assert torch.equal(unpack_bits(words, vocab), bits)
    logits = torch.randn(5, vocab, generator=g) * 3
    params = [SamplingParams(temperature=t, logit_bias={5: 1.0}) for t in (0, 0.8, 1.0, 0, 1.2)]
    md = SamplingMetadata.build(params, vocab, allowed_masks={i: words[i] for i in range(5)})
    dense = apply_processors(logits, md, None)
    assert torch.equal(torch.isinf(dense), ~bits)
    if not KERNELS_ON:
        return
    md.need_processed = True
    tokens, processed = make_sampler(True).sample(logits, md)
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params]).unsqueeze(1)
    assert torch.equal(processed, dense / temperature)
    assert all(bits[i, t] for i, t in enumerate(tokens.tolist()))
