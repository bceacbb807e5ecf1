"""Rank 0's messages to the tensor-parallel workers: each step's plan and
the few settings they share at start, as pickled bytes through one pipe per
worker.

Why not a torch.distributed broadcast: the plan is plain Python data, and
broadcast_object_list over gloo sends a size, then the bytes, each a round
of gloo's threads over TCP. Rank 0 pays that every step before the workers
can start theirs, and on GPUs the first all-reduce waits for the slowest
rank. On the 2-core dev machine rank 0's host time to hand a plan over
went from 1.1-1.5 ms to 0.3-0.4 ms a step (docs/benchmarks.md).

A pipe also tells each side when the other is gone: a write to a worker
that exited fails (EPIPE), and a worker's read ends (EOF) when rank 0 exits.
"""
from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any


class WorkerGone(RuntimeError):
    """A worker's end of its pipe is closed: the worker exited."""


class PlanSender:
    """Rank 0's ends: one writer per worker, in rank order."""

    def __init__(self, writers: list[Connection], names: list[str]) -> None:
        self._writers = writers
        self._names = names

    def send(self, message: Any) -> None:
        """The same message to every worker (pickled once)."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for writer, name in zip(self._writers, self._names):
            try:
                writer.send_bytes(payload)
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise WorkerGone(f"tensor-parallel worker {name} exited; the engine cannot step") from exc

    def close(self) -> None:
        for writer in self._writers:
            writer.close()


def receive(reader: Connection) -> Any:
    """The next message from rank 0; EOFError when rank 0 has gone."""
    return pickle.loads(reader.recv_bytes())


__all__ = ["PlanSender", "WorkerGone", "receive"]
