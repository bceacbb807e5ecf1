"""Socket sends and receives that cannot block, made without letting the GIL go.

Python lets the GIL go around every socket call, even one that returns at
once. Beside a thread that keeps the GIL busy (a serving engine's), the
caller then waits up to a switch interval to take it back: a small request
and an answer that has already come cost a switch interval each, and a KV
transfer of a few such calls loses most of its speed (the convoy effect;
docs/benchmarks.md measures it). These helpers try the call first without
blocking (MSG_DONTWAIT) through ctypes.PyDLL, which keeps the GIL for the
call's few microseconds; only a call that would have to wait lets it go
(the caller's ordinary socket call, after this one found nothing to do).

Plain sockets on Linux only: on a TLS socket, or where libc cannot be
loaded, they do nothing and the caller's ordinary call does it all.
"""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import ssl
import struct
from typing import Optional

try:
    _libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL is held through the call
    _send = _libc.send
    _send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _send.restype = ctypes.c_ssize_t
    _recv = _libc.recv
    _recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _recv.restype = ctypes.c_ssize_t
    _FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)
except (OSError, AttributeError):  # no C library to load (not Linux)
    _libc = None

_WOULD_BLOCK = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR)


def usable(sock: socket.socket) -> bool:
    return _libc is not None and not isinstance(sock, ssl.SSLSocket)


def send_now(sock: socket.socket, data: bytes) -> int:
    """How many leading bytes of `data` went out at once (0 if the socket's
    buffer is full, or on a socket these helpers do not serve); the caller
    sends the rest with sendall. OSError if the connection is broken."""
    if not data or not usable(sock):
        return 0
    sent = _send(sock.fileno(), data, len(data), _FLAGS)
    if sent >= 0:
        return sent
    err = ctypes.get_errno()
    if err in _WOULD_BLOCK:
        return 0
    raise OSError(err, os.strerror(err))


def sendall(sock: socket.socket, data: bytes) -> None:
    """sock.sendall(data), letting the GIL go only if the socket's buffer fills."""
    sent = send_now(sock, data)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def recv_now(sock: socket.socket, view: memoryview) -> Optional[int]:
    """Bytes that have already come, read into `view` (a writable, contiguous
    buffer): their count, 0 when the peer has closed, None when none have come
    (or on a socket these helpers do not serve: the caller's recv waits)."""
    if not usable(sock) or len(view) == 0:
        return None
    target = (ctypes.c_char * len(view)).from_buffer(view)
    got = _recv(sock.fileno(), target, len(view), _FLAGS)
    del target  # let the caller resize or release the buffer
    if got >= 0:
        return got
    err = ctypes.get_errno()
    if err in _WOULD_BLOCK:
        return None
    raise OSError(err, os.strerror(err))


def recv_some(sock: socket.socket, view: memoryview) -> int:
    """Bytes into `view`, as many as have come (at least one) up to its length;
    0 when the peer has closed. The GIL goes only if none has come yet, while
    the call waits. BlockingIOError when a kernel deadline passes first
    (kernel_deadline)."""
    got = recv_now(sock, view)
    return sock.recv_into(view, len(view)) if got is None else got


def kernel_deadline(sock: socket.socket, seconds: float, sends: bool = True) -> None:
    """Make `sock` blocking to Python, with its deadline kept by the kernel
    (SO_RCVTIMEO, and SO_SNDTIMEO with sends=True): a Python timeout makes each
    socket call a poll and then the call, two releases of the GIL where one
    does. A call past the deadline raises BlockingIOError."""
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    if sends:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
