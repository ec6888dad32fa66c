"""The offline `LLM` API and the engine's request handling on SmolLM2: prompt forms, per-prompt params,
vLLM-shaped outputs, n > 1, seeds, stop tokens, context limits, and `SamplingParams` validation."""
import subprocess
import sys

import pytest

from nanoserve import CompletionOutput, RequestOutput, SamplingParams
from nanoserve.config import CacheConfig, EngineConfig, SchedulerConfig
from nanoserve.engine.core import EngineCore, PromptTooLongError
from nanoserve.protocol import EngineCoreRequest, FinishReason

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_prompt_forms_give_the_same_output(smollm_llm, smollm_tokenizer):
    ids = smollm_tokenizer.encode("The capital of France is")
    by_text = smollm_llm.generate("The capital of France is", GREEDY, use_tqdm=False)
    by_ids = smollm_llm.generate(ids, GREEDY, use_tqdm=False)
    by_list = smollm_llm.generate([ids, ids], GREEDY, use_tqdm=False)
    by_dict = smollm_llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert len(by_text) == len(by_ids) == len(by_dict) == 1 and len(by_list) == 2
    ref = by_text[0].outputs[0].token_ids
    for out in [by_ids[0], by_list[0], by_list[1], by_dict[0]]:
        assert out.outputs[0].token_ids == ref
    assert by_text[0].prompt == "The capital of France is" and by_ids[0].prompt is None
    assert by_text[0].prompt_token_ids == ids


def test_output_shape_and_per_prompt_params(smollm_llm):
    outs = smollm_llm.generate(["Hello", "Goodbye"], [GREEDY, SamplingParams(temperature=0, max_tokens=3)],
                               use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    first, second = outs[0].outputs[0], outs[1].outputs[0]
    assert isinstance(first, CompletionOutput) and first.index == 0
    assert len(second.token_ids) == 3 and second.finish_reason == "length"
    assert first.text == smollm_llm.get_tokenizer().decode(first.token_ids, skip_special_tokens=True)
    assert first.logprobs is None and second.stop_reason is None
    with pytest.raises(ValueError):
        smollm_llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_seeded_sampling_is_reproducible_and_n_samples(smollm_llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, n=3, ignore_eos=True)
    a = smollm_llm.generate("Write a word:", params, use_tqdm=False)[0]
    b = smollm_llm.generate(["Another prompt", "Write a word:"], params, use_tqdm=False)[1]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # independent samples


def test_stop_token_ids_and_eos(smollm_llm, smollm_tokenizer):
    ref = smollm_llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    stop = ref.token_ids[2]
    out = smollm_llm.generate("The capital of France is",
                              SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]),
                              use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref.token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    chat = smollm_llm.chat([{"role": "user", "content": "Say only: yes"}],
                           SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in smollm_llm.engine.eos_token_ids
    assert "<|im_end|>" not in chat.text


def _small_context_engine(llm, max_model_len=32):
    cfg = EngineConfig(model=llm.model_path, dtype="float32", cache=CacheConfig(num_kv_blocks=16),
                       scheduler=SchedulerConfig(max_model_len=max_model_len))
    return EngineCore(cfg, loaded_model=(llm.engine.model_config, llm.engine.runner.model))


def test_prompt_too_long_and_max_tokens_clamped(smollm_llm):
    engine = _small_context_engine(smollm_llm)
    with pytest.raises(PromptTooLongError, match="32 tokens.*40 tokens"):
        engine.add_request(EngineCoreRequest("long", list(range(100, 140)), GREEDY))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(EngineCoreRequest("bad", [10**6], GREEDY))
    engine.add_request(EngineCoreRequest("ok", list(range(100, 120)),
                                         SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)))
    tokens, reason = [], None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            reason = o.finish_reason
    assert len(tokens) == 12 and reason is FinishReason.LENGTH  # 20 + 12 = max_model_len


