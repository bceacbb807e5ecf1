"""What admitting a request whose KV is in the store costs the running batch.

A producer engine saves one long prompt into a real KV store process; a
consumer engine decodes a few requests, then receives the stored prompt. The
steps from its arrival until its first new token are timed in two modes,
alternating: with the background prefetch (the default) and with the fetch
done inside the step that admits the request (the previous behaviour). Every
running request waits for each of those steps, so the longest one is the
stall they see.

    python -m tandem.bench.kv_admission --prompt-len 2048 [--model MODEL] [--device cpu]
"""
from __future__ import annotations

import argparse
import dataclasses
import socket
import statistics
import subprocess
import sys
import time
from typing import Optional

from tandem.engine.config import KV_TRANSFER_FIELDS, EngineArgs


def start_store(capacity: str) -> tuple[subprocess.Popen, str]:
    """A KV store process on a free loopback port, once it answers."""
    from tandem.services.kvstore.client import KVStoreClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tandem.services.kvstore.server", "--host", "127.0.0.1",
                             "--port", str(port), "--data-port", "0", "--backend", "memory",
                             "--capacity", capacity],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with KVStoreClient(target, timeout_s=1.0) as client:
                client.stats()
            return proc, target
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the KV store did not start")
            time.sleep(0.2)


def store_engine(engine_args: EngineArgs, kv_role: str, store_target: str):
    """An engine of `engine_args` that moves KV through the store at `store_target`."""
    from tandem.engine.llm_engine import LLMEngine
    from tandem.services.kvstore.block_client import BlockStoreClient

    config = dataclasses.replace(engine_args, kv_transfer="store", kv_store=store_target,
                                 kv_role=kv_role).create_engine_config()
    return LLMEngine(config, kv_store=BlockStoreClient(store_target, timeout_s=5.0))


def measure(engine_args: EngineArgs, store_target: str, prompt: list[int], first: list[int],
            running: int, prefetch: bool) -> dict:
    from tandem.engine import SamplingParams

    engine = store_engine(engine_args, "consumer", store_target)
    if not prefetch:
        engine.connector.prefetch = lambda request, num_local_hit_tokens: None  # fetch inside the admitting step
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i in range(running):
        engine.add_request(f"run-{i}", [100 + i, 200 + i, 300 + i], params)
    for _ in range(5):
        engine.step()
    background = []
    for _ in range(5):
        t0 = time.perf_counter()
        engine.step()
        background.append(time.perf_counter() - t0)
    engine.add_request("stored", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       first_token_ids=first)
    stored = engine.scheduler.requests["stored"]
    arrived = time.perf_counter()
    steps = []
    while stored.num_output_tokens < 2:
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    result = {"prefetch": prefetch, "decode_step_ms": statistics.median(background) * 1e3,
              "steps_until_admitted": len(steps), "longest_step_ms": max(steps) * 1e3,
              "arrival_to_second_token_ms": (time.perf_counter() - arrived) * 1e3,
              "external_tokens": stored.num_external_tokens,
              "load_blocks": engine.connector.stats.load_blocks,
              "admission_steps_ms": [round(t * 1e3, 1) for t in steps]}
    engine.connector.close()
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.kv_admission", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=2048, help="tokens of the stored prompt")
    p.add_argument("--running", type=int, default=4, help="requests decoding when it arrives")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each mode")
    # Both engines take these; the benchmark runs on the CPU unless told otherwise.
    EngineArgs.add_cli_args(p, skip=KV_TRANSFER_FIELDS, defaults={"device": "cpu"})
    args = p.parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)

    from tandem.engine import SamplingParams

    store, target = start_store("4GiB")
    try:
        producer = store_engine(engine_args, "producer", target)
        rows = []
        for r in range(args.repeats):
            # A prompt of its own per run, so no run finds another's blocks locally.
            prompt = [1000 + (r * 7919 + 31 * i) % 20000 for i in range(args.prompt_len)]
            producer.add_request(f"p{r}", prompt, SamplingParams(temperature=0, max_tokens=1))
            first: list[int] = []
            while producer.has_unfinished():
                for out in producer.step():
                    first.extend(out.new_token_ids)
            for prefetch in (True, False):
                row = measure(engine_args, target, prompt, first, args.running, prefetch)
                rows.append(row)
                print(f"prefetch={row['prefetch']!s:5} decode step {row['decode_step_ms']:7.1f} ms | "
                      f"admission: {row['steps_until_admitted']} steps, longest {row['longest_step_ms']:7.1f} ms, "
                      f"arrival -> 2nd token {row['arrival_to_second_token_ms']:7.1f} ms | "
                      f"{row['external_tokens']} tokens loaded | steps (ms): "
                      f"{' '.join(f'{t:.0f}' for t in row['admission_steps_ms'])}", flush=True)
        for prefetch in (True, False):
            longest = [r["longest_step_ms"] for r in rows if r["prefetch"] is prefetch]
            print(f"prefetch={prefetch!s:5} longest step, median of {len(longest)}: "
                  f"{statistics.median(longest):.1f} ms")
    finally:
        store.terminate()
        store.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
