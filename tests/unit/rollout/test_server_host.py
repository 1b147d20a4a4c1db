"""A started server binds --rollout-host and announces a name other nodes can use: a real
process (python -m http.server) under ManagedServer, reached through the URL it announces."""
import socket
import sys

import pytest

from megatron_rl.rollout.managed_server import ManagedServer
from megatron_rl.rollout.net import advertised_host, http_json


def _http_server(model_path, host, port):
    return [sys.executable, "-m", "http.server", "--bind", host, str(port)]


@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0"])
def test_server_is_reachable_at_its_announced_url(bind, tmp_path):
    server = ManagedServer("http", _http_server, str(tmp_path), log_dir=str(tmp_path / "logs"),
                           health_path="/", startup_timeout=60, host=bind)
    try:
        server.start()
        host = server.url.split("//")[1].rsplit(":", 1)[0]
        assert host == (socket.getfqdn() if bind == "0.0.0.0" else bind)
        assert host != "0.0.0.0"
        assert "Directory listing" in http_json("GET", server.url + "/", timeout=30)
    finally:
        server.stop()


def test_wildcard_binds_announce_the_machine_name():
    assert advertised_host("0.0.0.0") == advertised_host("::") == socket.getfqdn()
    assert advertised_host("10.1.2.3") == "10.1.2.3"
