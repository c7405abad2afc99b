"""A local HTTP upstream for the fleet tests: a ThreadingHTTPServer on a free loopback
port, served by a thread while the object is entered (``with``). A subclass says how a
request is answered (:meth:`LocalServer.answer`); this serves it."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self


class LocalServer:
    def __init__(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True

    def answer(self, request: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        """The status, headers and body for ``request`` (a GET)."""
        raise NotImplementedError

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        return f"http://{host}:{port}"

    def __enter__(self) -> Self:
        self._thread = Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: no TCP handshake per request
            # The head and the body go out in separate writes: without this, Nagle's
            # algorithm and the client's delayed ACK hold the body back some 40 ms.
            disable_nagle_algorithm = True

            def do_GET(self) -> None:
                status, headers, body = server.answer(self)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # requests carry tokens: never log them

        return Handler
