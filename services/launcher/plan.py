"""The plan of `tandem up`: each child's command line, with every port fixed
here, and the engine settings handed to every engine as flags."""
from __future__ import annotations

import argparse
import os
import random
import socket
import sys
from dataclasses import replace
from typing import Optional

from tandem.engine.config import EngineArgs
from tandem.engine.flags import flag_specs
from tandem.services.common.grpc_server import why_unbindable
from tandem.services.launcher.children import Child

# Engine settings `tandem up` decides itself: the store is its own child.
LAUNCHER_DECIDES = ("kv_store",)
# Its own --kv-transfer takes store or direct; `none` would leave the prefill tier useless.
UP_KV_TRANSFERS = ("store", "direct", "nixl")

# The env twins of the engine settings. Engines do not inherit them from the
# launcher's environment: the launcher read them already and passes every
# setting that is not a default as a flag, so a twin cannot contradict a flag
# given to `tandem up`.
ENGINE_ENV_TWINS = frozenset(spec.env for spec in flag_specs(EngineArgs))


def _ephemeral_ports_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152  # IANA's dynamic range, what BSD and macOS use


def free_port_below_ephemeral(host: str, taken: set[int]) -> int:
    """A port free on `host` now that no other child got, for a child to keep
    across restarts. Drawn below the kernel's ephemeral range: a port in it may
    become the local end of any outgoing connection while its child is down,
    and the child could not come back."""
    high = _ephemeral_ports_start()
    low = max(1024, high - 10000)
    for _ in range(100 if high - low >= 1000 else 0):
        port = random.randrange(low, high)
        if port not in taken and why_unbindable(host, port) is None:
            taken.add(port)
            return port
    # No room below the range, or it is full: the kernel's choice.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host.strip("[]"), 0), family=family) as s:
        port = s.getsockname()[1]
    taken.add(port)
    return port


def plan_stack(args: argparse.Namespace, log_dir: str) -> tuple[Child, list[Child], list[Child], list[str]]:
    """The children's command lines, and the router's flags but its instance
    lists (it needs the others' addresses). Every port is fixed here, none
    left to the child (port 0): a restarted child must come back on the
    address the others were given."""
    py = [sys.executable, "-m"]
    host = args.host
    taken = {p for p in (args.port, args.grpc_port, args.kvstore_port) if p > 0}

    def port(flag_value: int = 0) -> int:
        return flag_value if flag_value > 0 else free_port_below_ephemeral(host, taken)

    def child(role: str, index: Optional[int], extra: list[str], grpc_port: int = 0) -> Child:
        name = role if index is None else f"{role}-{index}"
        metrics_port, listen_port = port(), port(grpc_port)
        # The address is known before the child listens: the router is given it at once.
        return Child(name=name, role=role, log_path=os.path.join(log_dir, f"{name}.log"),
                     metrics_port=metrics_port, address=f"{host}:{listen_port}",
                     argv=[*py, f"tandem.services.{role}.server", "--host", host,
                           "--port", str(listen_port), "--metrics-port", str(metrics_port), *extra])

    tls_flags: list[str] = []
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(args, flag, None):
            tls_flags += ["--" + flag.replace("_", "-"), os.path.abspath(getattr(args, flag))]
    kvstore_port = port(args.kvstore_port)
    # Its data channel's port is fixed too: engines find it in the store's Stats,
    # and a restarted store must not move it under their open connections.
    kvstore = child("kvstore", None, ["--backend", args.store, "--data-port", str(port()), *tls_flags],
                    kvstore_port)
    roles = role_engine_args(args, f"{host}:{kvstore_port}")
    engine_flags = {role: [*role_args.to_cli_args(), "--max-queued-requests", str(args.max_queued_requests),
                           *tls_flags] for role, role_args in roles.items()}
    prefills = [child("prefill", i, engine_flags["prefill"]) for i in range(args.prefill)]
    decodes = [child("decode", i, engine_flags["decode"]) for i in range(args.decode)]
    gpus = gpu_ids(args.gpus)
    engines = prefills + decodes
    sizes = [roles[e.role].tensor_parallel_size for e in engines]
    for engine, visible in zip(engines, gpu_slices(gpus, sizes) if gpus else [None] * len(engines)):
        engine.env_unset = ENGINE_ENV_TWINS
        if visible is not None:
            engine.env["CUDA_VISIBLE_DEVICES"] = visible
    grpc_port = port(args.grpc_port) if args.grpc_port >= 0 else -1  # -1: off
    # The router learns the context length and block size from the engines.
    router_flags = ["--port", str(port(args.port)), "--grpc-port", str(grpc_port),
                    "--model", args.model, "--routing", args.routing,
                    "--prefill-threshold", str(args.prefill_threshold),
                    "--max-in-flight", str(args.max_in_flight), *tls_flags]
    if args.tokenizer:
        router_flags += ["--tokenizer", args.tokenizer]
    for flag, value in (("--revision", args.revision), ("--download-dir", args.download_dir)):
        if value:
            router_flags += [flag, value]
    if getattr(args, "served_model_name", None):
        router_flags += ["--served-model-name", *args.served_model_name]
    return kvstore, prefills, decodes, router_flags


def gpu_ids(flag: str) -> list[str]:
    """--gpus "0, 1,2" as ["0", "1", "2"]; empty: none given."""
    return [g.strip() for g in flag.split(",") if g.strip()]


def gpu_slices(gpus: list[str], sizes: list[int]) -> list[str]:
    """Each engine's CUDA_VISIBLE_DEVICES: the next `size` GPUs of the list
    (its tensor-parallel ranks, one GPU each), going round the list again
    when it runs out (engines then share GPUs)."""
    slices, cursor = [], 0
    for size in sizes:
        if size > len(gpus):
            raise ValueError(f"--gpus lists {len(gpus)} GPU(s) and an engine of --tensor-parallel-size "
                             f"{size} needs {size}, one per rank: list more, or lower the size")
        slices.append(",".join(gpus[(cursor + k) % len(gpus)] for k in range(size)))
        cursor += size
    return slices


def engine_args(args: argparse.Namespace, kvstore_address: str) -> EngineArgs:
    """The settings of every engine: `tandem up`'s engine flags as given, and
    the KV store it starts (with --kv-transfer store)."""
    store = kvstore_address if args.kv_transfer == "store" else None
    return EngineArgs.from_cli_args(args, kv_store=store)


# Engine settings `tandem up` also takes per role, as --prefill-X and --decode-X.
ROLE_SETTINGS = ("tensor_parallel_size",)


def role_engine_args(args: argparse.Namespace, kvstore_address: str) -> dict[str, EngineArgs]:
    """The settings of the prefill and of the decode engines: engine_args, with
    a role's own --prefill-X / --decode-X where given."""
    every = engine_args(args, kvstore_address)
    roles = {}
    for role in ("prefill", "decode"):
        own = {name: getattr(args, f"{role}_{name}") for name in ROLE_SETTINGS
               if getattr(args, f"{role}_{name}", None) is not None}
        roles[role] = replace(every, **own)
    return roles
