"""Free loopback ports for servers started by tests."""
from __future__ import annotations

import socket


_drawn: set[int] = set()  # this process's ports so far: none is handed out twice


def free_port() -> int:
    """A loopback port free now, drawn below the kernel's ephemeral range as
    the launcher draws its children's. One from bind(0) lies in that range,
    where any outgoing connection (the other lane's clients) may take it as
    its local end before the server binds it: a router of a stack whose
    ports came so failed to listen (`make test` on dev, 2026-12-03)."""
    from tandem.services.launcher.plan import free_port_below_ephemeral

    return free_port_below_ephemeral("127.0.0.1", _drawn)


def wait_for_port(port: int, host: str = "127.0.0.1", timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s}s")
