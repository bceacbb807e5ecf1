"""`tandem bench kernels` prints, beside each decode cell's fraction of the
large copy, what a copy of the same bytes reaches at that size and the kernel
as a fraction of it. The numbers come from the GPU; the report is checked here
on rows made by hand, so a column that goes missing or is swapped fails on the CPU."""
from tandem.bench.kernels import Ceilings, DecodeRow, Report, print_report


def row(batch: int, context: int, kv_gbps: float, same_size_copy_gbps: float) -> DecodeRow:
    return DecodeRow(batch=batch, context=context, us=1.0, kv_gbps=kv_gbps,
                     fraction_of_copy=kv_gbps / 3000, max_rel_error=1e-3, partition_size=64,
                     config="test", same_size_copy_gbps=same_size_copy_gbps,
                     fraction_of_same_size_copy=kv_gbps / same_size_copy_gbps)


def test_report_prints_the_same_size_copy_beside_each_decode_cell(capsys):
    report = Report(device="GPU", torch_version="t", triton_version="tr",
                    shape={"dtype": "bf16", "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                           "block_size": 16},
                    ceilings=Ceilings(copy_gbps=3000, matmul_tflops=700),
                    decode=[row(1, 512, 300, 840), row(1, 8192, 1650, 2400),
                            row(256, 512, 2850, 2940), row(256, 8192, 3040, 3000)])
    print_report(report)
    lines = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("batch \\ ctx"))
    assert lines[first + 1].split() == ["1", "300", "(0.10)", "1650", "(0.55)"]
    assert lines[first + 2].split() == ["256", "2850", "(0.95)", "3040", "(1.01)"]
    assert lines[first + 3].startswith("the same bytes moved by a copy")
    # per cell: the same-size copy over the large copy, then the kernel over that copy
    assert lines[first + 4].split() == ["1", "0.28", "0.36", "0.80", "0.69"]
    assert lines[first + 5].split() == ["256", "0.98", "0.97", "1.00", "1.01"]


def test_report_prints_cudnn_beside_the_prompt_rows_it_ran(capsys):
    from tandem.bench.kernels import PrefillRow

    report = Report(device="GPU", torch_version="t", triton_version="tr",
                    shape={"dtype": "bf16", "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                           "block_size": 16},
                    ceilings=Ceilings(copy_gbps=3000, matmul_tflops=700),
                    prefill=[PrefillRow(query_len=2048, prefix_len=0, ms=0.1, tflops=350, fraction_of_matmul=0.5,
                                        max_rel_error=2e-3, num_prompts=8, cudnn_tflops=420,
                                        cudnn_fraction_of_matmul=0.6),
                             PrefillRow(query_len=512, prefix_len=7680, ms=0.2, tflops=280,
                                        fraction_of_matmul=0.4, max_rel_error=2e-3)])
    print_report(report)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prefill ")]
    assert lines[0] == ("prefill 8 x q_len 2048 prefix 0: 0.100 ms, 350 TFLOP/s (0.50 of matmul), err 2.0e-03; "
                        "cuDNN 420 TFLOP/s (0.60)")
    assert lines[1] == "prefill 1 x q_len 512 prefix 7680: 0.200 ms, 280 TFLOP/s (0.40 of matmul), err 2.0e-03"


def test_heads_outer_cache_holds_the_same_values_with_each_heads_rows_of_a_block_together():
    import torch

    from tandem.bench.kernels import heads_outer

    cache = torch.randn(2, 5, 16, 8, 128)  # [K/V, blocks, block_size, kv_heads, head_dim]
    outer = heads_outer(cache)
    assert outer.shape == cache.shape and torch.equal(outer, cache)
    # in memory: [2, blocks, kv_heads, block_size, head_dim]
    assert outer.stride() == (5 * 8 * 16 * 128, 8 * 16 * 128, 128, 16 * 128, 1)


def test_report_prints_each_decode_variant_against_the_engines_own(capsys):
    from tandem.bench.kernels import DecodeVariantRow

    shapes = [(256, 704), (800, 704)]
    report = Report(device="GPU", torch_version="t", triton_version="tr",
                    shape={"dtype": "bf16", "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                           "block_size": 16},
                    ceilings=Ceilings(copy_gbps=3000, matmul_tflops=700),
                    decode_variants=[
                        DecodeVariantRow("tokens-outer", False, False, shapes, [100.0, 300.0], [0.70, 0.72], 1e-3),
                        DecodeVariantRow("heads-outer", True, True, shapes, [80.0, 270.0], [0.875, 0.80], 1e-3)])
    print_report(report)
    lines = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("decode variants"))
    assert lines[first + 1].split() == ["256x704", "800x704"]
    assert lines[first + 2].split(",")[0] == "tokens-outer"
    assert lines[first + 2].split()[-4:] == ["0.70", "1.00", "0.72", "1.00"]
    assert "heads first, values after scores" in lines[first + 3]
    assert lines[first + 3].split()[-4:] == ["0.88", "0.80", "0.80", "0.90"]
