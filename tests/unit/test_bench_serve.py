"""`tandem bench serve/sweep` without a server: metrics on hand-made records,
the dataset generators, the arrival process, flag parsing and the writers."""
from __future__ import annotations

import json
import math
import statistics

import pytest

from tandem.bench import report
from tandem.bench.arrivals import arrival_offsets
from tandem.bench.cli import main as bench_main
from tandem.bench.client import EndpointConfig, chunk_text, request_body
from tandem.bench.datasets import WORDS, DatasetConfig, ShareGPTLike, generate
from tandem.bench.metrics import RequestRecord, meets_slos, parse_slos, summarize
from tandem.bench.serve import ServeConfig, ServeResult
from tandem.bench.sweep import SweepPoint, max_sustained_rate, parse_rates, parse_target

pytestmark = pytest.mark.timeout(60)


def ok(index: int, ttft: float, e2e: float, out: int, prompt: int = 10, itl: list[float] | None = None,
       start: float = 0.0) -> RequestRecord:
    return RequestRecord(index=index, prompt_len=prompt, expected_output_len=out, start_s=start, end_s=start + e2e,
                         success=True, prompt_tokens=prompt, output_tokens=out, ttft_s=ttft, e2e_s=e2e,
                         itl_s=list(itl or []))


def failed(index: int) -> RequestRecord:
    return RequestRecord(index=index, prompt_len=10, expected_output_len=5, error="HTTP 500: boom", end_s=0.1)


# --- metrics -------------------------------------------------------------------------


def test_tpot_excludes_the_first_token():
    # 11 tokens: the first at 1.0 s, the remaining 10 over the next 0.5 s -> 50 ms each.
    record = ok(0, ttft=1.0, e2e=1.5, out=11)
    assert record.tpot_s == pytest.approx(0.05)
    assert ok(1, ttft=1.0, e2e=1.0, out=1).tpot_s is None  # one token: no TPOT


def test_percentiles_of_known_samples():
    # TTFTs 1..100 ms: numpy's linear interpolation gives p50 50.5, p90 90.1, p99 99.01.
    records = [ok(i, ttft=(i + 1) / 1000, e2e=1.0, out=2) for i in range(100)]
    s = summarize(records, duration_s=10.0)
    assert s.ttft_ms.mean == pytest.approx(50.5)
    assert s.ttft_ms.p50 == pytest.approx(50.5)
    assert s.ttft_ms.p90 == pytest.approx(90.1)
    assert s.ttft_ms.p99 == pytest.approx(99.01)
    assert s.ttft_ms.count == 100


def test_failed_requests_are_counted_but_excluded_from_latency_and_throughput():
    records = [ok(0, ttft=0.1, e2e=0.5, out=5, prompt=20), ok(1, ttft=0.3, e2e=0.9, out=3, prompt=30),
               failed(2), failed(3)]
    s = summarize(records, duration_s=2.0)
    assert (s.completed, s.failed) == (2, 2)
    assert s.ttft_ms.count == 2 and s.ttft_ms.mean == pytest.approx(200.0)
    assert s.e2e_ms.p50 == pytest.approx(700.0)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.input_token_throughput == pytest.approx(25.0)
    assert s.output_token_throughput == pytest.approx(4.0)
    assert s.total_token_throughput == pytest.approx(29.0)
    assert s.goodput is None and s.slo_attainment is None  # no SLOs given


def test_itl_pools_the_gaps_of_all_requests():
    records = [ok(0, 0.1, 0.4, 3, itl=[0.1, 0.2]), ok(1, 0.1, 0.5, 2, itl=[0.4]), failed(2)]
    s = summarize(records, duration_s=1.0)
    assert s.itl_ms.count == 3
    assert s.itl_ms.mean == pytest.approx(700.0 / 3)
    assert s.itl_ms.p50 == pytest.approx(200.0)


def test_goodput_counts_requests_meeting_every_slo():
    slos = parse_slos(["ttft:200", "tpot:50"])
    records = [
        ok(0, ttft=0.1, e2e=0.5, out=11),  # tpot 40 ms: good
        ok(1, ttft=0.3, e2e=0.5, out=11),  # ttft 300 ms: misses
        ok(2, ttft=0.1, e2e=1.1, out=11),  # tpot 100 ms: misses
        ok(3, ttft=0.2, e2e=0.2, out=1),  # one token, ttft at the limit: good
        failed(4),  # never good
    ]
    s = summarize(records, duration_s=4.0, slos_ms=slos)
    assert s.good_requests == 2
    assert s.goodput == pytest.approx(0.5)
    assert s.slo_attainment == pytest.approx(2 / 5)
    assert s.slos_ms == {"ttft": 200.0, "tpot": 50.0}
    assert not meets_slos(ok(5, 0.1, 9.0, 2), parse_slos(["e2el:1000"]))  # vLLM's key name works too


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "ttft:abc", "latency:5", "tpot:-1", "e2e:0"])
def test_bad_slo_items_are_refused_with_the_expected_form(bad):
    with pytest.raises(ValueError, match="KEY:MILLISECONDS"):
        parse_slos([bad])


