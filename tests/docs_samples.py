"""The code samples of the README and the docs site, run as a reader would run them.

Every ```python block of a page runs, in page order, all of a page's blocks in one
Python process (a later block sees what an earlier one defined), in a fresh directory.
Before it runs, the page's code is pointed at real local parts, by text:

    redis://localhost:6379    -> a redis-server the suite started
    https://api.example.com   -> a local HTTP server answering 200 {"ok": true}
    api.example.com           -> that server's 127.0.0.1:PORT

``python tests/docs_samples.py PAGE.md ...`` runs pages by hand (starting its own
redis-server), and says which block of which page failed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A fence that opens a block to run: ```python, indented as in a list item.
_OPEN = re.compile(r"^(?P<indent>\s*)```python\s*$")


def pages() -> list[Path]:
    """The README and every page of the site that has a sample to run."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [page for page in found if python_blocks(page)]


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """Each ```python block of ``page``: the line it starts on, and its code."""
    blocks: list[tuple[int, str]] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opened = _OPEN.match(lines[i])
        if opened is None:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start}: a ```python block is never closed")
        blocks.append((start, textwrap.dedent("\n".join(body))))
        i += 1
    return blocks


def page_code(page: Path, redis_url: str, upstream: str) -> str:
    """The page's blocks as one program, pointed at the local parts; each block is
    marked with its line, which a traceback shows."""
    host = upstream.removeprefix("http://")
    server = re.match(r"rediss?://[^/]+", redis_url)
    assert server is not None, redis_url
    parts = []
    for line, code in python_blocks(page):
        code = code.replace("redis://localhost:6379", server.group(0))
        code = code.replace("https://api.example.com", upstream)
        code = code.replace("api.example.com", host)
        parts.append(f"# ---- {page.name}, the block at line {line}\n{code}\n")
    return "\n".join(parts)


def run_page(page: Path, redis_url: str, upstream: str) -> subprocess.CompletedProcess[str]:
    """Run the page's samples in a process of their own, in a fresh directory."""
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    with tempfile.TemporaryDirectory() as where:
        return subprocess.run(
            [sys.executable, "-c", page_code(page, redis_url, upstream)],
            cwd=where,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )


class _Answer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass  # (quiet: a sample's requests are not news)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # (a client that hung up: no news)


@contextmanager
def upstream() -> Iterator[str]:
    """A local HTTP server that answers every request 200 ``{"ok": true}``; its base URL."""
    server = _Server(("127.0.0.1", 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def main(argv: list[str]) -> int:
    from throttle_client.testing import RedisServer

    failed = 0
    server = RedisServer()
    server.start()
    try:
        with upstream() as base:
            for name in argv or [str(page) for page in pages()]:
                done = run_page(Path(name).resolve(), server.url, base)
                status = "ok" if done.returncode == 0 else "FAILED"
                print(f"{status:6} {name} ({len(python_blocks(Path(name)))} blocks)")
                if done.returncode:
                    failed += 1
                    print(textwrap.indent((done.stdout + done.stderr)[-3000:], "    "))
    finally:
        server.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
