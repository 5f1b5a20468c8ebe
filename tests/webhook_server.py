"""A real HTTP server on 127.0.0.1 for webhook tests: it answers, fails (500), hangs, and recovers."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class WebhookServer:
    """Records every POST (body and receipt time); `script` says how to answer each one in turn.

    Script entries: "ok" (200), "fail" (500), "hang" (block until `release` is set, then 200).
    Past the end of the script every request gets "ok".
    """

    def __init__(self, script: list[str] | None = None) -> None:
        self.script = list(script or [])
        self.received: list[tuple[float, dict[str, Any]]] = []  # (time.time() at receipt, body)
        self.answers: list[str] = []
        self.hanging = threading.Event()  # set when a request starts hanging
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with threading.Lock():
                    answer = server.script.pop(0) if server.script else "ok"
                server.answers.append(answer)
                if answer == "hang":
                    server.hanging.set()
                    server.release.wait(60)
                if answer == "fail":
                    self.send_response(500)
                    self.end_headers()
                    return
                server.received.append((time.time(), body))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> WebhookServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
