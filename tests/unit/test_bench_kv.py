"""`tandem bench kv` measures every path on the same bytes and relates each to
the TCP loopback ceiling and to its own idle speed (a real store process)."""
import json
import os
import subprocess
import sys
import threading
import time

from tandem.bench.kv import busy_thread


def test_bench_kv_reports_each_path_against_the_ceilings(tmp_path):
    out = tmp_path / "kv.json"
    subprocess.run([sys.executable, "-m", "tandem.bench.kv", "--size-mib", "8", "--block-kib", "256",
                    "--repeats", "1", "--backends", "memory", "--busy", "0,0.5", "--output-json", str(out)]
                   + (["--isolate-busy-thread"] if len(os.sched_getaffinity(0)) >= 2 else []),
                   check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    paths = {(r["path"], r["what"], r["busy"]) for r in result["rows"]}
    stores = [f"store memory{variant}" for variant in (" (shared memory)", "", " (in-process)", " (grpc)")]
    for path, what in [("tcp loopback", "recv"), ("memcpy", "copy"), ("nixl (UCX)", "read"),
                       *((store, what) for store in stores for what in ("save", "load"))]:
        assert {(path, what, 0.0), (path, what, 0.5)} <= paths
    tcp = next(r["GBps"] for r in result["rows"] if r["path"] == "tcp loopback" and r["busy"] == 0)
    memcpy = next(r["GBps"] for r in result["rows"] if r["path"] == "memcpy" and r["busy"] == 0)
    for r in result["rows"]:
        assert r["GBps"] > 0 and abs(r["of_tcp"] - r["GBps"] / tcp) < 1e-9
        assert abs(r["of_memcpy"] - r["GBps"] / memcpy) < 1e-9
        if r["busy"] == 0:
            assert r["of_idle"] == 1.0


def test_the_busy_thread_runs_alone_on_the_cpu_it_is_given():
    ours = os.sched_getaffinity(0)
    cpu = min(ours)
    with busy_thread(1.0, cpu):
        time.sleep(0.05)
        spinner = next(t for t in threading.enumerate() if t.name == "kv-bench-busy")
        assert os.sched_getaffinity(spinner.native_id) == {cpu}
    assert os.sched_getaffinity(0) == ours  # the caller's CPUs are its own
