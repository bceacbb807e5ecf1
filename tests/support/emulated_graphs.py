"""CUDA graphs emulated on the CPU: the graph classes' buffers, buckets,
padding and gathers are the real code's; a "replay" runs the captured call
again over the same persistent buffers. Real graphs run in tests/gpu."""
from __future__ import annotations

import torch

from tandem.engine.cuda_graphs import DecodeGraphs
from tandem.engine.piecewise_graphs import PiecewiseGraphs


class Replay:
    """Stands in for a captured CUDA graph."""

    def __init__(self, run) -> None:
        self.run = run

    def replay(self) -> None:
        with torch.inference_mode():
            self.run()

    def reset(self) -> None:
        pass


class EmulatedGraphs(DecodeGraphs):
    def _capture_all(self) -> None:
        q = self.query_len
        for b in self.sizes:
            args = (self.input_ids[: b * q], self.positions[: b * q], self.kv_caches, self._meta(b))
            with torch.inference_mode():
                self.outputs[b] = self.model(*args).clone()

            def run(b=b, args=args):
                self.outputs[b].copy_(self.model(*args))
            self.graphs[b] = Replay(run)


class EmulatedPiecewiseGraphs(PiecewiseGraphs):
    def _capture_all(self) -> None:
        for t in self.sizes:
            self.graphs[t] = [Replay(self._piece(t, i)) for i in range(len(self.layers) + 1)]
