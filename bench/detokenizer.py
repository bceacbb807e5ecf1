"""Host time of detokenizing one request's output, per token, by output
length: the incremental path (a fast tokenizer's DecodeStream) against
re-decoding the whole output per token (the path before, still used for
tokenizers without a Rust backend). Both write the same text
(tests/unit/test_detokenizer.py).

    python -m tandem.bench.detokenizer --lengths 100,1000,4000

Prints one JSON line per length: microseconds per token, median of --repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


class _NoBackend:
    """The tokenizer without its Rust backend: the re-decoding path."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def per_token_us(tokenizer, ids: list[int], stop: list[str]) -> float:
    from tandem.engine.detokenizer import Detokenizer

    detok = Detokenizer(tokenizer, stop)
    t0 = time.perf_counter()
    for i, t in enumerate(ids):
        detok.add(t)
        if i == len(ids) - 1:
            detok.finish()
        detok.delta(i == len(ids) - 1)
    return (time.perf_counter() - t0) / len(ids) * 1e6


def main() -> None:
    from tandem.engine.loader import load_model_info

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="whose tokenizer")
    parser.add_argument("--lengths", default="100,1000,4000", help="output lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stop", default="never-appears", help="one stop string ('' for none)")
    args = parser.parse_args()
    tokenizer = load_model_info(args.model).tokenizer
    text = "The history of the printing press begins in the fifteenth century. 🍕 猫 " * 400
    all_ids = tokenizer.encode(text, add_special_tokens=False)
    stop = [args.stop] if args.stop else []
    for length in (int(n) for n in args.lengths.split(",")):
        ids = all_ids[:length]
        row = {"tokens": len(ids)}
        for name, tok in (("incremental_us", tokenizer), ("redecode_us", _NoBackend(tokenizer))):
            row[name] = round(statistics.median(per_token_us(tok, ids, stop) for _ in range(args.repeats)), 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
