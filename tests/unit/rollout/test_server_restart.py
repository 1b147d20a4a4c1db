"""ManagedServer's restart on a real process (a small threaded HTTP server) under requests from
several threads at once, as the agent loop's concurrent episodes send them: a dead server is
restarted once, not once per request that found it dead, and a server started by a thread
outlives the thread."""
import os
import signal
import sys
import threading
import time

from megatron_rl.rollout.managed_server import ManagedServer
from megatron_rl.rollout.net import http_json


SERVER = """
import http.server, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
        self.wfile.flush()

    def log_message(self, *args):
        pass

class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 64  # connections waiting to be accepted

Server((sys.argv[1], int(sys.argv[2])), Handler).serve_forever()
"""


def _http_server(model_path, host, port):
    return [sys.executable, "-c", SERVER, host, str(port)]


def test_requests_failing_on_one_dead_process_restart_it_once(tmp_path):
    server = ManagedServer("http", _http_server, str(tmp_path), log_dir=str(tmp_path / "logs"),
                           health_path="/", startup_timeout=60, max_restarts=3)
    threads, answers, errors = [], [], []
    try:
        server.start()
        os.killpg(server.proc.pid, signal.SIGKILL)  # a crash
        server.proc.wait()
        go = threading.Barrier(4)

        def request():
            go.wait()
            try:
                answers.append(server.call(lambda url: http_json("GET", url + "/",
                                                                   timeout=30)))
            except Exception as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)

        threads = [threading.Thread(target=request) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == [] and len(answers) == 4
        assert answers == ["ok"] * 4
        assert server.num_restarts == 1
    finally:
        server.stop()


def test_a_server_started_by_a_thread_outlives_the_thread(tmp_path):
    """The server's parent-death signal fires when the thread that started it ends: a server
    restarted by a request of a short-lived thread (an agent episode's) must not die with it."""
    server = ManagedServer("http", _http_server, str(tmp_path), log_dir=str(tmp_path / "logs"),
                           health_path="/", startup_timeout=60, max_restarts=3)
    try:
        starter = threading.Thread(target=server.start)
        starter.start()
        starter.join(60)
        time.sleep(1.0)  # the signal, were it sent, has arrived
        assert server.alive() and server.healthy()
        assert http_json("GET", server.url + "/", timeout=30) == "ok"
    finally:
        server.stop()
