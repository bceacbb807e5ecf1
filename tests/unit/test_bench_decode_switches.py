"""`--decode-kernel` on the engine benches, and the pick from a
`--decode-variants` report that chooses it (bench/decode_switches.py). The
report is written through the same dataclasses and JSON dump as `tandem bench
kernels`, so a renamed field fails here; the timings are made up."""
import json
from dataclasses import asdict

import pytest

from tandem.bench.decode_switches import apply_decode_switches, engine_flags, main, pick_switches
from tandem.bench.kernels import Ceilings, DecodeVariantRow, Report
from tandem.kernels import attention_triton
from tandem.kernels.kv_cache_dtype import FP8_KV_DTYPE

SHAPES = [(64, 704), (256, 704), (800, 704)]


def report(*rows: DecodeVariantRow) -> dict:
    made = Report(device="GPU", torch_version="t", triton_version="tr", shape={},
                  ceilings=Ceilings(copy_gbps=3000, matmul_tflops=700), decode_variants=list(rows))
    return json.loads(json.dumps(asdict(made)))


def variant(layout: str, first: bool, after: bool, us: list[float]) -> DecodeVariantRow:
    return DecodeVariantRow(layout, first, after, SHAPES, us, [0.7] * len(us), 1e-3)


def test_the_pick_is_the_fastest_variant_of_a_layout_at_the_large_batches() -> None:
    rows = report(variant("tokens-outer", False, False, [30.0, 120.0, 380.0]),
                  variant("tokens-outer", False, True, [20.0, 118.0, 379.0]),  # wins only at 64: not counted
                  variant("tokens-outer", True, False, [35.0, 100.0, 330.0]),
                  variant("tokens-outer", True, True, [36.0, 105.0, 331.0]),
                  variant("heads-outer", False, False, [12.0, 60.0, 160.0]),
                  variant("heads-outer", False, True, [10.0, 50.0, 150.0]))
    switches, why = pick_switches(rows)
    assert switches == ["heads-first"]
    assert "430 us" in why and "500 us" in why
    # counting the 64-sequence shape too, values-after-scores' lead there is not enough
    assert pick_switches(rows, min_batch=64)[0] == ["heads-first"]
    assert pick_switches(rows, min_batch=800)[0] == ["heads-first"]
    # the heads-outer rows compete among themselves, against the same defaults
    switches, why = pick_switches(rows, "heads-outer")
    assert switches == ["values-after-scores"]
    assert "200 us" in why and "500 us" in why
    # a lead under the margin is no pick
    assert pick_switches(rows, margin=0.13)[0] == ["heads-first"]
    assert pick_switches(rows, margin=0.2)[0] is None
    assert engine_flags(switches, "heads-outer") == "--kv-cache-layout HND --decode-kernel values-after-scores"
    assert engine_flags([], "heads-outer") == "--kv-cache-layout HND"
    assert engine_flags([], "tokens-outer") == ""


def test_no_switch_where_the_defaults_are_fastest(capsys, tmp_path) -> None:
    rows = report(variant("tokens-outer", False, False, [30.0, 100.0, 300.0]),
                  variant("tokens-outer", True, True, [30.0, 101.0, 301.0]),
                  variant("heads-outer", False, False, [30.0, 110.0, 310.0]))
    assert pick_switches(rows)[0] is None
    path = tmp_path / "variants.json"
    path.write_text(json.dumps(rows))
    for layout in ("tokens-outer", "heads-outer"):
        assert main([str(path), "--layout", layout]) == 0
        out = capsys.readouterr()
        assert out.out.strip() == ""
        assert "no engine run" in out.err
    # a layout alone, without a switch, is a pick of its own
    path.write_text(json.dumps(report(variant("tokens-outer", False, False, [30.0, 100.0, 300.0]),
                                      variant("heads-outer", False, False, [30.0, 80.0, 250.0]))))
    assert main([str(path), "--layout", "heads-outer"]) == 0
    assert capsys.readouterr().out.split() == ["--kv-cache-layout", "HND"]
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.strip() == ""
    both = report(variant("tokens-outer", False, False, [30.0, 100.0, 300.0]),
                  variant("tokens-outer", True, True, [30.0, 90.0, 290.0]))
    path.write_text(json.dumps(both))
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.split() == ["--decode-kernel", "heads-first", "--decode-kernel",
                                               "values-after-scores"]


def test_a_report_without_variants_or_large_shapes_is_refused() -> None:
    with pytest.raises(ValueError, match="not a --decode-variants report"):
        pick_switches(report())
    with pytest.raises(ValueError, match="not a --decode-variants report"):
        pick_switches(report(variant("heads-outer", False, False, [1.0, 2.0, 3.0])), "heads-outer")
    with pytest.raises(ValueError, match="no shape of at least 1000"):
        pick_switches(report(variant("tokens-outer", False, False, [1.0, 2.0, 3.0])), min_batch=1000)


def test_switches_replace_the_kernels_default_config(monkeypatch) -> None:
    # monkeypatch only restores the module's global after the test
    monkeypatch.setattr(attention_triton, "DEFAULT_CONFIG", attention_triton.DEFAULT_CONFIG)
    before = attention_triton.DEFAULT_CONFIG
    assert apply_decode_switches([]) == {"heads-first": False, "values-after-scores": False}
    assert attention_triton.DEFAULT_CONFIG is before
    state = apply_decode_switches(["values-after-scores"])
    assert state == {"heads-first": False, "values-after-scores": True}
    decode = attention_triton.DEFAULT_CONFIG.decode
    assert decode.values_after_scores and not decode.grid_heads_first
    assert decode.block_n == before.decode.block_n  # the rest as it was
    assert attention_triton.DEFAULT_CONFIG.long_prefill == before.long_prefill
    # an FP8 cache's tiles keep the switch
    fp8 = attention_triton.decode_tiles(decode, FP8_KV_DTYPE)
    assert fp8.values_after_scores and fp8.block_n == decode.fp8_block_n


def test_switches_are_refused_for_tensor_parallel_ranks_and_unknown_names(monkeypatch) -> None:
    monkeypatch.setattr(attention_triton, "DEFAULT_CONFIG", attention_triton.DEFAULT_CONFIG)
    before = attention_triton.DEFAULT_CONFIG
    with pytest.raises(ValueError, match="one-GPU engines"):
        apply_decode_switches(["heads-first"], tensor_parallel_size=2)
    with pytest.raises(ValueError, match="unknown switch 'sideways'"):
        apply_decode_switches(["sideways"])
    assert attention_triton.DEFAULT_CONFIG is before
    assert apply_decode_switches([], tensor_parallel_size=2)["heads-first"] is False


def test_the_benches_take_the_flag() -> None:
    import argparse

    from tandem.bench import latency, throughput

    for module in (latency, throughput):
        parser = argparse.ArgumentParser()
        module.register(parser.add_subparsers(dest="command"))
        name = module.__name__.rsplit(".", 1)[1]
        args = parser.parse_args([name, "--decode-kernel", "heads-first", "--decode-kernel", "values-after-scores"])
        assert args.decode_kernel == ["heads-first", "values-after-scores"]
        with pytest.raises(SystemExit):
            parser.parse_args([name, "--decode-kernel", "sideways"])
