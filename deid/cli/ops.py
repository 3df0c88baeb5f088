"""``deid server | serve | watch``: run deid as a service (Prefect server, deployments, drop watcher)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _quiet_env(env=os.environ) -> None:
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def server_env(port: int, base: dict | None = None) -> dict:
    """Environment of ``prefect server start``: state under ``<data dir>/prefect``, telemetry off."""
    from deid.settings import Settings

    env = dict(os.environ if base is None else base)
    home = Settings().data_path / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    env["PREFECT_HOME"] = str(home)
    env.setdefault("PREFECT_SERVER_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{home / 'prefect.db'}")
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["DO_NOT_TRACK"] = "1"
    env.pop("PREFECT_API_URL", None)  # the server must not try to talk to another one
    env["PREFECT_UI_API_URL"] = f"http://127.0.0.1:{port}/api"
    return env


def server_command(port: int) -> list[str]:
    prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or shutil.which("prefect")
    base = [prefect] if prefect else [sys.executable, "-m", "prefect"]
    return [*base, "server", "start", "--host", "127.0.0.1", "--port", str(port)]


def cmd_server(args) -> int:
    from deid.orchestration.reports_server import start_reports_server
    from deid.settings import Settings

    env = server_env(args.port)
    reports_port = args.reports_port if args.reports_port is not None else args.port + 1
    reports_dir = Settings().reports_path
    try:
        reports = start_reports_server(reports_dir, reports_port)
    except OSError as exc:
        print(f"deid server: --reports-port={reports_port} cannot be used ({exc.strerror or exc}); pass a free port "
              "from 1024 to 65535, e.g. --reports-port 4281", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"Prefect server: state in {env['PREFECT_HOME']}")
    print(f"UI:  http://127.0.0.1:{args.port}/")
    print(f"reports (read-only): http://127.0.0.1:{reports_port}/ serves {reports_dir} (the catalogue is index.html)")
    print(f"deid run, serve and watch in this project find this server by themselves (its server file); "
          f"elsewhere: export PREFECT_API_URL=http://127.0.0.1:{args.port}/api")
    sys.stdout.flush()
    proc = subprocess.Popen(server_command(args.port), env=env)
    from deid.orchestration.prefect_api import clear_server_file, write_server_file

    # `deid run` in this project reuses this server while it answers (deid.orchestration.prefect_api); its
    # runs link their report artifact to the reports server.
    data_path = Settings().data_path
    write_server_file(data_path, port=args.port, pid=os.getpid(), reports_port=reports_port, reports_dir=reports_dir)

    def stop(signum, _frame):
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
    finally:
        clear_server_file(data_path, pid=os.getpid())
        reports.shutdown()


def _need_api(cmd: str) -> str | None:
    from deid.orchestration.watch import api_url

    try:
        return api_url()
    except Exception as exc:
        print(f"deid {cmd}: {exc}", file=sys.stderr)
        return None


def cmd_serve(args) -> int:
    _quiet_env()
    from deid.flows import serve as s  # sets PREFECT_RUNNER_POLL_FREQUENCY before prefect loads

    url = _need_api("serve")
    if url is None:
        return EXIT_BAD_INPUT
    print(f"deid serve: deployments release (cron {s.schedule_cron()!r} over {s.incoming_dir()}) and "
          f"release-on-drop (on {s.EVENT}) against {url}", file=sys.stderr)
    # SIGTERM as SIGINT: serve pauses its deployments and exits cleanly on KeyboardInterrupt.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        s.serve_all(limit=args.limit)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def cmd_watch(args) -> int:
    _quiet_env()
    incoming = Path(args.incoming)
    if not incoming.is_dir():
        print(f"deid watch: INCOMING_DIR {incoming} does not exist or is not a directory; create it or pass "
              "the directory producers drop into", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.interval <= 0:
        print(f"deid watch: --interval={args.interval} must be a positive number of seconds, e.g. 2", file=sys.stderr)
        return EXIT_BAD_INPUT
    from deid.operations.ledger import open_ledger
    from deid.settings import Settings
    from deid.orchestration.watch import Watcher

    url = _need_api("watch")
    if url is None:
        return EXIT_BAD_INPUT
    ledger = open_ledger(Settings())
    print(f"deid watch: {incoming.resolve()} every {args.interval} s; events to {url}; ledger {ledger.location}",
          file=sys.stderr)

    def report(row: dict) -> None:
        if args.json:
            print(json.dumps(row), flush=True)
            return
        o = row["outcome"]
        if o == "announce":
            print(f"new drop: {row['drop']} ({row['fingerprint']}) -> deid.drop.ready", flush=True)
        elif o == "duplicate":
            print(f"duplicate: {row['drop']} has the same content as {row['duplicate_of']} "
                  f"({row['status']}{', release ' + row['release_id'] if row.get('release_id') else ''}); "
                  "not released again", flush=True)
        elif o == "verdict":
            print_verdict(row)
        elif o in ("error", "unsent", "failed"):
            print(f"{o}: {row['drop']}: {row['error']}", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        Watcher(incoming, ledger).run(interval=args.interval, once=args.once, report=report)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def print_verdict(row: dict) -> None:
    """An announced drop's verdict, as ``deid run`` prints it (:func:`deid.reporting.verdict.verdict_summary`)."""
    from deid.reporting.verdict import verdict_summary

    report = Path(row["report"])
    print(f"verdict of {row['drop']} (release {row['release_id']}):", flush=True)
    try:
        body = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"  {row['status']}; the signed report {report} cannot be read here ({exc}); "
              f"check it with `deid verify {report.parent}`", flush=True)
        return
    for line in verdict_summary(body, report_html=report.with_name("report.html")).text_lines():
        print(f"  {line}", flush=True)
    print(f"  signed report: {report}", flush=True)


def register(subparsers) -> None:
    """Add ``server``, ``serve`` and ``watch`` to the ``deid`` command line."""
    p = subparsers.add_parser("server", help="start a local Prefect server (UI + API) with its state under data/")
    p.add_argument("--port", type=int, default=4200)
    p.add_argument("--reports-port", type=int, default=None,
                   help="port of the read-only web server for reports/ (default: --port + 1)")
    p.set_defaults(func=cmd_server)

    p = subparsers.add_parser("serve", help="serve the nightly 'release' and the 'release-on-drop' deployments")
    p.add_argument("--limit", type=int, default=None, help="maximum concurrent flow runs (default: no limit)")
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("watch", help="announce complete drops (with _READY) in INCOMING_DIR as deid.drop.ready")
    p.add_argument("incoming", metavar="INCOMING_DIR")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between scans (default 2)")
    p.add_argument("--once", action="store_true", help="scan once and exit")
    p.add_argument("--json", action="store_true", help="one JSON line per drop examined")
    p.set_defaults(func=cmd_watch)
