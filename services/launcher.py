"""`tandem up` (the whole stack on one machine) and `tandem serve ROLE` (one
role in the foreground, what a container runs).

`tandem up` starts the KV store (unless --kv-transfer direct), N prefill and
M decode instances and the router as child processes on loopback, each waited for until it prints its
`ROLE listening on HOST:PORT` line, then supervises them: SIGINT/SIGTERM
stops all children (terminate, wait, kill after a deadline), and a child that
dies brings the stack down with the tail of its log (unless --keep-going).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import NoReturn, Optional

from tandem.services.common.config import add_flag
from tandem.services.common.grpc_server import add_tls_arguments, exit_after_shutdown

ROLES = ("router", "prefill", "decode", "kvstore")
LISTENING = re.compile(r"^(\w+) listening on (\S+):(\d+)\s*$")
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


# --- tandem serve ROLE -------------------------------------------------------------

def _role_module(role: str):
    return importlib.import_module(f"tandem.services.{role}.server")


def _serve_role(args: argparse.Namespace) -> NoReturn:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code = int(_role_module(args.role).serve(args) or 0)
    # The role has shut down gracefully; a container's process must now end.
    exit_after_shutdown(code)


# --- tandem up ---------------------------------------------------------------------

@dataclass
class Child:
    """One process of the stack. `argv` restarts it exactly (tests do that)."""

    name: str  # e.g. prefill-0
    role: str
    argv: list[str]
    log_path: str
    metrics_port: Optional[int] = None
    address: Optional[str] = None  # host:port, known once it listens
    pid: Optional[int] = None
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    process: Optional[subprocess.Popen] = field(default=None, repr=False)

    def describe(self) -> dict:
        return {name: getattr(self, name) for name in
                ("name", "role", "argv", "env", "log_path", "metrics_port", "address", "pid")}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Children get SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the launcher's own cleanup still runs
        pass


def start_child(child: Child) -> None:
    log = open(child.log_path, "wb")  # a reused --log-dir must not show stale listening lines
    env = dict(os.environ, PYTHONUNBUFFERED="1", **child.env)
    child.process = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent)
    child.pid = child.process.pid
    log.close()


def log_tail(child: Child, lines: int = 30) -> str:
    try:
        with open(child.log_path, "r", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def wait_listening(children: list[Child], timeout_s: float, progress=None) -> None:
    """Block until every child printed its listening line; raise if one exits or
    the deadline passes."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            with open(child.log_path, "r", errors="replace") as f:
                for line in f:
                    m = LISTENING.match(line.strip())
                    if m and m.group(1) == child.role:
                        child.address = f"{m.group(2)}:{m.group(3)}"
            if child.address:
                pending.remove(child)
                if progress:
                    progress(f"{child.name} listening on {child.address}")
            elif child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.process.returncode} while "
                                   f"starting; last lines of {child.log_path}:\n{log_tail(child)}")
        if pending and time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending)
            raise RuntimeError(f"{names} did not start within {timeout_s:.0f}s; see their logs in "
                               f"{os.path.dirname(pending[0].log_path)}")
        time.sleep(0.1)


