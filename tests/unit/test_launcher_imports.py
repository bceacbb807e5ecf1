"""`python -m tandem.services.launcher` (what `tandem up` runs under tests and
containers) builds its parser, `serve`'s four roles included, without torch:
the launcher only starts and watches processes, and torch cost each start
1.7 s before the KV store could even begin."""
from __future__ import annotations

import subprocess
import sys


def test_the_launchers_parser_loads_no_torch():
    code = ("import sys\n"
            "from tandem.services.launcher import main\n"
            "for argv in (['up', '--help'], ['serve', 'prefill', '--help'], ['serve', 'decode', '--help']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "sys.exit(3 if 'torch' in sys.modules else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--kv-transfer" in result.stdout  # the help texts were printed, the roles' flags among them
