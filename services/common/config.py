"""A service's command line: flags with environment-variable twins, and its main().

Every flag `--foo-bar` may also be set as TANDEM_FOO_BAR (the role-independent
form, so one env block in a container spec configures it). Precedence:
command line, then environment, then the default. The rules live in
tandem.engine.flags, which the engine's own settings (EngineArgs) use too;
they are re-exported here for the services' own flags.
"""
from __future__ import annotations

import argparse
import logging
import sys

from tandem.engine.flags import add_flag, config_error, env_name, parse_bool  # noqa: F401 (re-exported)


def run_main(add_arguments, serve, description: str) -> None:
    """The `main()` of a role's server module."""
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(serve(args))
