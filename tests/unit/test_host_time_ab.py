"""`python -m tandem.bench.host_time_ab --which new` times a steady decode
step's host phases on this tree (its --which old side needs a checkout of
the code before the plan-as-data change, run by hand: docs/benchmarks.md)."""
import json

from tandem.bench.host_time_ab import main


def test_the_new_side_prints_one_row_of_positive_phase_times(capsys, tmp_path):
    assert main(["--which", "new", "--preset", "llama-3-tiny", "--tokenizer", "smollm2", "--batch", "6",
                 "--context", "40", "--steps", "3", "--device", "cpu", "--json", str(tmp_path / "rows.jsonl")]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["which"] == "new" and row["batch"] == 6
    assert row["schedule_ms"] > 0 and row["prepare_ms"] > 0 and row["update_ms"] > 0
    assert row["host_ms"] >= row["update_ms"]
    assert json.loads((tmp_path / "rows.jsonl").read_text()) == row