def test_summary_of_nothing_completed_has_no_percentiles():
    s = summarize([failed(0)], duration_s=1.0, slos_ms={"ttft": 1.0})
    assert s.completed == 0 and s.failed == 1
    assert s.ttft_ms.p90 is None and s.goodput == 0.0
    assert "TTFT" in report.summary_table(s)  # the table renders without numbers


# --- datasets ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["random", "sharegpt", "shared-prefix", "multi-turn"])
def test_datasets_are_deterministic_per_seed(name):
    config = DatasetConfig(name=name, num_prompts=20, seed=7, input_len=30, output_len=10, range_ratio=0.5,
                           prefix_len=40)
    first, again = generate(config), generate(config)
    assert first == again
    assert len(first) == 20
    other = generate(DatasetConfig(name=name, num_prompts=20, seed=8, input_len=30, output_len=10,
                                   range_ratio=0.5, prefix_len=40))
    assert first != other
    for request in first:
        text = request.prompt_text()
        assert len(text.split()) == request.prompt_len  # prompt_len counts the words really sent
        assert set(text.split()) <= set(WORDS)
        assert request.output_len >= 1


def test_random_lengths_stay_in_the_range():
    requests = generate(DatasetConfig(name="random", num_prompts=500, input_len=100, output_len=20,
                                      range_ratio=0.25))
    assert min(r.prompt_len for r in requests) >= 75 and max(r.prompt_len for r in requests) <= 125
    assert min(r.output_len for r in requests) >= 15 and max(r.output_len for r in requests) <= 25
    assert 95 <= statistics.mean(r.prompt_len for r in requests) <= 105
    fixed = generate(DatasetConfig(name="random", num_prompts=20, input_len=64, output_len=8))
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(64, 8)}


def test_sharegpt_lengths_are_long_tailed_around_the_documented_medians():
    shape = ShareGPTLike()
    requests = generate(DatasetConfig(name="sharegpt", num_prompts=4000, seed=1))
    inputs = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    assert statistics.median(inputs) == pytest.approx(shape.input_median, rel=0.1)
    assert statistics.median(outputs) == pytest.approx(shape.output_median, rel=0.1)
    # Log-normal means: median * exp(sigma^2 / 2), ~264 and ~195 (the docstring's numbers).
    assert statistics.mean(inputs) == pytest.approx(264, rel=0.1)
    assert statistics.mean(outputs) == pytest.approx(195, rel=0.1)
    assert max(inputs) > 5 * statistics.median(inputs)  # the long tail
    assert min(inputs) >= 4 and max(inputs) <= shape.max_input_len and max(outputs) <= shape.max_output_len


def test_shared_prefix_groups_really_share_the_prefix():
    requests = generate(DatasetConfig(name="shared-prefix", num_prompts=12, prefix_groups=3, prefix_len=50,
                                      input_len=10))
    by_group: dict[int, set[str]] = {}
    for r in requests:
        assert r.messages[0].role == "system" and len(r.messages[0].content.split()) == 50
        assert r.prompt_text().startswith(r.messages[0].content)  # a prefix on /completions too
        by_group.setdefault(r.group, set()).add(r.messages[0].content)
    assert sorted(by_group) == [0, 1, 2]
    assert all(len(prefixes) == 1 for prefixes in by_group.values())  # one prefix per group
    assert len({p for prefixes in by_group.values() for p in prefixes}) == 3  # distinct across groups
    assert len({r.messages[1].content for r in requests}) == 12  # questions differ


def test_multi_turn_later_turns_extend_earlier_ones():
    requests = generate(DatasetConfig(name="multi-turn", num_prompts=12, turns=3, input_len=8, output_len=5))
    conversations: dict[int, list] = {}
    for position, r in enumerate(requests):
        conversations.setdefault(r.group, []).append((position, r))
    assert len(conversations) == 4
    for turns in conversations.values():
        assert [r.turn for _, r in turns] == [0, 1, 2]
        for (pos_a, a), (pos_b, b) in zip(turns, turns[1:]):
            assert pos_a < pos_b  # an earlier turn is sent first
            assert b.messages[:len(a.messages)] == a.messages  # and included in the later one
            assert b.messages[len(a.messages)].role == "assistant"
            assert len(b.messages[len(a.messages)].content.split()) == a.output_len
            assert b.prompt_len > a.prompt_len


