"""Talking to inference servers over the network: JSON over HTTP, its errors, free ports and
the host name other nodes reach a server under. Standard library only."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any, Iterator

HOST = "127.0.0.1"


class ServerRequestError(RuntimeError):
    """The server answered a request with an HTTP error status (a bad request, not a crash)."""

    def __init__(self, url: str, status: int, body: str):
        super().__init__(f"{url}: HTTP {status}: {body[:2000]}")
        self.status, self.body = status, body


# Errors that mean "the server is not there / went away", as opposed to an HTTP error status.
TRANSPORT_ERRORS = (urllib.error.URLError, ConnectionError, http.client.HTTPException,
                    TimeoutError, socket.timeout)


def advertised_host(bind: str) -> str:
    """The name other processes (and nodes) use for a server bound to `bind`: the address
    itself, or this machine's fully qualified name for a wildcard bind (0.0.0.0, ::)."""
    return socket.getfqdn() if bind in ("", "0.0.0.0", "::") else bind


def free_port(host: str = HOST) -> int:
    """A port that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_json(method: str, url: str, payload: Any = None, timeout: float = 600.0) -> Any:
    """One HTTP request with a JSON body; returns the decoded JSON (or the text, or None).

    Raises ServerRequestError on an HTTP error status and a TRANSPORT_ERRORS member when the
    server cannot be reached or drops the connection.
    """
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read().decode()
    except urllib.error.HTTPError as e:
        raise ServerRequestError(url, e.code, e.read().decode(errors="replace")) from None
    if not body:
        return None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body


@contextlib.contextmanager
def stream_events(url: str, payload: Any, timeout: float = 600.0) -> Iterator[Iterator[Any]]:
    """POST `payload` as JSON and read the answer as server-sent events: `with stream_events(...)
    as events:` iterates the decoded JSON of each `data:` line, up to `data: [DONE]` or the end
    of the stream; leaving the block closes the connection (a server drops a streamed request
    whose client went away). `timeout` bounds each read. Errors as http_json's."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Accept": "text/event-stream"})
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise ServerRequestError(url, e.code, e.read().decode(errors="replace")) from None

    def events() -> Iterator[Any]:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)

    try:
        yield events()
    finally:
        resp.close()
