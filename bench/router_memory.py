"""The router process's resident memory after start, and whether torch is in it.

Starts `python -m tandem.services.router.server` (default flags, free ports)
in front of a stand-in decode instance in this process (gRPC health and
GetLoad, reporting the embedded model), reads VmRSS from /proc/<pid>/status
as soon as the router prints its listening line, and looks for torch in
/proc/<pid>/maps. Linux only.

    python -m tandem.bench.router_memory --runs 3

Prints one JSON line per run.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from concurrent import futures

try:
    from tandem.engine.config import DEFAULT_MODEL as EMBEDDED_MODEL_ID
except ImportError:  # code before EngineArgs (the "before" of a measurement)
    from tandem.engine.loader import EMBEDDED_MODEL_ID


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line or "/torch/" in line for line in f)


def _decode_stand_in():
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from tandem.v1 import common_pb2, decode_pb2_grpc

    class Decode(decode_pb2_grpc.DecodeServiceServicer):
        def GetLoad(self, request, context):
            load = common_pb2.Load()
            if "model_id" in load.DESCRIPTOR.fields_by_name:  # engines that report their model
                load.model_id, load.max_model_len, load.block_size = EMBEDDED_MODEL_ID, 8192, 16
            return load

    server = grpc.server(futures.ThreadPoolExecutor(4))
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(Decode(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def measure(decode: str) -> dict:
    start = time.monotonic()
    router = subprocess.Popen([sys.executable, "-m", "tandem.services.router.server", "--port", "0",
                               "--grpc-port", "0", "--decode", decode],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in router.stdout:
            if line.startswith("router listening on"):
                break
        else:
            raise SystemExit("the router exited before it listened")
        return {"router_rss_mib": round(_rss_kb(router.pid) / 1024, 1),
                "torch_mapped": _maps_torch(router.pid),
                "seconds_to_listening": round(time.monotonic() - start, 1)}
    finally:
        router.terminate()
        router.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    server, decode = _decode_stand_in()
    try:
        for _ in range(args.runs):
            print(json.dumps(measure(decode)), flush=True)
    finally:
        server.stop(0)


if __name__ == "__main__":
    main()