def test_bad_dataset_settings_are_refused():
    with pytest.raises(ValueError, match="choose one of"):
        DatasetConfig(name="sharegpt-download")
    with pytest.raises(ValueError, match="range-ratio"):
        DatasetConfig(range_ratio=1.5)


# --- arrivals ------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 3.0])
def test_mean_inter_arrival_is_one_over_the_rate(burstiness):
    offsets = arrival_offsets(20001, rate=4.0, burstiness=burstiness, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    # Gamma(k, theta) has coefficient of variation 1/sqrt(k): Poisson 1, burstier > 1, smoother < 1.
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once_and_bad_rates_are_refused():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(50, 2.0, seed=1) == arrival_offsets(50, 2.0, seed=1)
    with pytest.raises(ValueError, match="request-rate"):
        arrival_offsets(5, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(5, 1.0, burstiness=0.0)


# --- the wire ------------------------------------------------------------------------


def test_request_body_asks_for_the_drawn_length_and_usage():
    request = generate(DatasetConfig(name="shared-prefix", num_prompts=1, prefix_len=5, input_len=3,
                                     output_len=7))[0]
    chat = request_body(EndpointConfig(base_url="http://h/v1", model="m"), request)
    assert chat["max_tokens"] == 7 and chat["min_tokens"] == 7 and chat["ignore_eos"] is True
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in chat["messages"]] == ["system", "user"]
    plain = request_body(EndpointConfig(base_url="http://h/v1/", model="m", endpoint="completions",
                                        ignore_eos=False), request)
    assert plain["prompt"] == request.prompt_text() and "ignore_eos" not in plain and "messages" not in plain
    assert EndpointConfig(base_url="http://h/v1/", model="m", endpoint="completions").url == "http://h/v1/completions"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}, "chat") == ""
    assert chunk_text({"choices": [{"delta": {"content": "hi"}}]}, "chat") == "hi"
    assert chunk_text({"choices": [], "usage": {}}, "completions") == ""


# --- sweep and files -----------------------------------------------------------------


def test_sweep_arguments_parse_and_bad_ones_say_what_to_write():
    assert parse_target("disagg=http://127.0.0.1:8000/v1").base_url == "http://127.0.0.1:8000/v1"
    assert parse_rates("1,2,inf") == [1.0, 2.0, math.inf]
    with pytest.raises(ValueError, match="NAME=BASE_URL"):
        parse_target("http://127.0.0.1:8000/v1")
    with pytest.raises(ValueError, match="comma"):
        parse_rates("1,0")


def test_max_sustained_rate_stops_at_the_first_rate_missing_the_goal():
    def point(rate: float, good: int) -> SweepPoint:
        records = [ok(i, 0.1, 0.2, 2) for i in range(good)] + [failed(100 + i) for i in range(10 - good)]
        return SweepPoint("a", rate, summarize(records, 1.0, {"ttft": 1000.0}))

    assert max_sustained_rate([point(1, 10), point(2, 9), point(4, 5), point(8, 10)], "a") == 2
    assert max_sustained_rate([point(1, 5)], "a") is None


def test_results_are_written_as_json_and_png(tmp_path):
    records = [ok(i, 0.05 * (i + 1), 0.5 + 0.1 * i, 5, itl=[0.1] * 4, start=0.1 * i) for i in range(6)]
    records.append(failed(6))
    config = ServeConfig(endpoint=EndpointConfig(base_url="http://h/v1", model="m", api_key="secret"),
                         slos_ms={"ttft": 200.0})
    result = ServeResult(config, records, summarize(records, 2.0, config.slos_ms))
    paths = report.write_serve_result(result, str(tmp_path))
    data = json.loads((tmp_path / report.RESULTS_JSON).read_text())
    assert data["summary"]["completed"] == 6 and data["summary"]["failed"] == 1
    assert len(data["requests"]) == 7 and data["requests"][0]["tpot_s"] == pytest.approx(0.1125)
    assert data["config"]["endpoint"]["api_key"] == "***"  # the key never reaches the file
    for path in paths[1:]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_a_bad_goodput_flag_before_sending_anything(capsys):
    code = bench_main(["bench", "serve", "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
                       "--goodput", "ttft=100", "--disable-tqdm"])
    assert code == 2
    assert "KEY:MILLISECONDS" in capsys.readouterr().err
