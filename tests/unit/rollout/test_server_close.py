"""ManagedServer.close / reopen on a real process (python -m http.server): a closed server is
not restarted by a request still in flight (shutdown must not bring it back); a server pool's
rejoin reopens it, after which a crash is restarted again as usual."""
import os
import signal
import sys

import pytest

from megatron_rl.rollout.base import ServerError
from megatron_rl.rollout.managed_server import ManagedServer
from megatron_rl.rollout.net import http_json


def _http_server(model_path, host, port):
    return [sys.executable, "-m", "http.server", "--bind", host, str(port)]


def test_closed_server_is_not_restarted_until_reopened(tmp_path):
    server = ManagedServer("http", _http_server, str(tmp_path), log_dir=str(tmp_path / "logs"),
                           health_path="/", startup_timeout=60, max_restarts=2)
    try:
        server.start()
        server.close()
        assert not server.alive()
        with pytest.raises(ServerError, match="was shut down"):
            server.restart("request failed")
        assert server.proc is None and server.num_restarts == 0
        server.reopen()
        server.start()
        os.killpg(server.proc.pid, signal.SIGKILL)  # a crash after the rejoin
        server.proc.wait()
        server.ensure_healthy()
        assert server.num_restarts == 1 and "Directory listing" in http_json(
            "GET", server.url + "/", timeout=30)
    finally:
        server.stop()
