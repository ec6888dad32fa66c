"""Sampler features on the real SmolLM2 model: bad words, prompt logprobs, n > 1 sharing the prompt's
KV blocks, the logprobs cap, a chi-square test of top-p sampling on a real distribution, and
penalties through the engine with the kernel equal to the PyTorch sampler."""
import pytest
import torch

from backends import DEFAULT, TORCH, requires_kernels
from nanoserve.protocol import EngineCoreRequest
from nanoserve.sample.metadata import SamplingMetadata, banned_by_bad_words
from nanoserve.sample.sampler import Sampler
from nanoserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def test_banned_by_bad_words():
    words = [[5], [1, 2, 3], [9, 9]]
    assert banned_by_bad_words(words, []) == {5}
    assert banned_by_bad_words(words, [7, 1, 2]) == {5, 3}
    assert banned_by_bad_words(words, [1, 2, 4]) == {5}
    assert banned_by_bad_words(words, [9]) == {5, 9}


def test_bad_words_never_appear(smollm_llm, smollm_tokenizer):
    prompt = "The capital of France is"
    base = smollm_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert "Paris" in base.text
    params = SamplingParams(temperature=0, max_tokens=24, bad_words=["Paris", "France"])
    out = smollm_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert "Paris" not in out.text and "France" not in out.text
    # Sampled too: many draws, none containing the banned sequences.
    sampled = smollm_llm.generate([prompt] * 8, SamplingParams(temperature=1.0, seed=1, max_tokens=24,
                                                               bad_words=["Paris"]), use_tqdm=False)
    for r in sampled:
        assert "Paris" not in r.outputs[0].text
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])


def test_prompt_logprobs_equal_log_softmax_of_the_model(smollm_llm, smollm_hf, smollm_tokenizer):
    prompt = smollm_tokenizer.encode("Water boils at one hundred degrees Celsius at sea level.")
    result = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                                 use_tqdm=False)[0]
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    with torch.inference_mode():
        ref = torch.log_softmax(smollm_hf(torch.tensor([prompt])).logits[0].float(), -1)
    for pos in range(1, len(prompt)):
        entry, token, row = result.prompt_logprobs[pos], prompt[pos], ref[pos - 1]
        assert abs(entry[token].logprob - row[token].item()) < 1e-3
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = sorted((lp for lp in entry.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert len(top) == 3 and abs(top[0].logprob - row.max().item()) < 1e-3


def test_prompt_logprobs_with_chunked_prefill_and_a_warm_prefix_cache(smollm_llm, smollm_tokenizer):
    """Chunks give the same values as one pass; a cached prefix does not skip the prompt's positions."""
    prompt = smollm_tokenizer.encode("One, two, three, four, five, six, seven, eight, nine, ten. " * 4)
    smollm_llm.generate(prompt, GREEDY, use_tqdm=False)  # leaves the prompt's blocks in the cache
    whole = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)[0].prompt_logprobs
    engine = smollm_llm.engine
    old = engine.scheduler.config
    from dataclasses import replace
    engine.scheduler.config = replace(old, max_num_batched_tokens=16)
    try:
        pieces = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                                     use_tqdm=False)[0].prompt_logprobs
    finally:
        engine.scheduler.config = old
    assert len(whole) == len(pieces) == len(prompt)
    for a, b, token in zip(whole[1:], pieces[1:], prompt[1:]):
        assert abs(a[token].logprob - b[token].logprob) < 1e-4


def test_n_samples_share_the_prompt_computation(smollm_llm, smollm_tokenizer):
    prompt = smollm_tokenizer.encode("Write a short poem about the sea and the wind. " * 6)[:100]
    scheduler = smollm_llm.engine.scheduler
    computed = []
    schedule = scheduler.schedule

    def counting_schedule():
        out = schedule()
        computed.append(out.total_tokens)
        return out

    scheduler.schedule = counting_schedule
    try:
        params = SamplingParams(n=4, temperature=0.9, seed=11, max_tokens=5)
        result = smollm_llm.generate(prompt, params, use_tqdm=False)[0]
    finally:
        del scheduler.schedule
    block = smollm_llm.engine.block_manager.block_size
    shared = len(prompt) // block * block
    # The prompt once, each sibling only the tail past the last full block, then 4 tokens each.
    assert sum(computed) <= len(prompt) + 3 * (len(prompt) - shared) + 4 * 4
    assert len(result.outputs) == 4 and all(len(o.token_ids) == 5 for o in result.outputs)
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1
    again = smollm_llm.generate(prompt, params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in result.outputs]


