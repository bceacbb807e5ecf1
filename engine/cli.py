"""`tandem generate`: offline generation from the command line."""
from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text offline with the engine (no services)",
        description="Generate text with the paged KV engine in this process. "
                    "Example: tandem generate --chat \"What is the capital of France?\"")
    p.add_argument("prompt", nargs="*", help="raw prompt text (one generation per argument)")
    p.add_argument("--chat", action="append", default=[], metavar="MESSAGE",
                   help="a user message, sent through the model's chat template (repeatable)")
    p.add_argument("--model", default="smollm2",
                   help="HF model folder, .gguf file, or 'smollm2' (embedded; default)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tandem.engine import LLM, SamplingParams, SamplingParamsError

    if not args.prompt and not args.chat:
        print("error: give a prompt or --chat MESSAGE", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except SamplingParamsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    prompts = [llm.chat_prompt([{"role": "user", "content": m}]) for m in args.chat] + list(args.prompt)
    for out in llm.generate(prompts, params):
        print(out.outputs[0].text.strip())
    return 0
