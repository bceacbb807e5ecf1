"""`make test`'s runner (tests/lanes.py): both lanes run, each line says its
lane, and a failure in either fails the run. Real pytest processes on two
throwaway test folders."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.lanes import LANE_ENV, LANES, ROOT, Lane, names_tests, run_lanes


def write_lane(folder, name: str, body: str) -> str:
    folder.mkdir()
    (folder / f"test_{name}.py").write_text(body)
    return str(folder)


def test_a_failure_in_one_lane_fails_the_run_and_the_other_lane_still_runs(tmp_path, capfd):
    ok = write_lane(tmp_path / "ok", "ok", "import time\n\ndef test_fine():\n    time.sleep(8)\n")
    bad = write_lane(tmp_path / "bad", "bad", "def test_broken():\n    assert 1 == 2\n")
    code = run_lanes((Lane("good", (ok,)), Lane("bad", (bad,))), ["-q", "-p", "no:cacheprovider"])
    out = capfd.readouterr().out
    assert code == 1
    assert "[good] 1 passed" in out
    assert "[ bad] FAILED" in out and "1 failed" in out
    assert "lane good" in out and "exit 0" in out and "lane bad" in out and "exit 1" in out
    # each lane's own time: the failing one ended seconds before the sleeping
    # one (a margin for pytest's start, which took 4 s in one lane and 6 s in
    # the other on a busy CI machine)
    seconds = {line.split()[1]: int(line.rsplit(", ", 1)[1].split()[0]) for line in out.splitlines()
               if line.startswith("lane ")}
    assert seconds["good"] >= seconds["bad"] + 4, seconds


def test_both_lanes_passing_is_a_pass(tmp_path, capfd):
    one = write_lane(tmp_path / "one", "one", "def test_a():\n    pass\n")
    two = write_lane(tmp_path / "two", "two", "def test_b():\n    pass\n")
    assert run_lanes((Lane("one", (one,)), Lane("two", (two,))), ["-q", "-p", "no:cacheprovider"]) == 0


def test_lanes_get_their_extra_environment_unless_it_is_already_set(tmp_path, monkeypatch):
    body = ("import os\n\ndef test_env():\n"
            "    assert os.environ['TANDEM_LANES_PROBE'] == {!r}\n")
    monkeypatch.delenv("TANDEM_LANES_PROBE", raising=False)
    given = write_lane(tmp_path / "given", "given", body.format("from the runner"))
    extra = {"TANDEM_LANES_PROBE": "from the runner"}
    assert run_lanes((Lane("given", (given,)),), ["-q", "-p", "no:cacheprovider"], extra_env=extra) == 0
    monkeypatch.setenv("TANDEM_LANES_PROBE", "from the user")
    kept = write_lane(tmp_path / "kept", "kept", body.format("from the user"))
    assert run_lanes((Lane("kept", (kept,)),), ["-q", "-p", "no:cacheprovider"], extra_env=extra) == 0


def test_arguments_naming_tests_run_one_pytest_process():
    assert names_tests("tests/unit/test_lanes.py::test_both_lanes_passing_is_a_pass")
    assert names_tests("tests/e2e")
    assert not names_tests("-q") and not names_tests("e2e") and not names_tests("--durations=0")
    out = subprocess.run([sys.executable, "-m", "tests.lanes", "tests/unit/test_lanes.py",
                          "-k", "naming_tests_run_one or nothing_else", "-q", "-p", "no:cacheprovider",
                          "--collect-only"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test_lanes.py::test_arguments_naming_tests_run_one_pytest_process" in out.stdout
    assert "[" not in out.stdout and "lane " not in out.stdout  # one plain process, no lanes


def test_solo_tests_leave_the_lanes_and_run_alone():
    """tests/conftest.py's selection under tests/lanes.py's LANE_ENV: the
    GIL measurement (marked solo) only in the solo run, its neighbours only
    in the shared lanes."""
    def collected(lane: str) -> list[str]:
        out = subprocess.run([sys.executable, "-m", "pytest", "tests/unit/test_kv_wire_gil.py", "-q",
                              "--collect-only", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env={**os.environ, LANE_ENV: lane})
        return [line for line in out.stdout.splitlines() if "::" in line]

    solo, shared, plain = collected("solo"), collected("shared"), collected("")
    assert solo == ["tests/unit/test_kv_wire_gil.py::test_a_call_that_cannot_block_keeps_the_gil"]
    assert shared and not set(solo) & set(shared)
    assert sorted(solo + shared) == sorted(plain)  # outside `make test` nothing is left out


def test_every_test_file_runs_in_exactly_one_lane():
    """LANES' paths and ignores: a file named in two lanes would run twice, one
    in none never (the solo run takes only tests marked solo)."""
    def lanes_of(path: str) -> list[str]:
        return [lane.name for lane in LANES
                if any(path == p or path.startswith(p + "/") for p in lane.paths)
                and not any(path == i or path.startswith(i + "/") for i in lane.ignore)]

    files = [os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
             for top in ("tests/unit", "tests/gpu", "tests/e2e")
             for d, _, names in os.walk(os.path.join(ROOT, top)) for f in names
             if f.startswith("test_") and f.endswith(".py")]
    assert len(files) > 100
    wrong = {f: lanes_of(f) for f in files if len(lanes_of(f)) != 1}
    assert not wrong, wrong
    for lane in LANES:  # each moved file exists, so a rename cannot drop it silently
        for path in lane.ignore:
            assert os.path.exists(os.path.join(ROOT, path)), path
