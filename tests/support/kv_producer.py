"""A prefill engine in a process of its own, for tests of the KV transfers
a decode pulls from its prefill (direct, NIXL): it runs one prompt to its
first token, prints the first token and the KVHandle (hex of the serialized
proto) as one JSON line, then holds the blocks until a line arrives on stdin
(or stdin closes).

    python -m tests.support.kv_producer MODEL_DIR DEVICE DTYPE TOKEN,TOKEN,... [direct|nixl] [TP]
"""
from __future__ import annotations

import json
import sys


def read_answer(stream) -> dict:
    """The producer's JSON line from its stdout (NIXL and UCX may log lines there first)."""
    for line in stream:
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError("the producer exited without answering")


def main() -> None:
    from tandem.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams
    from tandem.engine.llm_engine import LLMEngine
    from tandem.services.common.kv_handle import handle_to_proto

    model_dir, device, dtype, prompt = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    transfer = sys.argv[5] if len(sys.argv) > 5 else "direct"
    tensor_parallel_size = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    prompt_ids = [int(t) for t in prompt.split(",")]
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=model_dir, dtype=dtype),
                                    cache=CacheConfig(block_size=16, num_blocks=256), device=device,
                                    kv_transfer=transfer, kv_role="producer",
                                    tensor_parallel_size=tensor_parallel_size))
    engine.add_request("r", prompt_ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    handle = handle_to_proto(out.kv_transfer_params)
    print(json.dumps({"first": out.new_token_ids, "handle": handle.SerializeToString().hex()}), flush=True)
    sys.stdin.readline()
    engine.shutdown()


if __name__ == "__main__":
    main()
