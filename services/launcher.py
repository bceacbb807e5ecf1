"""`tandem up` (the whole stack on one machine) and `tandem serve ROLE` (one
role in the foreground, what a container runs).

`tandem up` starts the KV store (unless --kv-transfer direct), N prefill and
M decode instances and the router as child processes on loopback, each waited
for until it prints its `ROLE listening on HOST:PORT` line, then supervises
them: SIGINT/SIGTERM stops all children (terminate, wait, kill after a
deadline), and a child that exits is started again with its own command line,
as Kubernetes' restartPolicy Always does, after a back-off that doubles per
restart in a row. Every child listens on a port the launcher fixed, so a
restarted one comes back where the router and the engines expect it. A child
that fails at the first start, or exits before listening START_TRIES times in
a row, brings the stack down with the tail of its log (with --no-restart: any
child that exits does, unless --keep-going).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import NoReturn, Optional

from tandem.services.common.config import add_flag, config_error
from tandem.services.common.grpc_server import add_tls_arguments, exit_after_shutdown, why_unbindable

ROLES = ("router", "prefill", "decode", "kvstore")
LISTENING = re.compile(r"^(\w+) listening on (\S+):(\d+)\s*$")
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Restarts, shaped like Kubernetes' CrashLoopBackOff: the first waits
# RESTART_BACKOFF_S, each next one in a row twice as long up to
# RESTART_BACKOFF_MAX_S; a child up RESTART_RESET_S starts over at the first.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
RESTART_RESET_S = 60.0
# A child that exits this many times in a row before its listening line
# cannot start (bad flags, a taken port, a missing model): retrying forever
# would hide that, so the stack stops with its log.
START_TRIES = 5


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
    restarts: int = 0  # starts by the supervisor after the first
    listening: bool = False  # the current run has printed its listening line
    log_offset: int = 0  # where the current run's output begins in log_path

    def describe(self) -> dict:
        return {name: getattr(self, name) for name in
                ("name", "role", "argv", "env", "log_path", "metrics_port", "address", "pid",
                 "restarts")}


def _ephemeral_ports_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152  # IANA's dynamic range, what BSD and macOS use


def _free_port(host: str, taken: set[int]) -> int:
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


def _die_with_parent() -> None:
    """Children get SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the launcher's own cleanup still runs
        pass


def start_child(child: Child) -> None:
    """Start `child`, or start it again: a first start empties its log (a
    reused --log-dir must not show stale listening lines), a restart appends
    to it after a marker, so the crash that caused it stays readable."""
    if child.restarts == 0:
        log = open(child.log_path, "wb")
    else:
        log = open(child.log_path, "ab")
        log.write(f"\n--- tandem up: restart {child.restarts} ---\n".encode())
        log.flush()
    child.log_offset = log.tell()
    child.listening = False
    env = dict(os.environ, PYTHONUNBUFFERED="1", **child.env)
    child.process = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent)
    child.pid = child.process.pid
    log.close()


