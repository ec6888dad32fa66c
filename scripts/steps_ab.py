"""A kernel change measured on whole decode steps: one engine (`LLM`) on a model file, its C backend
swapped between the working tree's kernel build and a base revision's (or a directory's) round by round,
in one process, the order alternating. Each round decodes `--rows` prompts together for `--tokens` steps
on each build (the same prompts for both, new ones every round, each prefilled apart first so that the
timed part is decode).
Whole steps carry what one product's timing (scripts/kernels_ab.py) leaves out: the threads' waits
between products, the element-wise kernels, attention.
Usage: python scripts/steps_ab.py FILE [--base REV | --base-dir DIR] [--rows 32] [--tokens 48] [--rounds 12]
Prints each build's median time a step and the median of the rounds' paired ratios base / working tree
(above 1: the working tree is faster), their range, and in how many rounds the working tree was faster."""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_ab import backend_from, sources_at  # noqa: E402

from nanoserve import LLM, SamplingParams  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a GGUF file or checkpoint directory")
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree's kernels with")
    ap.add_argument("--base-dir", default=None, help="a directory of kernel sources to compare with instead")
    ap.add_argument("--rows", type=int, default=32, help="prompts decoded together (rows of each step)")
    ap.add_argument("--tokens", type=int, default=48, help="decode steps a round, each build")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB")
    args = ap.parse_args(argv)
    llm = LLM(args.model, max_num_seqs=args.rows, kv_cache_memory=int(args.kv_cache_memory * 2**30),
              num_threads=args.threads)
    runner = llm.engine.runner
    work = runner.backend
    if work.name != "c":
        sys.exit(f"the engine runs the {work.name!r} backend, not the C kernels: nothing to compare")
    with tempfile.TemporaryDirectory() as tmp:
        base = backend_from(args.base_dir or sources_at(args.base, tmp), args.threads)
    print(f"base {args.base_dir or args.base} ({base.build_key}) against the working tree ({work.build_key}), "
          f"{args.rows} rows a step", flush=True)
    steps = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    times: dict[str, list[float]] = {"base": [], "work": []}
    for r in range(args.rounds):
        # the round's prompts, the same for both builds (the same work), new each round
        prompts = [{"prompt_token_ids": [100 + (7 * i + 13 * r) % 500] + list(range(200 + i, 232 + i))}
                   for i in range(args.rows)]
        order = (("base", base), ("work", work)) if r % 2 == 0 else (("work", work), ("base", base))
        for name, backend in order:
            runner.backend = runner.sampler.backend = backend
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # the prefill
            start = time.perf_counter()
            llm.generate(prompts, steps, use_tqdm=False)  # from the prefix cache, then the decode steps
            times[name].append((time.perf_counter() - start) / args.tokens)
    runner.backend = runner.sampler.backend = work
    ratios = [b / w for b, w in zip(times["base"], times["work"])]
    print(f"base {statistics.median(times['base']) * 1e3:.2f} ms a step, working tree "
          f"{statistics.median(times['work']) * 1e3:.2f} ms; base / working tree {statistics.median(ratios):.3f}x "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}; the working tree faster in {sum(x > 1 for x in ratios)} "
          f"of {len(ratios)} rounds)", flush=True)


if __name__ == "__main__":
    main()
