"""Pickled messages both ways over one connected socket: the pipe between an
engine and its KV mover process (mover.py).

Why not multiprocessing's Connection: its recv reads a length and then the
body (two reads) after a poll, and its send is one write per message. Each of
those system calls lets the GIL go, and beside a busy engine thread each costs
up to a switch interval to take it back (docs/benchmarks.md). Here a send of
any number of messages is one write that keeps the GIL (held_gil_io), and a
receive takes every message that has come in one read, which lets the GIL go
only when it has to wait.
"""
from __future__ import annotations

import pickle
import socket
import struct
import threading
import time
from typing import Any, Optional

from tandem.services.kvstore import held_gil_io

FRAME = struct.Struct("<I")  # the pickled message's length
READ_BYTES = 1 << 16  # one read's room; a longer message takes more reads
# How long one read waits in the kernel before the caller looks at its deadline again.
READ_POLL_S = 0.5


class FramePipe:
    """send() from any thread; receive() from one thread at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        # One system call per read (see the module's doc). Sends keep no
        # deadline: a message waits for room as long as the other side lives.
        held_gil_io.kernel_deadline(sock, READ_POLL_S, sends=False)
        self._send_lock = threading.Lock()
        self._pending = bytearray()  # bytes read but not yet a whole message
        self._chunk = memoryview(bytearray(READ_BYTES))

    def send(self, *messages: Any) -> None:
        """Every message in one write. OSError when the other side is gone."""
        parts = []
        for message in messages:
            raw = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            parts += [FRAME.pack(len(raw)), raw]
        with self._send_lock:
            held_gil_io.sendall(self.sock, b"".join(parts))

    def receive(self, timeout_s: Optional[float] = None) -> list[Any]:
        """The messages that have come, at least one, waiting up to timeout_s
        (None: for ever); [] when none came in time. EOFError when the other
        side has closed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            messages = self._take_whole()
            if messages:
                return messages
            if deadline is not None and time.monotonic() >= deadline:
                return []
            try:
                got = held_gil_io.recv_some(self.sock, self._chunk)
            except (BlockingIOError, InterruptedError):  # READ_POLL_S passed with nothing to read
                continue
            if not got:
                raise EOFError("the other end of the pipe closed it")
            self._pending += self._chunk[:got]

    def _take_whole(self) -> list[Any]:
        messages, at, pending = [], 0, self._pending
        while len(pending) - at >= FRAME.size:
            (length,) = FRAME.unpack_from(pending, at)
            if len(pending) - at - FRAME.size < length:
                break
            start = at + FRAME.size
            messages.append(pickle.loads(pending[start:start + length]))
            at = start + length
        if at:
            del pending[:at]
        return messages

    def close(self) -> None:
        self.sock.close()