def test_logprobs_cap_is_configurable(smollm_llm):
    smollm_llm.generate("Hi", SamplingParams(max_tokens=1, logprobs=20), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        smollm_llm.generate("Hi", SamplingParams(max_tokens=1, logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        smollm_llm.generate("Hi", SamplingParams(max_tokens=1, prompt_logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    config = smollm_llm.engine.config
    from dataclasses import replace
    smollm_llm.engine.config = replace(config, max_logprobs=50)
    try:
        out = smollm_llm.generate("Hi", SamplingParams(max_tokens=1, logprobs=30), use_tqdm=False)[0]
        assert len(out.outputs[0].logprobs[0]) >= 30
    finally:
        smollm_llm.engine.config = config


def test_top_p_sampling_matches_the_real_distribution(smollm_llm, smollm_tokenizer):
    """Chi-square goodness of fit: 20k draws from SmolLM2's next-token distribution after
    temperature 0.8 and top-p 0.9 against the exact truncated probabilities."""
    engine = smollm_llm.engine
    prompt = smollm_tokenizer.encode("My favourite animal is the")
    engine.add_request(EngineCoreRequest("chi2", prompt, SamplingParams(temperature=0, max_tokens=1)))
    captured = []
    sample = engine.runner.sampler.sample
    engine.runner.sampler.sample = lambda logits, *a, **k: (captured.append(logits.clone()), sample(logits, *a, **k))[1]
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        del engine.runner.sampler.sample
    logits = captured[0][0] / 0.8
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) < 0.9
    support, expected_p = order[keep], sorted_p[keep] / sorted_p[keep].sum()
    rows, rounds = 500, 40
    params = [SamplingParams(temperature=0.8, top_p=0.9)] * rows
    md = SamplingMetadata.build(params, logits.numel())
    sampler = Sampler(DEFAULT, torch.Generator().manual_seed(1234))
    batch = captured[0][0].expand(rows, -1).contiguous()
    counts = torch.zeros(logits.numel())
    for _ in range(rounds):
        tokens, _ = sampler.sample(batch, md)
        counts += torch.bincount(tokens, minlength=logits.numel())
    draws = rows * rounds
    assert counts[support].sum() == draws  # nothing outside the top-p set
    observed, expected = counts[support], expected_p * draws
    # Pool the tail so that every bin expects at least 5 draws.
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))
    print(f"chi-square {chi2:.1f} on {dof} degrees of freedom, p = {p_value:.3f}, {len(support)} tokens")
    assert dof >= 5 and p_value > 1e-3


@requires_kernels
@pytest.mark.parametrize("greedy", [True, False])
def test_penalties_through_the_engine_equal_the_pytorch_sampler(smollm_llm, greedy):
    """The kernel reads each request's list of seen tokens, which the engine extends as tokens are
    sampled; over a long generation with every penalty it must pick what the dense PyTorch processors
    pick (greedy), and draw what they draw (seeded)."""
    runner = smollm_llm.engine.runner
    params = SamplingParams(temperature=0 if greedy else 0.8, seed=None if greedy else 3, max_tokens=64,
                            ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3,
                            logit_bias={28: 1.5})
    prompts = ["List of fruits: apple, banana,", "Once upon a time"]
    kernel_sampler = runner.sampler
    out = {}
    try:
        for name, sampler in [("kernel", kernel_sampler), ("torch", Sampler(TORCH))]:
            runner.sampler = sampler
            out[name] = [r.outputs[0].token_ids for r in smollm_llm.generate(prompts, params, use_tqdm=False)]
    finally:
        runner.sampler = kernel_sampler
    assert out["kernel"] == out["torch"]
    assert len(set(out["kernel"][0])) > 30  # the penalties kept it from looping on a few tokens