def _check_listening(child: Child) -> bool:
    """Whether the current run of `child` has printed its listening line
    (then its address is set)."""
    if not child.listening:
        with open(child.log_path, "rb") as f:
            f.seek(child.log_offset)
            for line in f:
                m = LISTENING.match(line.decode(errors="replace").strip())
                if m and m.group(1) == child.role:
                    child.address = f"{m.group(2)}:{m.group(3)}"
                    child.listening = True
                    break
    return child.listening


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exited with code {code}"


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
            if _check_listening(child):
                pending.remove(child)
                if progress:
                    progress(f"{child.name} listening on {child.address}")
            elif child.process.poll() is not None:
                raise RuntimeError(f"{child.name} {_exit_text(child.process.returncode)} while "
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
    """The children's command lines, and the router's flags but its instance
    lists (it needs the others' addresses). Every port is fixed here, none
    left to the child (port 0): a restarted child must come back on the
    address the others were given."""
    py = [sys.executable, "-m"]
    host = args.host
    taken = {p for p in (args.port, args.grpc_port, args.kvstore_port) if p > 0}

    def port(flag_value: int = 0) -> int:
        return flag_value if flag_value > 0 else _free_port(host, taken)

    def child(role: str, index: Optional[int], extra: list[str], grpc_port: int = 0) -> Child:
        name = role if index is None else f"{role}-{index}"
        metrics_port = port()
        return Child(name=name, role=role, log_path=os.path.join(log_dir, f"{name}.log"),
                     metrics_port=metrics_port,
                     argv=[*py, f"tandem.services.{role}.server", "--host", host,
                           "--port", str(port(grpc_port)), "--metrics-port", str(metrics_port), *extra])

    tls_flags: list[str] = []
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(args, flag, None):
            tls_flags += ["--" + flag.replace("_", "-"), os.path.abspath(getattr(args, flag))]
    kvstore = child("kvstore", None, ["--backend", args.store, *tls_flags], args.kvstore_port)
    engine_flags = ["--model", args.model, "--block-size", str(args.block_size),
                    "--policy", args.policy]
    if args.tokenizer:
        engine_flags += ["--tokenizer", args.tokenizer]
    if args.num_blocks:
        engine_flags += ["--num-blocks", str(args.num_blocks)]
    if args.max_model_len:
        engine_flags += ["--max-model-len", str(args.max_model_len)]
    if args.max_num_batched_tokens:
        engine_flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    engine_flags += ["--max-num-seqs", str(args.max_num_seqs),
                     "--device", args.device, "--dtype", args.dtype, "--load-format", args.load_format,
                     "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.enforce_eager:
        engine_flags.append("--enforce-eager")
    engine_flags += ["--max-queued-requests", str(args.max_queued_requests), *tls_flags]
    prefills = [child("prefill", i, engine_flags) for i in range(args.prefill)]
    decodes = [child("decode", i, engine_flags) for i in range(args.decode)]
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    for i, engine in enumerate(prefills + decodes):
        if gpus:
            engine.env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
    grpc_port = port(args.grpc_port) if args.grpc_port >= 0 else -1  # -1: off
    router_flags = ["--port", str(port(args.port)), "--grpc-port", str(grpc_port),
                    "--model", args.model, "--routing", args.routing,
                    "--prefill-threshold", str(args.prefill_threshold),
                    "--max-in-flight", str(args.max_in_flight), *tls_flags]
    if args.tokenizer:
        router_flags += ["--tokenizer", args.tokenizer]
    return kvstore, prefills, decodes, router_flags


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
                  "--prefill", ",".join(c.address for c in prefills),
                  "--decode", ",".join(c.address for c in decodes), *router_flags])
        if args.api_key:
            # Through the environment, not argv: keys must not show up in `ps`.
            os.environ["TANDEM_API_KEY"] = ",".join(args.api_key)
        children.append(router)
        start_child(router)
        wait_listening([router], args.startup_timeout, progress)
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
        return _supervise(children, args, stopping, progress, save_state)
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
    taken fixed port, a model that is not there."""
    from tandem.engine.loader import ModelNotFoundError, resolve_source
    from tandem.services.router.server import api_keys_from_flag

    api_keys_from_flag(args.api_key)
    fixed = [("--port", args.port), ("--grpc-port", args.grpc_port)]
    if args.kv_transfer == "store":
        fixed.append(("--kvstore-port", args.kvstore_port))
    for flag, port in fixed:
        problem = why_unbindable(args.host, port, flag) if port > 0 else None
        if problem:
            config_error(f"cannot listen on {args.host}:{port}: {problem}")
    try:
        resolve_source(args.model, args.load_format)
    except ModelNotFoundError as exc:
        config_error(f"--model: {exc}")


@dataclass
class _Restarts:
    """The supervisor's view of one child's restarts."""

    backoff_s: float = RESTART_BACKOFF_S  # the wait before the next restart
    restart_at: Optional[float] = None  # set while the child is down, waiting for its restart
    started_at: float = 0.0
    failed_starts: int = 0  # exits before the listening line, in a row
    abandoned: bool = False  # left dead: --no-restart or given up, with --keep-going


def _supervise(children: list[Child], args: argparse.Namespace, stopping: dict, progress,
               save_state) -> int:
    """Watch the children until SIGINT/SIGTERM; returns `tandem up`'s exit status."""
    restarts = {c.name: _Restarts(started_at=time.monotonic()) for c in children}
    while stopping["signal"] is None:
        now = time.monotonic()
        for child in children:
            r = restarts[child.name]
            if r.abandoned:
                continue
            if r.restart_at is not None:
                if now >= r.restart_at:
                    r.restart_at, r.started_at = None, now
                    child.restarts += 1
                    start_child(child)
                    save_state()  # the new pid
                continue
            code = child.process.poll()
            if code is None:
                if not child.listening:
                    if _check_listening(child):
                        progress(f"{child.name} listening on {child.address} again")
                elif now - r.started_at >= RESTART_RESET_S:
                    r.backoff_s = RESTART_BACKOFF_S
                continue
            exited = f"{child.name} (pid {child.pid}) {_exit_text(code)}"
            r.failed_starts = 0 if child.listening else r.failed_starts + 1
            if args.no_restart or r.failed_starts >= START_TRIES:
                why = ("--no-restart" if args.no_restart else
                       f"it exited {r.failed_starts} times in a row before listening: given up")
                if not args.keep_going:
                    print(f"error: {exited} ({why}); last lines of {child.log_path}:\n"
                          f"{log_tail(child)}\nstopping the whole stack.", file=sys.stderr, flush=True)
                    return 1
                progress(f"warning: {exited} ({why}); --keep-going: the rest keeps serving")
                r.abandoned = True
                continue
            progress(f"{exited}; restarting in {r.backoff_s:g}s (restart {child.restarts + 1})")
            r.restart_at = now + r.backoff_s
            r.backoff_s = min(2 * r.backoff_s, RESTART_BACKOFF_MAX_S)
        time.sleep(0.2)
    progress(f"{stopping['signal']} received")
    return 0


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.services.router.policies import POLICIES

    add_flag(p, "--host", default="127.0.0.1", help="address every process binds")
    add_flag(p, "--port", type=int, default=8000,
             help="HTTP port of the OpenAI-compatible gateway; 0 picks a free one")
    add_flag(p, "--grpc-port", type=int, default=50051,
             help="port of the public gRPC API; 0 picks a free one, -1 turns it off")
    add_flag(p, "--kv-transfer", default="store", choices=["store", "direct"],
             help="how KV moves from prefill to decode: store (through the KV store service, which "
                  "is also a prefix cache shared by every engine) or direct (decode copies from the "
                  "prefill's shared memory / CUDA IPC; no store; one host only)")
    add_flag(p, "--kvstore-port", type=int, default=0,
             help="KV store port; 0 picks a free one (kept across restarts, as every child's port)")
    add_flag(p, "--prefill", type=int, default=1, help="number of prefill instances (0: decode prefills)")
    add_flag(p, "--decode", type=int, default=1, help="number of decode instances")
    add_flag(p, "--store", default="memory",
             help="KV store backend: memory, or a Redis URL such as redis://127.0.0.1:6379/0")
    add_flag(p, "--model", default=DEFAULT_MODEL, help="model id, HF folder or .gguf file; the default is the embedded SmolLM2")
    add_flag(p, "--max-model-len", type=int, default=None,
             help="the engines' context length; unset: the model's own (the router checks requests "
                  "against what the engines report)")
    add_flag(p, "--tokenizer", default=None,
             help="tokenizer for every engine and the router instead of the model's own: HF folder, "
                  ".gguf file or 'smollm2' (serves a dummy-weight config-only model folder)")
    add_flag(p, "--block-size", type=int, default=16, help="tokens per KV block")
    add_flag(p, "--num-blocks", type=int, default=None, help="KV blocks per engine; unset: sized from memory")
    add_flag(p, "--policy", default="fifo", choices=["fifo", "srtf"], help="engines' scheduling policy")
    add_flag(p, "--max-num-seqs", type=int, default=256, help="most requests one engine runs at once")
    add_flag(p, "--max-num-batched-tokens", type=int, default=None,
             help="token budget of one engine step; unset: 8192 on CUDA, 2048 on the CPU")
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
    add_flag(p, "--api-key", default=None, nargs="*",
             help="API keys the gateway requires (several allowed; env: comma-separated); unset: no "
                  "authentication; an empty key is an error")
    add_flag(p, "--max-in-flight", type=int, default=1024,
             help="requests the router serves at once; more get HTTP 429 / RESOURCE_EXHAUSTED")
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
                  f"default it is restarted on its own port after {RESTART_BACKOFF_S:g} s, doubling "
                  f"per restart in a row up to {RESTART_BACKOFF_MAX_S:g} s, and a child that exits "
                  f"{START_TRIES} times in a row before listening stops the stack")
    add_flag(p, "--keep-going", type=bool, default=False,
             help="when a child is not restarted (--no-restart, or it cannot start): keep serving "
                  "without it instead of stopping the stack (fault tests)")


def register(subparsers) -> None:
    up = subparsers.add_parser(
        "up", help="run the whole stack on this machine",
        description="Start kvstore, prefill, decode and the router on loopback and print where to "
                    "point a client. A process that exits is restarted on its own port after a "
                    "back-off (--no-restart: the stack stops instead). Ctrl+C (or SIGTERM) stops "
                    "everything.")
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
