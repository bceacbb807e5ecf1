"""The router's backend pools against real gRPC servers on loopback: DNS names
resolve to all their addresses on every health round (pods join and leave),
and the router reaches instances over TLS and mTLS."""
from __future__ import annotations

import argparse
import asyncio
import socket

import pytest

from tandem.services.common.aio_server import start_aio_grpc_server
from tandem.services.common.grpc_server import TLSConfig, tls_from_args
from tandem.services.router import backends
from tandem.services.router.backends import BackendPool, addresses_of, resolve
from tandem.v1 import common_pb2, decode_pb2_grpc
from tests.support.tls import make_certs

pytestmark = pytest.mark.timeout(120)


class _Decode(decode_pb2_grpc.DecodeServiceServicer):
    async def GetLoad(self, request, context) -> common_pb2.Load:
        return common_pb2.Load(num_total_blocks=8, num_free_blocks=8)


def _add(server) -> list[str]:
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(_Decode(), server)
    return ["tandem.v1.DecodeService"]


def pool(targets: list[str], tls=None) -> BackendPool:
    return BackendPool("decode", targets, decode_pb2_grpc.DecodeServiceStub, tls=tls, check_timeout_s=3)


def test_resolve_gives_every_address_of_a_name():
    assert "127.0.0.1:8080" in asyncio.run(resolve("localhost", 8080))
    assert asyncio.run(resolve("10.1.2.3", 50071)) == ["10.1.2.3:50071"]
    assert asyncio.run(resolve("::1", 50071)) == ["[::1]:50071"]


def test_a_dual_stack_name_counts_each_server_once():
    v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 50071))
    v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::7", 50071, 0, 0))
    assert addresses_of([v6, v4, v4], 50071) == ["10.0.0.7:50071"]
    assert addresses_of([v6], 50071) == ["[fd00::7]:50071"]


def test_a_name_joins_the_pool_as_its_addresses():
    async def run():
        server = await start_aio_grpc_server(_add, "127.0.0.1", 0)
        p = pool([f"localhost:{server.port}"])
        try:
            await p.check_all()
            return [i.target for i in p.healthy()], server.port
        finally:
            await p.close()
            await server.stop(0)

    healthy, port = asyncio.run(run())
    assert healthy == [f"127.0.0.1:{port}"]


def test_scaled_out_pods_join_and_removed_ones_leave(monkeypatch):
    """A headless Service name answers with one address per pod; what it answers
    changes as pods come and go. (This machine has no such DNS server, so the
    name's answers are given here; the two servers behind them are real.)"""
    answers: list[str] = []

    async def fake_resolve(host: str, port: int) -> list[str]:
        assert host == "decode.tandem.svc"
        return [f"{ip}:{port}" for ip in answers]

    monkeypatch.setattr(backends, "resolve", fake_resolve)

    async def run():
        a = await start_aio_grpc_server(_add, "127.0.0.1", 0)
        b = await start_aio_grpc_server(_add, "127.0.0.2", a.port)  # same port, another pod IP
        p = pool([f"decode.tandem.svc:{a.port}"])
        seen = []
        try:
            for pods in (["127.0.0.1"], ["127.0.0.1", "127.0.0.2"], ["127.0.0.2"]):
                answers[:] = pods
                await p.check_all()
                seen.append(sorted(i.target for i in p.healthy()))
            return seen, a.port, p._retired
        finally:
            await p.close()
            await a.stop(0)
            await b.stop(0)

    seen, port, retired = asyncio.run(run())
    assert seen == [[f"127.0.0.1:{port}"], [f"127.0.0.1:{port}", f"127.0.0.2:{port}"], [f"127.0.0.2:{port}"]]
    assert retired == []  # the pod that left had nothing in flight: its channel is closed


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(str(tmp_path_factory.mktemp("certs")))


def test_mtls_between_router_and_instance(certs):
    """The server certificate names only `localhost`: reaching it through the
    resolved address works because the router checks the name it resolved."""
    server_tls = TLSConfig(cert_file=certs.server_cert, key_file=certs.server_key, ca_file=certs.ca)

    async def healthy_with(tls) -> bool:
        server = await start_aio_grpc_server(_add, "127.0.0.1", 0, tls=server_tls)
        p = pool([f"localhost:{server.port}"], tls=tls)
        try:
            await p.check_all()
            return bool(p.healthy())
        finally:
            await p.close()
            await server.stop(0)

    client = TLSConfig(cert_file=certs.client_cert, key_file=certs.client_key, ca_file=certs.ca)
    assert asyncio.run(healthy_with(client))
    assert not asyncio.run(healthy_with(TLSConfig(ca_file=certs.ca)))  # no client certificate
    assert not asyncio.run(healthy_with(None))  # plaintext to a TLS server


def test_tls_flags_are_checked(certs, tmp_path):
    def args(**kw):
        return argparse.Namespace(**{"tls_cert": None, "tls_key": None, "tls_ca": None, **kw})

    assert tls_from_args(args()) is None
    assert tls_from_args(args(tls_ca=certs.ca)) == TLSConfig(ca_file=certs.ca)
    with pytest.raises(SystemExit, match="go together"):
        tls_from_args(args(tls_cert=certs.server_cert))
    with pytest.raises(SystemExit, match="--tls-ca"):
        tls_from_args(args(tls_ca=str(tmp_path / "missing.pem")))
