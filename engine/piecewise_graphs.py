"""Piecewise CUDA graphs for the steps the decode graphs cannot take: prompt
chunks, alone or beside decodes (thesis 4.6.3, vLLM's piecewise graphs).

A mixed step's attention depends on its sequences (how many, how long each
prompt chunk is, how much context each has), so one graph cannot serve every
step of a token count. Everything else in a layer is row by row, so for a
token count it is the same launches whatever the sequences. Each bucket of
token counts therefore gets num_layers + 1 graphs, the pieces between the
attentions, and a step replays them with the attention run eagerly between:

    piece 0:      embedding, rotary cos/sin, layer 0 up to its attention
    attention 0   (eager, the batch's own metadata)
    piece i:      layer i - 1 from its attention's output on, layer i up to its attention
    ...
    piece L:      layer L - 1 from its attention's output on, the final norm

What crosses a seam lives in persistent buffers: the q/k/v projection's
output (laid out as the projection writes it, so the attention sees the
strides an eager step gives it), the attention's output, the residual
stream and cos/sin. A step's tokens are copied to the front of the input
buffers; padding rows (up to the bucket) carry slot -1, so they write no
KV, and no real row reads them: every op in a piece is row by row.

Steps of more than MAX_TOKENS tokens run eagerly, as in vLLM, whose largest
captured size is 512 tokens by default: their GPU time outweighs the
launches. (A cap of 1,024 was measured and not taken: it won or lost with
the host's launch speed; docs/benchmarks.md, the seventeenth session.) A KV
connector's layer hooks (its loads and saves) run between the pieces, so the
steps that carry them, which the decode graphs cannot take, come here too.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable, Optional

import torch

from tandem.engine.cuda_graphs import BUCKETS, capture, gc_paused
from tandem.engine.models.llama import LayerHook
from tandem.kernels import AttentionMetadata

log = logging.getLogger(__name__)

MAX_TOKENS = 512


class PiecewiseGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_tokens: int,
                 device: torch.device) -> None:
        """max_tokens: the largest step to capture (the token budget, at most MAX_TOKENS)."""
        self.model = model
        self.layers = list(model.model.layers)
        self.kv_caches = kv_caches
        self.sizes = [b for b in BUCKETS if b <= min(max_tokens, MAX_TOKENS)] or [1]
        t = self.sizes[-1]
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        dtype = model.model.embed_tokens.weight.dtype  # the activations' (FP8 keeps the embedding)
        hidden_size = model.config.hidden_size
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.input_ids = torch.zeros(t, dtype=torch.long, device=device)
        self.positions = torch.zeros(t, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.long, device=device)
        self.qkv = torch.zeros(t, q_width + 2 * kv_width, dtype=dtype, device=device)
        self.attended = torch.zeros(t, self.num_heads, self.head_dim, dtype=dtype, device=device)
        self.residual = torch.zeros(t, hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(t, hidden_size, dtype=dtype, device=device)
        self._q_width, self._kv_width = q_width, kv_width
        self.cos, self.sin = (torch.zeros_like(x) for x in model.model.rotary_emb.cos_sin(self.positions, dtype))
        self.graphs: dict[int, list] = {}
        self.replays = 0
        self._capture_all()

    # ---- the pieces -------------------------------------------------------
    def _qkv_views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [n, heads, head_dim] over the q/k/v buffer, as the fused projection lays them out."""
        q, k, v = self.qkv[:n].split([self._q_width, self._kv_width, self._kv_width], dim=-1)
        return (q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim),
                v.view(n, self.num_kv_heads, self.head_dim))

    def _hand_over(self, t: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor) -> None:
        """A piece's results into the buffers the attention and the next piece read."""
        for buffer, value in zip(self._qkv_views(t) + (self.residual[:t],), (q, k, v, residual)):
            if buffer.data_ptr() != value.data_ptr():  # the residual, updated in place on GPUs, is there
                buffer.copy_(value)

    def _piece(self, t: int, i: int) -> Callable[[], None]:
        """Piece i of bucket t, as a function of the buffers."""
        layers, last = self.layers, len(self.layers)
        slots = self.slot_mapping[:t]

        def run() -> None:
            if i == 0:
                hidden, cos, sin = self.model.embed(self.input_ids[:t], self.positions[:t])
                self.cos[:t].copy_(cos)
                self.sin[:t].copy_(sin)
                residual = None
            else:
                hidden, residual = layers[i - 1].finish(self.attended[:t], self.residual[:t])
            if i == last:
                self.hidden[:t].copy_(self.model.final_norm(hidden, residual))
                return
            q, k, v, residual = layers[i].begin(hidden, residual, self.cos[:t], self.sin[:t],
                                                self.kv_caches[i], slots)
            self._hand_over(t, q, k, v, residual)
        return run

    # ---- capture ----------------------------------------------------------
    @torch.inference_mode()
    def _capture_all(self) -> None:
        started = time.perf_counter()
        with gc_paused():
            # Largest first: the smaller buckets' temporaries reuse its memory.
            pool = torch.cuda.graph_pool_handle()
            for t in reversed(self.sizes):
                self.graphs[t] = [capture(self._piece(t, i), pool)[0] for i in range(len(self.layers) + 1)]
            torch.cuda.synchronize()
        log.info("captured piecewise CUDA graphs (%d pieces each) for steps of %s tokens in %.1f s",
                 len(self.layers) + 1, self.sizes, time.perf_counter() - started)

    def release(self) -> None:
        """Free every graph (before the tensor-parallel group goes: DecodeGraphs.release)."""
        torch.cuda.synchronize()
        for pieces in self.graphs.values():
            for graph in pieces:
                graph.reset()
        self.graphs.clear()

    # ---- replay -----------------------------------------------------------
    def bucket(self, num_tokens: int) -> Optional[int]:
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            before_layer: Optional[LayerHook] = None, after_layer: Optional[LayerHook] = None) -> torch.Tensor:
        """Hidden states [tokens, hidden] of any batch of at most the largest
        bucket's tokens (check bucket() first). Valid until the next run.
        The KV connector's hooks run between the pieces: before_layer(i)
        before the piece that ends with layer i's KV write (earlier than an
        eager step calls it, which only waits longer), after_layer(i) once
        layer i's attention is launched, its KV written."""
        n = input_ids.shape[0]
        t = self.bucket(n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        if t > n:
            self.slot_mapping[n:t].fill_(-1)  # padding rows write no KV
        pieces = self.graphs[t]
        q, k, v = self._qkv_views(n)
        for i, layer in enumerate(self.layers):
            if before_layer is not None:
                before_layer(i)
            pieces[i].replay()
            self.attended[:n].copy_(layer.self_attn.attend(q, k, v, self.kv_caches[i], meta))
            if after_layer is not None:
                after_layer(i)
        pieces[-1].replay()
        self.replays += 1
        return self.hidden[:n]