def test_abort_frees_blocks(smollm_llm):
    engine = _small_context_engine(smollm_llm, max_model_len=256)
    engine.add_request(EngineCoreRequest("a", list(range(100, 150)),
                                         SamplingParams(temperature=0, max_tokens=100)))
    engine.step()
    assert engine.block_manager.num_free_blocks < 16
    assert engine.abort("a") and not engine.abort("a")
    assert engine.block_manager.num_free_blocks == 16 and not engine.has_unfinished()


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.5), ("max_tokens", 0), ("min_tokens", -1), ("stop_token_ids", [-1]),
])
def test_sampling_params_validation(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_greedy_with_n_rejected():
    with pytest.raises(ValueError, match="n"):
        SamplingParams(n=2, temperature=0)


def test_cli_generate():
    proc = subprocess.run([sys.executable, "-m", "nanoserve", "generate", "The capital of France is",
                           "--max-tokens", "4"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_logit_bias_allowed_tokens_and_min_tokens_on_the_model(smollm_llm, smollm_tokenizer):
    forced = smollm_tokenizer.encode(" banana")[0]
    out = smollm_llm.generate("The capital of France is",
                              SamplingParams(temperature=0, max_tokens=4, logit_bias={forced: 100}),
                              use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [forced] * 4
    allowed = smollm_tokenizer.encode(" yes no maybe")
    out = smollm_llm.generate("Answer:", SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                                        allowed_token_ids=allowed), use_tqdm=False)[0]
    assert set(out.outputs[0].token_ids) <= set(allowed)
    chat = [{"role": "user", "content": "Say only: yes"}]
    short = smollm_llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    eos = smollm_llm.engine.eos_token_ids
    assert len(short.token_ids) < 20 and short.token_ids[-1] in eos
    longer = smollm_llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=30),
                             use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= 30 and not set(longer.token_ids[:30]) & set(eos)
    with pytest.raises(ValueError, match="logit_bias"):
        smollm_llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_repetition_penalty_lowers_repetition(smollm_llm):
    def repeated_share(params):
        ids = smollm_llm.generate("List of fruits: apple, banana,", params, use_tqdm=False)[0].outputs[0].token_ids
        return sum(t in ids[:i] for i, t in enumerate(ids)) / len(ids)

    base = repeated_share(SamplingParams(temperature=0, max_tokens=96, ignore_eos=True))
    penalized = repeated_share(SamplingParams(temperature=0, max_tokens=96, ignore_eos=True,
                                              repetition_penalty=1.5))
    print(f"share of repeated tokens: {base:.2f} without, {penalized:.2f} with repetition_penalty=1.5")
    assert penalized < base - 0.1


def test_raw_logprobs_equal_log_softmax_of_the_model(smollm_llm, smollm_hf, smollm_tokenizer):
    import torch

    prompt = smollm_tokenizer.encode("The three primary colors are")
    out = smollm_llm.generate(prompt, SamplingParams(temperature=0.8, seed=5, max_tokens=6, logprobs=5),
                              use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    with torch.inference_mode():
        ref = torch.log_softmax(smollm_hf(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
    total = 0.0
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[token].logprob - row[token].item()) < 1e-3
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = sorted((lp for t, lp in entry.items() if lp.rank <= 5), key=lambda lp: lp.rank)
        values = [lp.logprob for lp in top]
        assert values == sorted(values, reverse=True) and len(top) == 5
        assert top[0].logprob >= entry[token].logprob
        if entry[token].rank <= 5:
            assert top[entry[token].rank - 1].logprob == entry[token].logprob
        assert entry[token].decoded_token == smollm_tokenizer.decode([token])
        total += entry[token].logprob
    assert abs(out.cumulative_logprob - total) < 1e-6
    assert smollm_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].logprobs is None


def test_processed_logprobs_follow_temperature(smollm_llm):
    engine = _small_context_engine(smollm_llm, max_model_len=256)
    engine.runner.logprobs_mode = "processed"
    prompt = list(range(300, 320))
    for rid, temp in [("hot", 0.5), ("greedy", 0.0)]:
        engine.add_request(EngineCoreRequest(rid, prompt, SamplingParams(temperature=temp, seed=1,
                                                                         max_tokens=1, logprobs=2)))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o.new_logprobs[0]
    # Dividing the logits by 0.5 sharpens the distribution: the top token's logprob rises towards 0.
    assert outs["hot"].top_logprobs[0] > outs["greedy"].top_logprobs[0]
    assert outs["hot"].top_token_ids[0] == outs["greedy"].top_token_ids[0]


def test_stop_strings_cut_the_text_and_finish_the_engine_request(smollm_llm):
    prompt = "Count from one to twenty: one, two, three,"
    full = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    assert " six" in full.text
    aborted = []
    abort = smollm_llm.engine.abort
    smollm_llm.engine.abort = lambda rid: (aborted.append(rid), abort(rid))[1]
    try:
        out = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                         stop=[" six", "zzz"]), use_tqdm=False)[0]
    finally:
        del smollm_llm.engine.abort
    completion = out.outputs[0]
    assert completion.text == full.text[:full.text.index(" six")]
    assert completion.finish_reason == "stop" and completion.stop_reason == " six"
    assert len(completion.token_ids) < 40 and aborted == [out.request_id]
    assert not smollm_llm.engine.has_unfinished()
    kept = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                      stop=[" six"], include_stop_str_in_output=True),
                               use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(" six") + 4]
