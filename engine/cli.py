"""`tandem generate`: offline generation from the command line."""
from __future__ import annotations

import argparse
import sys

from tandem.engine.config import KV_TRANSFER_FIELDS, EngineArgs


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text offline with the engine (no services)",
        description="Generate text with the paged KV engine in this process. "
                    "Example: tandem generate --chat \"What is the capital of France?\"")
    p.add_argument("prompt", nargs="*", help="raw prompt text (one generation per argument)")
    p.add_argument("--chat", action="append", default=[], metavar="MESSAGE",
                   help="a user message, sent through the model's chat template (repeatable)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    EngineArgs.add_cli_args(p, skip=KV_TRANSFER_FIELDS)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tandem.engine import LLM, ConfigError, SamplingParams, SamplingParamsError
    from tandem.engine.loader import ModelNotFoundError

    if not args.prompt and not args.chat:
        print("error: give a prompt or --chat MESSAGE", file=sys.stderr)
        return 2
    engine_args = EngineArgs.from_cli_args(args)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        engine_args.create_engine_config()  # checked before the model loads
    except (SamplingParamsError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    try:
        llm = LLM.from_engine_args(engine_args)
    except ModelNotFoundError as exc:
        print(f"error: --model: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:  # found while loading (a draft model of another vocabulary)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompts = [llm.chat_prompt([{"role": "user", "content": m}]) for m in args.chat] + list(args.prompt)
    for out in llm.generate(prompts, params):
        print(out.outputs[0].text.strip())
    return 0
