"""A throwaway CA and certificates signed by it (openssl CLI), for TLS and
mTLS tests: `make_certs(dir)` -> paths of ca.pem, server.pem/.key (for the
DNS name `localhost` only, no IP address), client.pem/.key, and node.pem/.key
(server and client at once, for localhost and 127.0.0.1: what every role of a
local stack uses)."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


@dataclass
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    node_cert: str
    node_key: str


def _run(*argv: str, cwd: str) -> None:
    subprocess.run(argv, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def make_certs(directory: str) -> Certs:
    if shutil.which("openssl") is None:
        raise RuntimeError("these tests need the openssl command (apt-get install -y openssl)")
    d = directory
    _run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=tandem-test-ca", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name, ext in (("server", "subjectAltName=DNS:localhost"), ("client", "extendedKeyUsage=clientAuth"),
                      ("node", "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                               "extendedKeyUsage=serverAuth,clientAuth")):
        _run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=tandem-{name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(ext + "\n")
        _run("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)
    p = lambda n: os.path.join(d, n)  # noqa: E731
    return Certs(ca=p("ca.pem"), server_cert=p("server.pem"), server_key=p("server.key"),
                 client_cert=p("client.pem"), client_key=p("client.key"),
                 node_cert=p("node.pem"), node_key=p("node.key"))
