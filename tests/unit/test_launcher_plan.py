"""`tandem up`'s plan: every child gets a port fixed by the launcher (never
port 0), so a restarted child comes back where the others expect it."""
from __future__ import annotations

import argparse

from tandem.services.launcher import add_up_arguments, plan_stack


def plan(*argv: str, tmp_path) -> tuple:
    p = argparse.ArgumentParser()
    add_up_arguments(p)
    return plan_stack(p.parse_args(["--prefill", "2", "--decode", "2", *argv]), str(tmp_path))


def flag(argv: list[str], name: str) -> int:
    return int(argv[argv.index(name) + 1])


def test_every_child_gets_its_own_fixed_port(tmp_path):
    kvstore, prefills, decodes, router_flags = plan("--port", "0", "--grpc-port", "0", tmp_path=tmp_path)
    children = [kvstore, *prefills, *decodes]
    ports = [flag(c.argv, "--port") for c in children] + [c.metrics_port for c in children]
    ports += [flag(router_flags, "--port"), flag(router_flags, "--grpc-port")]
    assert all(p > 0 for p in ports) and len(set(ports)) == len(ports), ports
    assert all(flag(c.argv, "--metrics-port") == c.metrics_port for c in children)


def test_given_ports_are_kept_and_a_turned_off_grpc_api_stays_off(tmp_path):
    kvstore, _, _, router_flags = plan("--port", "18123", "--grpc-port", "-1", "--kvstore-port", "18124",
                                       tmp_path=tmp_path)
    assert flag(kvstore.argv, "--port") == 18124
    assert (flag(router_flags, "--port"), flag(router_flags, "--grpc-port")) == (18123, -1)


def test_max_model_len_goes_to_the_engines_and_the_router_takes_theirs(tmp_path):
    _, prefills, decodes, router_flags = plan("--max-model-len", "512", tmp_path=tmp_path)
    assert all(flag(c.argv, "--max-model-len") == 512 for c in prefills + decodes)
    assert "--max-model-len" not in router_flags
