"""`tandem up`: the whole stack on one machine.

It starts the KV store (unless --kv-transfer direct or nixl), N prefill and M
decode instances and the router as child processes on loopback, all at once,
waits until each has printed its `ROLE listening on HOST:PORT` line and the
router counts every engine healthy, then supervises them
(supervisor.py). SIGINT/SIGTERM stops all children (terminate, wait, kill
after a deadline). A child that fails at the first start brings the stack
down with the tail of its log.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time

from tandem.engine.config import DEFAULT_MODEL, ConfigError, EngineArgs
from tandem.services.common.config import add_flag, config_error
from tandem.services.common.grpc_server import add_tls_arguments, why_unbindable
from tandem.services.launcher.children import (Child, exit_text, log_tail, start_child, stop_children,
                                               wait_listening)
from tandem.services.launcher.plan import (LAUNCHER_DECIDES, UP_KV_TRANSFERS, gpu_ids, gpu_slices,
                                           plan_stack, role_engine_args)
from tandem.services.launcher.supervisor import (RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S, START_TRIES,
                                                 supervise)


def _print_banner(router: Child, grpc_address: str, args: argparse.Namespace, model_id: str,
                  children: list[Child], log_dir: str) -> None:
    base = f"http://{router.address}/v1"
    auth = ' -H "Authorization: Bearer $TANDEM_API_KEY"' if args.api_key else ""  # the shell expands it
    print(f"""
tandem is up: {model_id}
  OpenAI base URL  {base}
                   (python: openai.OpenAI(base_url="{base}", api_key="{'<your key>' if args.api_key else 'none'}"))
  try it           curl {base}/chat/completions -H 'Content-Type: application/json'{auth} \\
                     -d '{{"model": "{model_id}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
  gRPC API         {grpc_address} (tandem.v1.TandemService, reflection on)
  metrics          http://{router.address}/metrics (router); """
          + ", ".join(f"{c.name} :{c.metrics_port}" for c in children if c.role != "router")
          + f"\n  logs             {log_dir}\nCtrl+C stops the stack.", flush=True)


def _router_model_id(address: str) -> str:
    import httpx

    try:
        return httpx.get(f"http://{address}/v1/models", timeout=5).json()["data"][0]["id"]
    except Exception:
        return DEFAULT_MODEL


