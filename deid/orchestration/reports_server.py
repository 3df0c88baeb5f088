"""``deid server``'s read-only web server for ``reports/``: the report artifact in the Prefect UI is a link that opens.

A browser does not follow a link from the Prefect UI (http) to a local file, so ``deid server``
also serves the reports directory (report.html, the validation pages, the catalogue
``index.html``) over HTTP on the same host, on the next port (``--reports-port``). Read-only:
only GET and HEAD are answered (anything else: 501), bound to loopback like the Prefect server.
No Prefect import: the server is Python's own ``http.server`` in a thread of ``deid server``.
"""
from __future__ import annotations

import functools
import logging
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote

log = logging.getLogger(__name__)


class ReadOnlyReports(SimpleHTTPRequestHandler):
    """GET and HEAD of files under the reports directory; never cached (a report is replaced by its addendum)."""

    server_version = "deid-reports"
    sys_version = ""

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        super().end_headers()

    def list_directory(self, path):
        """A directory without index.html: 404 (the catalogue is index.html; no listing of run directories)."""
        self.send_error(404, "no index.html here; the catalogue is /index.html (`deid releases` writes it)")
        return None

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        log.debug("reports server: " + format, *args)


def start_reports_server(reports_dir: str | Path, port: int, *, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serve ``reports_dir`` read-only on ``host:port`` from a daemon thread; ``.shutdown()`` stops it.

    Raises
    ------
    OSError
        The port is taken (the caller names ``--reports-port``).
    """
    root = Path(reports_dir)
    root.mkdir(parents=True, exist_ok=True)
    httpd = ThreadingHTTPServer((host, port), functools.partial(ReadOnlyReports, directory=str(root)))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="deid reports server", daemon=True).start()
    return httpd


def report_url(base_url: str, served_dir: str | Path, report_dir: str | Path) -> str | None:
    """The URL of ``report_dir/report.html`` on the reports server serving ``served_dir`` (None: not under it)."""
    try:
        rel = Path(report_dir).resolve().relative_to(Path(served_dir).resolve())
    except ValueError:
        return None
    return f"{base_url.rstrip('/')}/{quote(rel.as_posix())}/report.html"
