"""Sweep the fused MoE kernel's tiles (kernels/fused_moe_triton.py) on a GPU.

For each batch of T tokens, one MoE layer of the preset's shapes with random
routing: first the gate/up launch's tiles are swept (the down launch at its
default), then the down launch's (gate/up at the best found). Each candidate
is the whole layer's time, routing's sort included, beside the bytes of the
experts the batch touches over the device-to-device copy bandwidth measured
in the same run: the layer's floor.

Timing: REPEAT calls, each with its own routing (so a call finds few of its
experts in the L2 cache), captured in one CUDA graph, as a decode step runs
them; the median replay (triton.testing.do_bench) over REPEAT. Timed eagerly
the layer is bound by the host's launches (about 1 ms a call on an H200,
against a floor of 18 us at one token).

    python -m tandem.bench.moe_tiles --preset qwen3-30b-a3b --tokens 1,8,64,256 [--fp8 [--activations fp8]]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from typing import Optional

DEFAULT_GRID = "32,64,128:64,128,256:4x3,4x4,8x3"
REPEAT = 10


def parse_grid(text: str) -> list:
    """"N,..:K,..:WxS,.." -> MoETiles for every combination."""
    from tandem.kernels.fused_moe_triton import MoETiles

    try:
        ns, ks, ws = text.split(":")
        warps_stages = [tuple(int(v) for v in p.split("x")) for p in ws.split(",")]
        return [MoETiles(n, k, w, s) for n, k, (w, s) in
                itertools.product([int(v) for v in ns.split(",")], [int(v) for v in ks.split(",")], warps_stages)]
    except ValueError:
        raise SystemExit(f"error: --grid {text!r}: expected N,..:K,..:WARPSxSTAGES,.. such as {DEFAULT_GRID}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.moe_tiles", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b", help="an MoE preset of bench/presets.py")
    parser.add_argument("--tokens", default="1,8,64,256", help="batch sizes (tokens a step), comma-separated")
    parser.add_argument("--fp8", action="store_true", help="e4m3 experts (engine/fp8.py's form)")
    parser.add_argument("--activations", choices=("fp8", "model"), default="fp8",
                        help="with --fp8: quantize the activations per row (fp8, W8A8, what the engine runs) "
                             "or keep them in bf16 (model, W8A16, for comparison)")
    parser.add_argument("--grid", default=DEFAULT_GRID,
                        help="candidate tiles: BLOCK_N values:BLOCK_K values:WARPSxSTAGES pairs")
    args = parser.parse_args(argv)

    import torch
    import triton

    from tandem.bench.roofline import copy_bandwidth
    from tandem.bench.presets import preset_config
    from tandem.engine.models.moe import MoEConfig, route
    from tandem.kernels.fp8_torch import quantize_stacked
    from tandem.kernels.fused_moe_triton import MoETiles, fused_moe_triton

    if not torch.cuda.is_available():
        print("error: the sweep times a GPU kernel; no CUDA device here", file=sys.stderr)
        return 2
    config = preset_config(args.preset)
    moe = MoEConfig.from_hf(config)
    hidden, inter, experts = config.hidden_size, moe.intermediate_size, moe.num_experts
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    scales: tuple = ()
    fp8_activations = args.activations == "fp8"
    if args.fp8:
        (w13, s13), (w2, s2) = quantize_stacked(w13), quantize_stacked(w2)
        scales = (s13, s2)
    bandwidth = copy_bandwidth(device)
    grid = parse_grid(args.grid)
    weights_kind = f"e4m3 weights, activations: {args.activations}" if args.fp8 else "bf16 weights"
    print(f"{args.preset}: {experts} experts, top-{moe.top_k}, hidden {hidden}, expert width {inter}, "
          f"{weights_kind}; copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
        routes = []
        for _ in range(REPEAT):
            logits = torch.randn(tokens, experts, device=device, generator=gen)
            routes.append(route(logits, moe))  # the model's routing (on CUDA its kernel)
        touched = sum(int(torch.unique(ids).numel()) for _, ids in routes) / REPEAT
        floor_us = touched * (w13[0].numel() + w2[0].numel()) * w13.element_size() / bandwidth * 1e6

        def layers(gate_up: Optional[MoETiles], down: Optional[MoETiles]) -> None:
            for weights, ids in routes:
                fused_moe_triton(x, w13, w2, weights, ids, *scales, gate_up_tiles=gate_up, down_tiles=down,
                                 fp8_activations=fp8_activations)

        def timed(gate_up: Optional[MoETiles], down: Optional[MoETiles]) -> float:
            try:
                layers(gate_up, down)  # compiles outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    layers(gate_up, down)
                return triton.testing.do_bench(graph.replay) * 1e3 / REPEAT
            except Exception as exc:  # a tile the GPU cannot hold (shared memory): not a candidate
                print(f"  skipped {gate_up} / {down}: {type(exc).__name__}: {str(exc)[:100]}")
                return float("inf")

        default = timed(None, None)  # the kernel's own choice
        gate_up = min(grid, key=lambda t: timed(t, None))
        down = min(grid, key=lambda t: timed(gate_up, t))
        best = timed(gate_up, down)
        print(f"T={tokens:4d} experts touched {touched:5.1f}, floor {floor_us:7.1f} us | default "
              f"{default:7.1f} us ({floor_us / default:.2f} of floor) | best {best:7.1f} us "
              f"({floor_us / best:.2f}): gate/up {gate_up}, down {down}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