def wait_router_sees_every_engine(router: Child, timeout_s: float) -> None:
    """Until the router's /health counts every engine healthy: the stack is up
    when a request goes through prefill and decode, not only when each process
    listens (the router checks its engines once a --health-interval)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    counts: dict = {}
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            raise RuntimeError(f"router {exit_text(router.process.returncode)} while starting; last "
                               f"lines of {router.log_path}:\n{log_tail(router)}")
        try:
            counts = httpx.get(f"http://{router.address}/health", timeout=5).json()["instances"]
            if all(c["healthy"] == c["total"] for c in counts.values()):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the router did not see every engine healthy within {timeout_s:.0f}s "
                       f"({counts}); see the logs in {os.path.dirname(router.log_path)}")


def cmd_up(args: argparse.Namespace) -> int:
    def progress(msg: str) -> None:
        print(f"[tandem up] {msg}", file=sys.stderr, flush=True)

    if args.prefill < 0 or args.decode < 1:
        print("error: --decode needs at least 1 instance and --prefill at least 0", file=sys.stderr)
        return 2
    _check_before_start(args)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="tandem-up-")
    os.makedirs(log_dir, exist_ok=True)
    stopping = {"signal": None, "supervising": False}

    def on_signal(signum, _frame):
        stopping["signal"] = signal.Signals(signum).name
        if not stopping["supervising"]:
            raise KeyboardInterrupt  # still starting: unwind, the finally below stops what runs

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    kvstore, prefills, decodes, router_flags = plan_stack(args, log_dir)
    router = Child(
        name="router", role="router", log_path=os.path.join(log_dir, "router.log"),
        argv=[sys.executable, "-m", "tandem.services.router.server", "--host", args.host,
              "--prefill", ",".join(c.address for c in prefills),
              "--decode", ",".join(c.address for c in decodes), *router_flags])
    if args.api_key:
        # Through the environment, not argv: keys must not show up in `ps`.
        os.environ["TANDEM_API_KEY"] = ",".join(args.api_key)
    # Every child at once: every port is fixed in advance, engines reach the
    # store when they first need it and the router waits for its engines, so
    # none has to wait for another to listen. Started one after the other, the
    # router's and the store's seconds of start-up came on top of the engines'.
    children = ([kvstore] if args.kv_transfer == "store" else []) + prefills + decodes + [router]
    try:
        if args.kv_transfer == "store":
            progress(f"starting kvstore ({args.store}); logs in {log_dir}")
        else:
            progress(f"{args.kv_transfer} KV transfer between prefill and decode, no KV store; logs in {log_dir}")
        progress(f"starting {len(prefills)} prefill and {len(decodes)} decode instance(s) and the router "
                 "(loading the model takes a while)")
        for c in children:
            start_child(c)
        wait_listening(children, args.startup_timeout, progress)
        wait_router_sees_every_engine(router, args.startup_timeout)
        grpc_address = _grpc_address(router)

        def save_state() -> None:
            if args.state_file:
                with open(args.state_file + ".tmp", "w") as f:
                    json.dump({"children": [c.describe() for c in children], "log_dir": log_dir,
                               "grpc_address": grpc_address, "http_address": router.address}, f)
                os.replace(args.state_file + ".tmp", args.state_file)

        save_state()
        _print_banner(router, grpc_address, args, _router_model_id(router.address), children, log_dir)
        stopping["supervising"] = True
        return supervise(children, args, stopping, progress, save_state)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        progress("stopping the stack")
        stop_children(children)


def _grpc_address(router: Child) -> str:
    with open(router.log_path, "r", errors="replace") as f:
        for line in f:
            m = re.match(r"^router grpc listening on (\S+)\s*$", line.strip())
            if m:
                return m.group(1)
    return "(off)"


def _check_before_start(args: argparse.Namespace) -> None:
    """Stop at once (`error: ...`, status 2) over what would make the stack
    fail for certain, minutes of model loading later: an empty API key, a
    taken fixed port, a bad engine setting, a model that is not there."""
    from tandem.engine.hub import HubSource
    from tandem.engine.loader import ModelNotFoundError, resolve_source
    from tandem.services.router.server import api_keys_from_flag, served_names_from_flag

    api_keys_from_flag(args.api_key)
    served_names_from_flag(args.served_model_name)
    if not args.restart_backoff > 0:  # 0 would restart a crashing child in a tight loop
        config_error(f"--restart-backoff: must be above 0, got {args.restart_backoff:g}")
    fixed = [("--port", args.port), ("--grpc-port", args.grpc_port)]
    if args.kv_transfer == "store":
        fixed.append(("--kvstore-port", args.kvstore_port))
    for flag, port in fixed:
        problem = why_unbindable(args.host, port, flag) if port > 0 else None
        if problem:
            config_error(f"cannot listen on {args.host}:{port}: {problem}")
    try:
        # Each role's settings, as plan_stack hands them out (the store's address aside).
        roles = role_engine_args(args, "127.0.0.1:0")
        for role_args in roles.values():
            role_args.create_engine_config()
    except ConfigError as exc:
        config_error(str(exc))
    gpus = gpu_ids(args.gpus)
    if gpus:
        try:
            gpu_slices(gpus, [roles[role].tensor_parallel_size for role in ("prefill", "decode")])
        except ValueError as exc:
            config_error(str(exc))
    try:
        # A Hub id is downloaded here, once, before the engines start and find it in the cache.
        resolve_source(args.model, args.load_format, HubSource(args.revision, args.download_dir))
    except ModelNotFoundError as exc:
        config_error(f"--model: {exc}")


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    """`tandem up`'s own flags, then the engine flags (EngineArgs) it hands to
    every prefill and decode engine as they are."""
    from tandem.services.router.policies import POLICIES

    add_flag(p, "--host", default="127.0.0.1", help="address every process binds")
    add_flag(p, "--port", type=int, default=8000,
             help="HTTP port of the OpenAI-compatible gateway; 0 picks a free one")
    add_flag(p, "--grpc-port", type=int, default=50051,
             help="port of the public gRPC API; 0 picks a free one, -1 turns it off")
    add_flag(p, "--kv-transfer", default="store", choices=UP_KV_TRANSFERS,
             help="how KV moves from prefill to decode, passed to every engine as --kv-transfer: "
                  "store (through the KV store service this command starts, which is also a prefix "
                  "cache shared by every engine), direct (decode copies from the prefill's shared "
                  "memory / CUDA IPC; no store; one host only) or nixl (decode reads from the "
                  "prefill's cache peer to peer through NIXL, as across hosts; no store)")
    add_flag(p, "--kvstore-port", type=int, default=0,
             help="KV store port; 0 picks a free one (kept across restarts, as every child's port)")
    add_flag(p, "--prefill", type=int, default=1, help="number of prefill instances (0: decode prefills)")
    add_flag(p, "--decode", type=int, default=1, help="number of decode instances")
    for role in ("prefill", "decode"):
        add_flag(p, f"--{role}-tensor-parallel-size", type=int, default=None, metavar="N",
                 help=f"--tensor-parallel-size of the {role} engines alone (KV moves whole blocks "
                      "through the store, so the two roles may differ); unset: --tensor-parallel-size")
    add_flag(p, "--store", default="memory",
             help="KV store backend: memory, or a Redis URL such as redis://127.0.0.1:6379/0")
    add_flag(p, "--gpus", default="",
             help="GPU ids handed to the engines round robin, prefills first, e.g. 0,1,2,3 "
                  "(each engine sees as many as its --tensor-parallel-size, one per rank); unset: "
                  "every engine sees all GPUs")
    add_flag(p, "--routing", default="least_loaded", choices=list(POLICIES), help="router's policy")
    add_flag(p, "--prefill-threshold", type=int, default=32,
             help="prompts shorter than this skip the prefill tier")
    add_flag(p, "--api-key", default=None, nargs="*",
             help="API keys the gateway requires (several allowed; env: comma-separated); unset: no "
                  "authentication; an empty key is an error")
    add_flag(p, "--max-in-flight", type=int, default=1024,
             help="requests the router serves at once; more get HTTP 429 / RESOURCE_EXHAUSTED")
    add_flag(p, "--served-model-name", default=None, nargs="+", metavar="NAME",
             help="the router's names for the model (as vllm serve's flag): requests may give any, "
                  "/v1/models lists each, answers report the first; unset: the engines' model id")
    add_flag(p, "--max-queued-requests", type=int, default=512,
             help="requests each engine queues beyond --max-num-seqs; more are refused (back-pressure)")
    add_tls_arguments(p)
    add_flag(p, "--startup-timeout", type=float, default=300.0, help="seconds each tier may take to start")
    add_flag(p, "--log-dir", default=None, help="where each process writes its log; unset: a temp folder")
    add_flag(p, "--state-file", default=None,
             help="write the processes' pids, addresses and command lines here as JSON once up, and "
                  "again at each restart (the new pid) (for tests)")
    add_flag(p, "--no-restart", type=bool, default=False,
             help="leave a child that exits dead and stop the stack (unless --keep-going); by "
                  "default it is restarted on its own port after --restart-backoff seconds, doubling "
                  f"per restart in a row up to {RESTART_BACKOFF_MAX_S:g} s, and a child that exits "
                  f"{START_TRIES} times in a row before listening stops the stack")
    add_flag(p, "--restart-backoff", type=float, default=RESTART_BACKOFF_S, metavar="SECONDS",
             help="wait before a child's first restart in a row; each next one waits twice as long, "
                  f"up to {RESTART_BACKOFF_MAX_S:g} s")
    add_flag(p, "--keep-going", type=bool, default=False,
             help="when a child is not restarted (--no-restart, or it cannot start): keep serving "
                  "without it instead of stopping the stack (fault tests)")
    # --model, --tokenizer, --revision and --download-dir reach the router too.
    EngineArgs.add_cli_args(p, skip=("kv_transfer", *LAUNCHER_DECIDES))
