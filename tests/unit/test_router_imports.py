"""The router loads no torch: importing its modules loads no torch and no
model code (the engine package exports its names lazily and the loader
imports torch only where weights are loaded), and the running router process
loads the model's tokenizer only, without torch (loader.load_tokenizer),
since the engines report the model's id and context."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent import futures

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from tandem.v1 import common_pb2, decode_pb2_grpc


def test_importing_the_router_loads_no_torch():
    code = ("import sys, tandem.services.router.app, tandem.services.router.server, "
            "tandem.services.router.grpc_api, tandem.engine.request, tandem.engine.loader; "
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('tandem.engine.model') "
            "or m.startswith('tandem.kernels')); print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_engine_package_still_exports_its_names():
    import tandem.engine as engine

    assert set(engine.__all__) <= set(dir(engine))
    for name in engine.__all__:
        assert getattr(engine, name).__name__ == name


class _Decode(decode_pb2_grpc.DecodeServiceServicer):
    """Enough of a decode engine for the router to start: health and GetLoad."""

    def GetLoad(self, request, context) -> common_pb2.Load:
        return common_pb2.Load(model_id="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=1234,
                               block_size=16)


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line or "/torch/" in line for line in f)


@pytest.mark.timeout(240)
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/<pid>/maps (Linux)")
def test_the_running_router_and_its_tokenizer_workers_load_no_torch(tmp_path):
    server = grpc.server(futures.ThreadPoolExecutor(4))
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(_Decode(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "tandem.services.router.server", "--port", "0", "--grpc-port", "-1",
             "--decode", f"127.0.0.1:{port}", "--tokenizer-workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not (m := re.search(r"^router listening on (\S+)$", log_path.read_text(), re.M)):
            assert router.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        # What it serves comes from the engine: nothing else in the router says 1234.
        data = httpx.get(f"http://{m.group(1)}/v1/models", timeout=10).json()["data"]
        assert [(d["id"], d["max_model_len"]) for d in data] == [("HuggingFaceTB/SmolLM2-135M-Instruct", 1234)]
        children = subprocess.run(["pgrep", "-P", str(router.pid)], capture_output=True,
                                  text=True).stdout.split()
        assert children, "no tokenizer worker found"
        assert not _maps_torch(router.pid), "the router process has torch mapped"
        assert not any(_maps_torch(int(pid)) for pid in children), "a tokenizer worker has torch mapped"
    finally:
        router.terminate()
        router.wait(30)
        server.stop(0)
