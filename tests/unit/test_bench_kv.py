"""`tandem bench kv` measures every path on the same bytes and relates each to
the TCP loopback ceiling and to its own idle speed (a real store process)."""
import json
import subprocess
import sys


def test_bench_kv_reports_each_path_against_the_ceilings(tmp_path):
    out = tmp_path / "kv.json"
    subprocess.run([sys.executable, "-m", "tandem.bench.kv", "--size-mib", "8", "--block-kib", "256",
                    "--repeats", "1", "--backends", "memory", "--busy", "0,0.5", "--output-json", str(out)],
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
