"""`tandem bench kv`: how fast KV blocks move between an engine and the KV
store, against the ceilings measured in the same run.

Every path moves the same bytes: --size-mib of blocks of --block-kib each
(the default, 2 MiB, is one block of Llama-3-8B in bf16: 32 layers, K and V,
16 tokens, 8 KV heads of 128). Paths:
- store (lent slots): what engines use beside a store on their host by
  default on a GPU (--kv-store-slots): the store lends slots of its own
  shared memory, and this process copies each block straight into a
  reserved slot and commits it, or out of a pinned one; no copy by the store;
- store (shared memory): what engines use beside a store on their host: the
  store client with a mover process, and a real KV store process that maps
  the engine's shared-memory arena and copies each value in and out of it
  (no bytes on the socket); compare it with memcpy;
- store: the same with the values sent over the store's data channel by the
  mover process (a store on another host), per backend;
- store (in-process): the same with the bytes moved in this process;
- store (grpc): the in-process client with the store's data channel off
  (gRPC Put/Get);
- tcp: the ceiling of the link: one TCP connection on loopback between two
  processes, 4 MiB sendall / recv_into into a reused buffer;
- memcpy: a copy into a reused buffer in this process;
- nixl: one NIXL READ (UCX) of the bytes, registered by another process, into
  memory registered here: how --kv-transfer nixl moves a prompt's blocks.
Each path runs idle, then (--busy) while a Python thread of this process
spins, as a serving engine's thread does: bytes that need this process's GIL
to move slow down then.

With --device cuda the blocks start and end in GPU memory, as an engine's
do: the shared-memory and lent-slot paths include the DMA to and from the
host (into the pinned arena, or the page-locked slot), the store's copy
where there is one, and wait for both.

    tandem bench kv --size-mib 256 --backends memory,redis
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

CHUNK = 4 << 20


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "kv", help="KV block transfer GB/s: the store path vs TCP loopback and memcpy",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256, help="bytes moved per measurement (default 256 MiB)")
    p.add_argument("--block-kib", type=int, default=2048, help="one block's bytes, every layer (default 2048)")
    p.add_argument("--backends", default="memory,redis",
                   help="store backends to measure: memory, redis (needs redis-server), comma-separated")
    p.add_argument("--repeats", type=int, default=3,
                   help="measurements per path and load, the loads taking turns; the median is reported")
    p.add_argument("--warmup", type=int, default=1,
                   help="unmeasured runs of each path first, idle (default 1; 0 measures a cold store)")
    p.add_argument("--busy", default="0,1", help="load of a Python thread beside the transfer: 0 idle, 1 "
                                                 "spinning all the time, 0.5 half the time (comma-separated)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="Python's GIL switch interval in this process while measuring (default: what engine "
                        "processes with a KV mover set, 0.25 ms; Python's own default is 5)")
    p.add_argument("--isolate-busy-thread", action="store_true",
                   help="run the busy thread alone on the first CPU and everything else (this process's other "
                        "threads, the store, the mover, Redis) on the rest, idle or busy: the busy thread then takes no "
                        "core from the transfer, and what it still costs is the GIL's share (for machines with "
                        "few cores, where a lost core would hide it; Linux, at least 2 CPUs)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the blocks are before a save and after a load (cuda: the store paths that an "
                        "engine on the store's host uses, shared memory and lent slots, each with its DMA)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(handler=run)


# --- load --------------------------------------------------------------------------------

@contextmanager
def busy_thread(fraction: float, cpu: Optional[int] = None) -> Iterator[None]:
    """A Python thread that holds the GIL `fraction` of the time (in 10 ms
    periods), on CPU `cpu` alone when given."""
    if fraction <= 0:
        yield
        return
    stop = threading.Event()

    def spin() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # this thread only
        while not stop.is_set():
            until = time.perf_counter() + 0.01 * fraction
            while time.perf_counter() < until:
                pass
            if fraction < 1:
                time.sleep(0.01 * (1 - fraction))

    thread = threading.Thread(target=spin, name="kv-bench-busy", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def rate_of(fn: Callable[[], None], nbytes: int) -> float:
    """GB/s of one fn() moving nbytes."""
    start = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - start) / 1e9


# --- ceilings ------------------------------------------------------------------------------

def _tcp_source(total: int) -> None:
    """Run in a process of its own: print a port, then send `total` bytes to
    every connection it accepts, in 4 MiB sendall calls from a reused buffer."""
    payload = memoryview(bytearray(os.urandom(CHUNK)))
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
                sent = 0
                while sent < total:
                    n = min(CHUNK, total - sent)
                    conn.sendall(payload[:n])
                    sent += n


@contextmanager
def tcp_ceiling(total: int) -> Iterator[Callable[[], None]]:
    """One receive of `total` bytes over loopback from another process (started
    beforehand, out of the timing), into a reused buffer."""
    source = subprocess.Popen([sys.executable, "-c", f"from tandem.bench.kv import _tcp_source; _tcp_source({total})"],
                              stdout=subprocess.PIPE, text=True)
    port = int(source.stdout.readline())
    buf = memoryview(bytearray(total))

    def once() -> None:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            got = 0
            while got < total:
                n = conn.recv_into(buf[got:], min(CHUNK, total - got))
                if n == 0:
                    raise RuntimeError("the sender stopped early")
                got += n
    try:
        yield once
    finally:
        source.kill()
        source.wait()


def _nixl_target(total: int, out, done) -> None:
    """Run in a process of its own: register `total` bytes with a NIXL agent,
    hand out how to read them, wait until told to stop."""
    import torch

    from tandem.engine.connector.nixl import nixl_api

    api = nixl_api()
    agent = api.nixl_agent("bench-kv-target", api.nixl_agent_config(backends=["UCX"]))
    memory = torch.randint(0, 256, (total,), dtype=torch.uint8)
    agent.register_memory(memory)
    out.put((agent.get_agent_metadata(), agent.get_serialized_descs(agent.get_xfer_descs(memory))))
    done.get()


@contextmanager
def nixl_read(total: int) -> Iterator[Optional[Callable[[], None]]]:
    """One NIXL READ (UCX) of `total` bytes registered by another process into
    memory registered here; None without NIXL installed."""
    try:
        from tandem.engine.connector.nixl import nixl_api

        api = nixl_api()
    except ImportError:
        yield None
        return
    import multiprocessing

    import torch

    context = multiprocessing.get_context("spawn")
    out, done = context.Queue(), context.Queue()
    target = context.Process(target=_nixl_target, args=(total, out, done), daemon=True)
    target.start()
    agent = None
    try:
        metadata, descs = out.get(timeout=60)
        agent = api.nixl_agent("bench-kv-initiator", api.nixl_agent_config(backends=["UCX"]))
        memory = torch.zeros(total, dtype=torch.uint8)
        agent.register_memory(memory)
        remote = agent.add_remote_agent(metadata)
        local_descs, remote_descs = agent.get_xfer_descs(memory), agent.deserialize_descs(descs)

        def once() -> None:
            xfer = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
            state = agent.transfer(xfer)
            while state == "PROC":
                state = agent.check_xfer_state(xfer)
            agent.release_xfer_handle(xfer)
            if state != "DONE":
                raise RuntimeError(f"NIXL read ended in state {state}")
        yield once
    finally:
        # The agent's progress thread keeps polling while the agent lives, about
        # a core: let it go now (the caller still holds `once`, which sees this
        # cell), not when run() returns, or it slows every later row.
        agent = None
        gc.collect()
        done.put(None)
        target.join(10)


def memcpy(total: int) -> Callable[[], None]:
    import numpy as np

    src = np.frombuffer(os.urandom(total), dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = src  # touched once: a reused buffer, as the arena is
    return lambda: np.copyto(dst, src)


# --- the store -----------------------------------------------------------------------------

@contextmanager
def store_process(backend: str, capacity: int, data_channel: bool = True) -> Iterator[str]:
    """A KV store process on loopback; yields its gRPC address once it listens."""
    log = tempfile.NamedTemporaryFile(prefix="bench-kv-", suffix=".log", delete=False)
    argv = [sys.executable, "-m", "tandem.services.kvstore.server", "--host", "127.0.0.1", "--port", "0",
            "--data-port", "0" if data_channel else "-1", "--backend", backend,
            "--capacity-bytes", str(capacity)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            text = open(log.name).read()
            lines = [line for line in text.splitlines() if line.startswith("kvstore listening on ")]
            if lines:
                yield lines[0].split()[-1]
                return
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the KV store did not start:\n{text[-2000:]}")
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(10)
        os.unlink(log.name)


@contextmanager
def redis_process() -> Iterator[Optional[str]]:
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", folder, "--maxmemory", "4gb",
                                 "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
        try:
            import redis

            deadline = time.monotonic() + 10
            while True:
                try:
                    redis.Redis(port=port, socket_timeout=0.5).ping()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise RuntimeError("redis-server did not answer")
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


def _on_gpu(total: int, block: int):
    """Blocks in GPU memory, [n, block] bytes, random."""
    import torch

    return torch.randint(0, 256, (total // block, block), dtype=torch.uint8, device="cuda")


def _cuda_pin(view) -> bool:
    from tandem.engine.connector.staging import pin_host_memory

    return pin_host_memory(view) == 0


def _cuda_unpin(view) -> None:
    from tandem.engine.connector.staging import unpin_host_memory

    unpin_host_memory(view)


def lent_paths(target: str, total: int, block: int, device: str = "cpu"
               ) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """(save, load, close) through slots the store lends (same host): reserve,
    copy each block in, commit; pin, copy each block out, release. On the CPU
    a block is one memmove without the GIL; on a GPU one DMA."""
    import torch

    from tandem.services.kvstore.lent_slots import LentSlots

    cuda = device == "cuda"
    slots = LentSlots(target, timeout_s=120.0, pin_memory=_cuda_pin if cuda else None,
                      unpin_memory=_cuda_unpin if cuda else None)
    if not slots.usable():
        slots.close()
        raise RuntimeError("the store lends no slots here")
    n = total // block
    keys = [f"bench-lent-{i}" for i in range(n)]
    if cuda:
        source, back = _on_gpu(total, block), torch.empty((n, block), dtype=torch.uint8, device="cuda")
        streams = [torch.cuda.Stream() for _ in range(4)]
    else:
        source = torch.frombuffer(bytearray(os.urandom(total)), dtype=torch.uint8).view(n, block)
        back = torch.zeros((n, block), dtype=torch.uint8)
    groups = [list(range(i, n, 4)) for i in range(4)]
    pool = ThreadPoolExecutor(max_workers=len(groups))

    def copy(group, views, into_slots: bool, g: int) -> None:
        # All of a call's blocks in one torch call (as the connector does): it
        # releases the GIL once, where a copy per block would wait for it per block.
        slots_ = [torch.frombuffer(view, dtype=torch.uint8) for view in views]
        ours = [source[i] for i in group] if into_slots else [back[i] for i in group]
        if not cuda:
            torch._foreach_copy_(*((slots_, ours) if into_slots else (ours, slots_)))
            return
        with torch.cuda.stream(streams[g]):
            torch._foreach_copy_(*((slots_, ours) if into_slots else (ours, slots_)), non_blocking=True)
        streams[g].synchronize()

    def put(g: int) -> None:
        group = groups[g]
        lease = slots.reserve([keys[i] for i in group], block)
        try:
            copy(group, lease.views, True, g)
            if lease.commit() != len(group):
                raise RuntimeError("the store did not store every block (capacity?)")
        except BaseException:
            lease.release()
            raise

    def get(g: int) -> None:
        group = groups[g]
        lease = slots.pin([keys[i] for i in group], block)
        try:
            if lease.num_lent != len(group):
                raise RuntimeError("the store lost blocks between save and load")
            copy(group, lease.views, False, g)
        finally:
            lease.release()

    def across(call) -> None:
        for future in [pool.submit(call, g) for g in range(len(groups))]:
            future.result()

    def close() -> None:
        pool.shutdown()
        slots.close()
    return lambda: across(put), lambda: across(get), close


def store_paths(target: str, total: int, block: int, mover: bool, shared: bool = False, device: str = "cpu"
                ) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """(save, load, close) of total bytes in blocks through the engines' store
    client: bytes moved by a mover process (through the store's mapping of
    the arena when shared), or in this process. device=cuda: each group's
    blocks are first copied from the GPU into the pinned arena (a save) or
    from it to the GPU after the get (a load), as the connector does."""
    from tandem.services.kvstore.block_client import BlockStoreClient
    from tandem.services.kvstore.mover import MovedBlockStoreClient

    if mover:
        client = MovedBlockStoreClient(target, timeout_s=120.0, store_shared_memory=shared)
    else:
        client = BlockStoreClient(target, timeout_s=120.0)
    n = total // block
    arena = client.open_arena(n * block)
    arena[:] = os.urandom(len(arena))
    items = [(f"bench-{i}", i * block, block) for i in range(n)]
    if device == "cuda":
        return _store_paths_on_gpu(client, arena, items, total, block)
    # As the connector does: one call per step's blocks, with a few in flight
    # (save and prefetches), from threads that live as long as the client.
    groups = [items[i::4] for i in range(4)]
    pool = ThreadPoolExecutor(max_workers=len(groups))

    def across(call) -> None:
        for future in [pool.submit(call, g) for g in groups]:
            future.result()  # re-raises a failure on the measuring thread

    def close() -> None:
        pool.shutdown()
        client.close()

    def put(group) -> None:
        if client.put(group) != len(group):
            raise RuntimeError("the store did not store every block (capacity?)")

    def get(group) -> None:
        if not all(client.get(group)):
            raise RuntimeError("the store lost blocks between save and load")
    return lambda: across(put), lambda: across(get), close


def _store_paths_on_gpu(client, arena, items, total: int, block: int):
    import torch

    if not _cuda_pin(arena):
        raise RuntimeError("cannot pin the staging arena")
    source = _on_gpu(total, block)
    back = torch.empty_like(source)
    staged = torch.frombuffer(arena, dtype=torch.uint8).view(len(items), block)
    groups = [list(range(i, len(items), 4)) for i in range(4)]
    streams = [torch.cuda.Stream() for _ in groups]
    pool = ThreadPoolExecutor(max_workers=len(groups))

    # A group's copies in one torch call, as the connector queues a step's: a
    # copy per block would let the GIL go (and wait for it back) once per block.
    def put(g: int) -> None:
        with torch.cuda.stream(streams[g]):
            torch._foreach_copy_([staged[i] for i in groups[g]], [source[i] for i in groups[g]], non_blocking=True)
        streams[g].synchronize()
        if client.put([items[i] for i in groups[g]]) != len(groups[g]):
            raise RuntimeError("the store did not store every block (capacity?)")

    def get(g: int) -> None:
        if not all(client.get([items[i] for i in groups[g]])):
            raise RuntimeError("the store lost blocks between save and load")
        with torch.cuda.stream(streams[g]):
            torch._foreach_copy_([back[i] for i in groups[g]], [staged[i] for i in groups[g]], non_blocking=True)
        streams[g].synchronize()

    def across(call) -> None:
        for future in [pool.submit(call, g) for g in range(len(groups))]:
            future.result()

    def close() -> None:
        pool.shutdown()
        _cuda_unpin(arena)  # before the arena goes (a registration left behind refuses the next, CUDA error 712)
        client.close()
    return lambda: across(put), lambda: across(get), close


def run(args: argparse.Namespace) -> int:
    from tandem.services.kvstore.mover import ENGINE_SWITCH_INTERVAL_S

    busy_cpu = None
    if args.isolate_busy_thread:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(cpus) < 2:
            print("error: --isolate-busy-thread needs Linux and at least 2 CPUs this process may use",
                  file=sys.stderr)
            return 2
        busy_cpu = cpus[0]
        # Before any thread or process starts: each inherits this thread's CPUs.
        os.sched_setaffinity(0, set(cpus[1:]))
        print(f"busy thread on CPU {busy_cpu}, the rest on CPUs {cpus[1:]}", file=sys.stderr)
    interval_s = ENGINE_SWITCH_INTERVAL_S if args.switch_interval_ms is None else args.switch_interval_ms / 1e3
    sys.setswitchinterval(interval_s)  # as in an engine process
    print(f"GIL switch interval {interval_s * 1e3:g} ms", file=sys.stderr)
    total = args.size_mib << 20
    block = args.block_kib << 10
    busy_levels = [float(b) for b in args.busy.split(",")]
    rows: list[dict] = []

    def measure(path: str, what: str, fn: Callable[[], None]) -> None:
        # Unmeasured runs first: a fresh store's first values cost a page fault
        # per 4 KiB, and a new mapping of an arena one per page; a serving
        # store is past both. Then the load levels take turns, one measurement
        # each a round: a host whose speed drifts moves every level alike, and
        # the ratio of busy to idle holds (measured level after level, it did not).
        for _ in range(args.warmup):
            fn()
        rates: dict[float, list[float]] = {busy: [] for busy in busy_levels}
        for _ in range(args.repeats):
            for busy in busy_levels:
                with busy_thread(busy, busy_cpu):
                    rates[busy].append(rate_of(fn, total))
        for busy in busy_levels:
            rate = statistics.median(rates[busy])
            rows.append({"path": path, "what": what, "busy": busy, "GBps": rate})
            print(f"{path:<36}{what:<6} busy {busy:<4} {rate:6.2f} GB/s", file=sys.stderr, flush=True)

    with tcp_ceiling(total) as receive:
        measure("tcp loopback", "recv", receive)
    measure("memcpy", "copy", memcpy(total))
    if args.device == "cuda":
        if "memory" in args.backends:
            with store_process("memory", 4 * total) as target:
                for path, paths in (("store memory (lent slots)", lambda: lent_paths(target, total, block, "cuda")),
                                    ("store memory (shared memory)",
                                     lambda: store_paths(target, total, block, True, True, "cuda"))):
                    save, load, close = paths()
                    try:
                        measure(path + " gpu", "save", save)
                        measure(path + " gpu", "load", load)
                    finally:
                        close()
        return _report(rows, args, total, block, interval_s)
    with nixl_read(total) as read:
        if read is None:
            print("nixl: NIXL is not installed; skipped", file=sys.stderr)
        else:
            measure("nixl (UCX)", "read", read)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    with redis_process() as redis_url:
        for backend in backends:
            spec = "memory" if backend == "memory" else redis_url
            if spec is None:
                print("redis: redis-server is not installed; skipped", file=sys.stderr)
                continue
            variants = (("lent slots", True, False, False), ("shared memory", True, True, True),
                        ("", True, True, False), ("in-process", True, False, False), ("grpc", False, False, False))
            for name, data_channel, mover, shared in variants:
                if name == "lent slots" and backend != "memory":
                    continue  # only the memory backend's values live in the store's own memory
                path = f"store {backend}" + (f" ({name})" if name else "")
                with store_process(spec, 4 * total, data_channel) as target:
                    if name == "lent slots":
                        save, load, close = lent_paths(target, total, block)
                    else:
                        save, load, close = store_paths(target, total, block, mover, shared)
                    try:
                        measure(path, "save", save)
                        measure(path, "load", load)
                    finally:
                        close()
    return _report(rows, args, total, block, interval_s)


def _report(rows: list[dict], args: argparse.Namespace, total: int, block: int, interval_s: float) -> int:
    ceiling = {r["busy"]: r["GBps"] for r in rows if r["path"] == "tcp loopback"}
    idle = {(r["path"], r["what"]): r["GBps"] for r in rows if r["busy"] == 0}
    copying = idle.get(("memcpy", "copy"), float("nan"))
    print(f"\n{'path':<36}{'what':<6}{'busy':>5}{'GB/s':>8}{'/tcp':>7}{'/memcpy':>8}{'/idle':>7}")
    for r in rows:
        r["of_tcp"] = r["GBps"] / ceiling.get(0.0, float("nan"))
        r["of_memcpy"] = r["GBps"] / copying
        r["of_idle"] = r["GBps"] / idle.get((r["path"], r["what"]), float("nan"))
        print(f"{r['path']:<36}{r['what']:<6}{r['busy']:>5}{r['GBps']:>8.2f}{r['of_tcp']:>7.2f}"
              f"{r['of_memcpy']:>8.2f}{r['of_idle']:>7.2f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"size_bytes": total, "block_bytes": block, "switch_interval_s": interval_s,
                       "busy_thread_isolated": args.isolate_busy_thread, "rows": rows}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.bench.kv ...`: the same as `tandem bench kv ...`."""
    parser = argparse.ArgumentParser(prog="tandem bench")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["kv", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
