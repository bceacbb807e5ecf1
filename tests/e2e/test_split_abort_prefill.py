"""A client that leaves during a long prefill: the prompt stops computing
within one chunk (the engine's step budget, 2048 tokens on the CPU by
default), its blocks go back, and the prefill's log says where it stopped.
Before, a prompt at the context limit was one step of minutes and GBs that
ran to its end after the client had gone."""
from __future__ import annotations

import json
import random
import socket
import time

import pytest

from tests.support.stack import TWO_BY_TWO, tandem_stack  # noqa: F401  (fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TANDEM_STACK_OPTIONS = TWO_BY_TWO
CHUNK = 2048  # DEFAULT_TOKEN_BUDGET["cpu"]
WORDS = ["river", "stone", "lamp", "orchard", "violet", "engine", "harbor", "quiet", "maple", "ember"]


def computed(stack, names) -> float:
    return sum(stack.metric(n, "tandem:prompt_tokens_by_source_total", source="local_compute") for n in names)


def test_a_client_that_leaves_stops_its_prefill_within_one_chunk(tandem_stack):
    stack = tandem_stack
    prefills = [c["name"] for c in stack.children if c["role"] == "prefill"]
    rng = random.Random(time.time())
    prompt = " ".join(rng.choice(WORDS) for _ in range(6000))  # about 6000 tokens, never seen before
    body = json.dumps({"model": stack.model, "prompt": prompt, "max_tokens": 2}).encode()
    before = computed(stack, prefills)

    host, port = stack.state["http_address"].rsplit(":", 1)
    client = socket.create_connection((host, int(port)))
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 300
    while computed(stack, prefills) - before < CHUNK:  # the first chunk is done
        assert time.monotonic() < deadline, "the prefill never computed a chunk"
        time.sleep(0.2)
    client.close()
    at_leave = computed(stack, prefills) - before

    # Settled: no request running anywhere, every block back.
    deadline = time.monotonic() + 120
    while True:
        running = sum(stack.metric(n, "tandem:num_requests_running") for n in prefills)
        free = sum(stack.metric(n, "tandem:kv_cache_free_blocks") for n in prefills)
        total = sum(stack.metric(n, "tandem:kv_cache_total_blocks") for n in prefills)
        if running == 0 and free == total:
            break
        assert time.monotonic() < deadline, (running, free, total)
        time.sleep(0.5)
    time.sleep(1.0)  # one more metrics poll
    final = computed(stack, prefills) - before
    assert final <= at_leave + CHUNK, (at_leave, final)
    assert final < 5000, "the whole prompt was computed after the client left"
    assert stack.metric("router", "tandem:router_requests_total", status="499") >= 1
    logs = "".join(open(c["log_path"], errors="replace").read() for c in stack.children
                   if c["role"] == "prefill")
    assert "aborted during its prefill, after" in logs
