"""`nanoserve bench offline`: nanoserve's engine against `transformers`' batched `generate` on the same
model, dtype and machine, in one run: a batch of random prompts with fixed output length (ignore_eos),
then batch-1 decode. Prints output tokens/s for both and the ratio."""
from __future__ import annotations

import argparse
import gc
import math
import os
import time

import torch


def _random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Stay clear of the special tokens at the start of the vocabulary.
    return torch.randint(100, vocab, (num, length), generator=g).tolist()


def run_nanoserve(model: str, dtype: str, prompts, output_len: int, max_num_batched_tokens: int,
                  activation_dtype: str = "auto", backend: str = "auto") -> float:
    """`backend`: auto, c, torch, or portable (the C kernels' portable build)."""
    from nanoserve import LLM, SamplingParams

    kernels = dict(kernels="c", kernel_target="portable") if backend == "portable" else dict(kernels=backend)
    llm = LLM(model, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
              max_num_seqs=max(len(prompts), 1), activation_dtype=activation_dtype, **kernels)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    del llm
    gc.collect()
    return len(prompts) * output_len / elapsed


def run_transformers(model: str, dtype: str, prompts, output_len: int) -> float:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if os.path.isdir(model):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(model)),
                                                  gguf_file=os.path.basename(model), dtype=torch_dtype)
    hf.eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.inference_mode():
        hf.generate(ids[:1, :8], max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                          min_new_tokens=output_len, do_sample=False)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == output_len
    del hf
    gc.collect()
    return len(prompts) * output_len / elapsed


def main(argv=None) -> None:
    from nanoserve.model.loader import default_model_path, load_model_weights

    ap = argparse.ArgumentParser(prog="nanoserve bench offline", description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="auto", help="nanoserve dtypes to measure, comma-separated")
    ap.add_argument("--activation-dtypes", default="auto",
                    help="nanoserve activation dtypes to measure with each of --dtypes (auto, float32, int8)")
    ap.add_argument("--backends", default="auto",
                    help="compute backends to measure with each of the above (auto, c, torch, portable)")
    ap.add_argument("--baseline-dtype", default="float32", help="dtype of the transformers baseline")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=256, help="output tokens of the batch-1 run")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--workloads", default="batch,single", help="which of batch,single to run")
    ap.add_argument("--skip-baseline", action="store_true")
    args = ap.parse_args(argv)
    model = args.model or default_model_path()
    torch.set_num_threads(os.cpu_count() or 1)
    vocab = load_model_weights(model)[0].vocab_size  # random prompts must stay inside the vocabulary
    batch = _random_prompts(args.num_prompts, args.input_len, vocab)
    single = _random_prompts(1, 16, vocab, seed=1)
    rows = []
    workloads = {"batch": (f"{args.num_prompts} prompts x {args.input_len} in, {args.output_len} out",
                           batch, args.output_len),
                 "single": (f"batch-1 decode, {args.decode_len} tokens", single, args.decode_len)}
    for key in args.workloads.split(","):
        name, prompts, out_len = workloads[key]
        base = None if args.skip_baseline else run_transformers(model, args.baseline_dtype, prompts, out_len)
        if base is not None:
            rows.append((name, f"transformers {args.baseline_dtype}", base, 1.0))
            print(f"{name:45s} transformers {args.baseline_dtype:9s} {base:8.1f} tok/s", flush=True)
        for dtype in args.dtypes.split(","):
            for act, backend in [(a, b) for a in args.activation_dtypes.split(",") for b in args.backends.split(",")]:
                ours = run_nanoserve(model, dtype, prompts, out_len, args.max_num_batched_tokens, act, backend)
                ratio = ours / base if base else float("nan")
                label = dtype if act == "auto" else f"{dtype}, {act} activations"
                label += "" if backend == "auto" else f", {backend} backend"
                rows.append((name, f"nanoserve {label}", ours, ratio))
                versus = f"  x{ratio:.2f}" if base else ""  # --skip-baseline: nothing to compare with
                print(f"{name:45s} nanoserve {label:12s} {ours:8.1f} tok/s{versus}", flush=True)
    print("\n| workload | engine | output tok/s | vs transformers |\n|---|---|---|---|")
    for name, engine, tps, ratio in rows:
        print(f"| {name} | {engine} | {tps:.1f} | {'-' if math.isnan(ratio) else f'{ratio:.2f}x'} |")
