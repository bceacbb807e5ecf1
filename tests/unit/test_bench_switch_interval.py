"""`python -m tandem.bench.switch_interval` times its loop beside each neighbour
at each interval, and leaves the process's switch interval as it found it."""
import sys

from tandem.bench import switch_interval


def test_every_neighbour_at_every_interval_and_the_interval_restored(capsys):
    before = sys.getswitchinterval()
    assert switch_interval.main(["--intervals-ms", "1,0.25", "--rounds", "1", "--iterations", "2000",
                                 "--repeats", "3"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row[0] for row in rows] == ["nothing", "waker", "spinner"]
    assert all(len(row) == 5 and float(row[1]) > 0 and float(row[2]) > 0 for row in rows)
    assert sys.getswitchinterval() == before