def stop_children(children: list[Child], grace_s: float = 10.0) -> None:
    """Terminate in reverse start order (router first, store last), then kill
    what is still running after grace_s."""
    for child in reversed(children):
        if child.process and child.process.poll() is None:
            child.process.terminate()
    deadline = time.monotonic() + grace_s
    for child in reversed(children):
        if child.process is None:
            continue
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def plan_stack(args: argparse.Namespace, log_dir: str) -> tuple[Child, list[Child], list[Child], list[str]]:
    """The children's command lines, except the router's (it needs the others' addresses)."""
    py = [sys.executable, "-m"]
    host = args.host

    def child(role: str, index: Optional[int], extra: list[str]) -> Child:
        name = role if index is None else f"{role}-{index}"
        metrics_port = _free_port()
        return Child(name=name, role=role, log_path=os.path.join(log_dir, f"{name}.log"),
                     metrics_port=metrics_port,
                     argv=[*py, f"tandem.services.{role}.server", "--host", host,
                           "--metrics-port", str(metrics_port), *extra])

    tls_flags: list[str] = []
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(args, flag, None):
            tls_flags += ["--" + flag.replace("_", "-"), os.path.abspath(getattr(args, flag))]
    kvstore = child("kvstore", None, ["--port", str(args.kvstore_port), "--backend", args.store,
                                      *tls_flags])
    engine_flags = ["--model", args.model, "--block-size", str(args.block_size),
                    "--policy", args.policy]
    if args.tokenizer:
        engine_flags += ["--tokenizer", args.tokenizer]
    if args.num_blocks:
        engine_flags += ["--num-blocks", str(args.num_blocks)]
    if args.max_model_len:
        engine_flags += ["--max-model-len", str(args.max_model_len)]
    engine_flags += ["--max-num-seqs", str(args.max_num_seqs),
                     "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                     "--device", args.device, "--dtype", args.dtype, "--load-format", args.load_format,
                     "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.enforce_eager:
        engine_flags.append("--enforce-eager")
    engine_flags += ["--max-queued-requests", str(args.max_queued_requests), *tls_flags]
    prefills = [child("prefill", i, ["--port", "0", *engine_flags]) for i in range(args.prefill)]
    decodes = [child("decode", i, ["--port", "0", *engine_flags]) for i in range(args.decode)]
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    for i, engine in enumerate(prefills + decodes):
        if gpus:
            engine.env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
    router_flags = ["--model", args.model, "--routing", args.routing,
                    "--prefill-threshold", str(args.prefill_threshold),
                    "--max-in-flight", str(args.max_in_flight), *tls_flags]
    if args.max_model_len:
        router_flags += ["--max-model-len", str(args.max_model_len)]
    if args.tokenizer:
        router_flags += ["--tokenizer", args.tokenizer]
    return kvstore, prefills, decodes, router_flags


def _print_banner(router: Child, grpc_address: str, args: argparse.Namespace, model_id: str,
                  children: list[Child], log_dir: str) -> None:
    base = f"http://{router.address}/v1"
    auth = " -H 'Authorization: Bearer $TANDEM_API_KEY'" if args.api_key else ""
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


def cmd_up(args: argparse.Namespace) -> int:
    def progress(msg: str) -> None:
        print(f"[tandem up] {msg}", file=sys.stderr, flush=True)

    if args.prefill < 0 or args.decode < 1:
        print("error: --decode needs at least 1 instance and --prefill at least 0", file=sys.stderr)
        return 2
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
    children: list[Child] = []
    try:
        if args.kv_transfer == "store":
            progress(f"starting kvstore ({args.store}); logs in {log_dir}")
            children.append(kvstore)
            start_child(kvstore)
            wait_listening([kvstore], args.startup_timeout, progress)
        else:
            progress(f"direct KV transfer between prefill and decode, no KV store; logs in {log_dir}")
        for c in prefills + decodes:
            if args.kv_transfer == "store":
                c.argv += ["--kvstore", kvstore.address]
            else:
                c.argv += ["--kv-direct"]
            children.append(c)
            start_child(c)
        progress(f"starting {len(prefills)} prefill and {len(decodes)} decode instance(s) "
                 "(loading the model takes a while)")
        wait_listening(prefills + decodes, args.startup_timeout, progress)
        router = Child(
            name="router", role="router", log_path=os.path.join(log_dir, "router.log"),
            argv=[sys.executable, "-m", "tandem.services.router.server", "--host", args.host,
                  "--port", str(args.port), "--grpc-port", str(args.grpc_port),
                  "--prefill", ",".join(c.address for c in prefills),
                  "--decode", ",".join(c.address for c in decodes), *router_flags])
        if args.api_key:
            # Through the environment, not argv: keys must not show up in `ps`.
            os.environ["TANDEM_API_KEY"] = ",".join(args.api_key)
        children.append(router)
        start_child(router)
        wait_listening([router], args.startup_timeout, progress)
        grpc_address = _grpc_address(router)
        if args.state_file:
            with open(args.state_file + ".tmp", "w") as f:
                json.dump({"children": [c.describe() for c in children], "log_dir": log_dir,
                           "grpc_address": grpc_address, "http_address": router.address}, f)
            os.replace(args.state_file + ".tmp", args.state_file)
        _print_banner(router, grpc_address, args, _router_model_id(router.address), children, log_dir)
        stopping["supervising"] = True
        return _supervise(children, args, stopping, progress)
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


def _supervise(children: list[Child], args: argparse.Namespace, stopping: dict, progress) -> int:
    reported: set[str] = set()
    while stopping["signal"] is None:
        for child in children:
            code = child.process.poll()
            if code is None or child.name in reported:
                continue
            reported.add(child.name)
            message = (f"{child.name} (pid {child.pid}) exited with code {code}; last lines of "
                       f"{child.log_path}:\n{log_tail(child)}")
            if not args.keep_going:
                print(f"error: {message}\nstopping the whole stack.", file=sys.stderr, flush=True)
                return 1
            progress(f"warning: {child.name} (pid {child.pid}) exited with code {code}; "
                     "--keep-going: the rest keeps serving")
        time.sleep(0.2)
    progress(f"{stopping['signal']} received")
    return 0


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.services.router.policies import POLICIES

    add_flag(p, "--host", default="127.0.0.1", help="address every process binds")
    add_flag(p, "--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible gateway")
    add_flag(p, "--grpc-port", type=int, default=50051, help="port of the public gRPC API; 0 picks a free one")
    add_flag(p, "--kv-transfer", default="store", choices=["store", "direct"],
             help="how KV moves from prefill to decode: store (through the KV store service, which "
                  "is also a prefix cache shared by every engine) or direct (decode copies from the "
                  "prefill's shared memory / CUDA IPC; no store; one host only)")
    add_flag(p, "--kvstore-port", type=int, default=0, help="KV store port; 0 picks a free one")
    add_flag(p, "--prefill", type=int, default=1, help="number of prefill instances (0: decode prefills)")
    add_flag(p, "--decode", type=int, default=1, help="number of decode instances")
    add_flag(p, "--store", default="memory",
             help="KV store backend: memory, or a Redis URL such as redis://127.0.0.1:6379/0")
    add_flag(p, "--model", default=DEFAULT_MODEL, help="model id, HF folder or .gguf file; the default is the embedded SmolLM2")
    add_flag(p, "--max-model-len", type=int, default=None, help="context length; unset: the model's own")
    add_flag(p, "--tokenizer", default=None,
             help="tokenizer for every engine and the router instead of the model's own: HF folder, "
                  ".gguf file or 'smollm2' (serves a dummy-weight config-only model folder)")
    add_flag(p, "--block-size", type=int, default=16, help="tokens per KV block")
    add_flag(p, "--num-blocks", type=int, default=None, help="KV blocks per engine; unset: sized from memory")
    add_flag(p, "--policy", default="fifo", choices=["fifo", "srtf"], help="engines' scheduling policy")
    add_flag(p, "--max-num-seqs", type=int, default=256, help="most requests one engine runs at once")
    add_flag(p, "--max-num-batched-tokens", type=int, default=8192, help="token budget of one engine step")
    add_flag(p, "--device", default="auto", choices=["auto", "cpu", "cuda"],
             help="where the engines run; auto: cuda when available")
    add_flag(p, "--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
             help="engines' dtype; auto: float32 on the CPU, bfloat16 on CUDA")
    add_flag(p, "--load-format", default="auto", choices=["auto", "dummy"],
             help="dummy: random weights from the model's config (benchmarks)")
    add_flag(p, "--gpu-memory-utilization", type=float, default=0.9,
             help="share of its GPU each engine may use; engines sharing a GPU need shares summing under 1")
    add_flag(p, "--gpus", default="",
             help="GPU ids handed to the engines round robin, prefills first, e.g. 0,1 "
                  "(each engine sees one GPU); unset: every engine sees all GPUs")
    add_flag(p, "--enforce-eager", type=bool, default=False, help="engines without CUDA graphs")
    add_flag(p, "--routing", default="least_loaded", choices=list(POLICIES), help="router's policy")
    add_flag(p, "--prefill-threshold", type=int, default=32,
             help="prompts shorter than this skip the prefill tier")
    add_flag(p, "--api-key", default=None, nargs="*", help="API keys the gateway requires")
    add_flag(p, "--max-in-flight", type=int, default=1024,
             help="requests the router serves at once; more get HTTP 429 / RESOURCE_EXHAUSTED")
    add_flag(p, "--max-queued-requests", type=int, default=512,
             help="requests each engine queues beyond --max-num-seqs; more are refused (back-pressure)")
    add_tls_arguments(p)
    add_flag(p, "--startup-timeout", type=float, default=300.0, help="seconds each tier may take to start")
    add_flag(p, "--log-dir", default=None, help="where each process writes its log; unset: a temp folder")
    add_flag(p, "--state-file", default=None,
             help="write the processes' pids, addresses and command lines here as JSON once up (for tests)")
    add_flag(p, "--keep-going", type=bool, default=False,
             help="keep serving when a child dies instead of stopping the stack (fault tests)")


def register(subparsers) -> None:
    up = subparsers.add_parser(
        "up", help="run the whole stack on this machine",
        description="Start kvstore, prefill, decode and the router on loopback and print where to "
                    "point a client. Ctrl+C (or SIGTERM) stops everything.")
    add_up_arguments(up)
    up.set_defaults(handler=cmd_up)

    serve = subparsers.add_parser(
        "serve", help="run one role in the foreground",
        description="Run one role (what a container runs). Every flag has a TANDEM_ env twin.")
    roles = serve.add_subparsers(dest="role", metavar="ROLE", required=True)
    for role in ROLES:
        try:
            module = _role_module(role)
        except ImportError as exc:  # a role whose module is missing must not break the CLI
            p = roles.add_parser(role, help=f"(unavailable: {exc})")
            p.set_defaults(handler=lambda args, e=exc: sys.exit(f"error: role unavailable: {e}"))
            continue
        p = roles.add_parser(role, help=(module.__doc__ or "").strip().splitlines()[0],
                             description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(handler=_serve_role)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m tandem.services.launcher up|serve ...`: the same commands as
    `tandem up|serve`, without loading the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
