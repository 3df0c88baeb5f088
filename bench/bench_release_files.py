"""Memory and time of the release's file list (issue 13): one Python object per file (old) vs columns + MANIFEST.sha256 (new).

Usage:
    .venv/bin/python bench/bench_release_files.py --n 100000 [--n 1000000] [--dir /tmp/relfiles] [--keep]

For each N it writes a synthetic release once (N files ``images/<16 hex>.png`` of 64 random bytes,
plus ``release.parquet``, ``release.csv``, ``metadata.csv`` and a card) and hashes the images as the
stage does while writing them. Then, each in a fresh process (its peak RSS is its own), it runs the
steps the run process takes on the file list after the images are written, both ways:

- old (main before this change): the written digests as a dict, ``hash_tree(known=...)`` into a
  tuple of :class:`Artifact` (stage), the report validated (report), the card's re-listing with
  ``_KnownImages`` (card), ``write_report_bundle`` (report.html, validation, canonical JSON, Ed25519
  signature: sign); then ``deid verify`` on the result in a process of its own.
- new: :class:`~deid.release.manifest.ReleaseFiles` from the written digests, ``list_release``
  (stage: scan, MANIFEST.sha256), the report validated, ``list_release`` again (card), the same
  ``write_report_bundle``; then ``deid verify`` (signature, manifest hash, streamed manifest).

Prints per step the process's resident memory above its baseline (after imports, before the file
list exists: so the figure is what the file list costs), the peak, wall and CPU seconds, the size
of report.json, and whether verify passed. Old and new run in the same invocation, one after the other.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path and "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(ROOT))


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    """The process's peak resident memory since the last :func:`_reset_peak` (VmHWM)."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024


def _reset_peak() -> None:
    """Start the peak anew (Linux >= 4.0: writing 5 to clear_refs resets VmHWM to the current RSS)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _warm_up() -> None:
    """Load the Arrow kernels and allocator pools both sides use, before the baseline (a run has them warm)."""
    import numpy as np
    import pyarrow as pa

    from deid.release.manifest import ReleaseFiles

    f = ReleaseFiles.from_columns(pa.array(["images/b", "images/a"]), np.zeros((2, 32), np.uint8), np.ones(2))
    f.to_table(), list(f.rows()), f.known().get("images/a")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --------------------------------------------------------------------------- the synthetic release


def make_release(root: Path, n: int) -> None:
    """N small images and the tables; the images' digests (as the stage computes them) in root/../digests.npz."""
    import hashlib

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(13)
    (root / "images").mkdir(parents=True)
    raw = rng.integers(0, 256, (n, 8), dtype=np.uint8)
    names = [f"images/{r.tobytes().hex()}.png" for r in raw]
    sha = np.empty((n, 32), np.uint8)
    for i, name in enumerate(names):
        data = rng.bytes(64)
        with open(root / name, "wb") as fh:
            fh.write(data)
        sha[i] = np.frombuffer(hashlib.sha256(data).digest(), np.uint8)
    table = pa.table({"record_id": [r[7:23] for r in names], "image": names, "cluster_id": ["c-0"] * n})
    pq.write_table(table, root / "release.parquet")
    for csv in ("release.csv", "metadata.csv"):
        with open(root / csv, "w") as fh:
            fh.write("record_id,image,cluster_id\n")
            fh.writelines(f"{r[7:23]},{r},c-0\n" for r in names)
    np.savez(root.parent / "digests.npz", names=np.array(names, dtype="S"), sha=sha, sizes=np.full(n, 64, np.int64))
    sort_digests(root.parent)


def sort_digests(work: Path) -> None:
    """The saved digests in path order, as the stage's columns come (stage_release sorts them as it writes)."""
    import numpy as np

    z = dict(np.load(work / "digests.npz"))
    if len(z["names"]) > 1 and not (z["names"][1:] > z["names"][:-1]).all():
        order = np.argsort(z["names"], kind="stable")
        np.savez(work / "digests.npz", **{k: v[order] for k, v in z.items()})


def _report(key, release_dir: Path, n: int, artifacts, file_manifest=None):
    from deid.reporting.report import (Check, DatasetSummary, Privacy, Reidentification, Report, SigningInfo,
                                       dataset_fingerprint)

    return Report(
        release_id="r1", verdict="released", k=5, method="k-same-select", run_id="bench",
        dataset=DatasetSummary("bench", dataset_fingerprint(b"m", []), n, n, 0, 0, {}, records_withheld=0),
        checks=[Check("min_cluster_size", True, 5, 5, "")],
        privacy=Privacy(0.2, 0.1, 5, [Reidentification("nearest", "pixels", 0.1)]),
        artifacts=list(artifacts), release_dir=str(release_dir), signing=SigningInfo.from_key(key),
        file_manifest=file_manifest)


class _KnownImages(Mapping):
    """main's card-time lookup (deid.operations.pipeline._KnownImages before the manifest), for the old path."""

    def __init__(self, artifacts):
        self.artifacts = [a for a in artifacts if a.path.startswith("images/")]
        self.paths = [a.path for a in self.artifacts]

    def __getitem__(self, path):
        import bisect

        i = bisect.bisect_left(self.paths, path)
        if i == len(self.paths) or self.paths[i] != path:
            raise KeyError(path)
        return self.artifacts[i].sha256, self.artifacts[i].bytes

    def __iter__(self):
        return iter(self.paths)

    def __len__(self):
        return len(self.paths)


# --------------------------------------------------------------------------- one side, in its own process


def child(mode: str, work: Path) -> dict:
    import numpy as np
    import pyarrow as pa

    from deid.release.card import CARD_NAME
    from deid.release.manifest import ReleaseFiles, list_release
    from deid.release.signing import ensure_signing_key
    from deid.reporting.html_report import write_report_bundle
    from deid.reporting.report import Artifact, hash_tree, validate_report

    release, report_dir = work / "release", work / f"report-{mode}"
    shutil.rmtree(report_dir, ignore_errors=True)
    key = ensure_signing_key(configured=None, keys_dir=work / "keys")
    _warm_up()
    base = _rss_mib()
    _reset_peak()
    steps: list[dict] = []
    t0, c0 = time.perf_counter(), _cpu()

    def step(name: str) -> None:
        nonlocal t0, c0
        steps.append({"step": name, "rss_mib": round(_rss_mib() - base, 1), "peak_mib": round(_peak_mib() - base, 1),
                      "wall_s": round(time.perf_counter() - t0, 2), "cpu_s": round(_cpu() - c0, 2)})
        t0, c0 = time.perf_counter(), _cpu()

    z = np.load(work / "digests.npz")
    names = z["names"]
    n = len(names)
    (release / CARD_NAME).unlink(missing_ok=True)
    (release / "MANIFEST.sha256").unlink(missing_ok=True)
    if mode == "old":
        written = {name.decode(): (sha.tobytes().hex(), int(size)) for name, sha, size in
                   zip(names.tolist(), z["sha"], z["sizes"])}  # _write_images' dict
        del z, names
        step("written digests")
        artifacts = tuple(Artifact(**a) for a in hash_tree(release, known=written))
        del written
        step("stage: list")
        report = _report(key, release, n, artifacts)
        validate_report(report.to_dict())
        step("report: validate")
        (release / CARD_NAME).write_text("card\n")
        artifacts = tuple(Artifact(**a) for a in hash_tree(release, known=_KnownImages(artifacts)))
        report = dataclasses.replace(report, artifacts=list(artifacts))
        step("card: list again")
    else:
        # The stage's columns as _write_images returns them: Arrow paths (over the names' bytes, no copy), sorted.
        width = names.dtype.itemsize
        offsets = np.arange(0, width * n + 1, width, dtype=np.int32)
        paths = pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(names))
        written = ReleaseFiles.from_sorted(paths, z["sha"], z["sizes"])
        del z, names
        step("written digests")
        images, listing = list_release(release, known=written)
        del written
        step("stage: list")
        report = _report(key, release, n, listing.artifacts, listing.manifest)
        validate_report(report.to_dict())
        step("report: validate")
        (release / CARD_NAME).write_text("card\n")
        _, listing = list_release(release, known=images)
        report = dataclasses.replace(report, artifacts=list(listing.artifacts), file_manifest=listing.manifest)
        step("card: list again")
    write_report_bundle(report_dir, report.to_dict(), key)
    step("sign: report.html + report.json + signature")
    return {"mode": mode, "n": n, "baseline_mib": round(base, 1), "steps": steps,
            "report_json_bytes": (report_dir / "report.json").stat().st_size}


def verify_child(mode: str, work: Path) -> dict:
    from deid.reporting.verify import verify_report

    _warm_up()
    base = _rss_mib()
    _reset_peak()
    t0, c0 = time.perf_counter(), _cpu()
    res = verify_report(work / f"report-{mode}", public_key=work / "keys" / "dev_signing.pub.pem",
                        release_dir=work / "release")
    return {"mode": mode, "verify_ok": res.ok, "problems": res.problems[:3],
            "verify": {"peak_mib": round(_peak_mib() - base, 1), "wall_s": round(time.perf_counter() - t0, 2),
                       "cpu_s": round(_cpu() - c0, 2)}}


def _run(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, action="append", help="number of images (repeat for several)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a fresh one under /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic releases")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "WORK"), help=argparse.SUPPRESS)
    ap.add_argument("--verify-child", nargs=2, metavar=("MODE", "WORK"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], Path(a.child[1]))))
        return
    if a.verify_child:
        print(json.dumps(verify_child(a.verify_child[0], Path(a.verify_child[1]))))
        return
    scratch = a.dir or Path(tempfile.mkdtemp(prefix="relfiles-"))
    print(f"load average {os.getloadavg()[0]:.1f}; scratch {scratch}")
    try:
        for n in a.n or [100_000]:
            work = scratch / f"n{n}"
            if not (work / "digests.npz").exists():
                t = time.perf_counter()
                shutil.rmtree(work, ignore_errors=True)
                make_release(work / "release", n)
                print(f"\nN = {n:,}: synthetic release written in {time.perf_counter() - t:.0f} s")
            else:
                sort_digests(work)
                print(f"\nN = {n:,}: synthetic release reused")
            for mode in ("old", "new"):
                r = _run("--child", mode, str(work))
                v = _run("--verify-child", mode, str(work))
                print(f"  {mode}: baseline {r['baseline_mib']} MiB (imports); report.json "
                      f"{r['report_json_bytes'] / 2**20:.2f} MiB")
                print(f"    {'step':44s} {'RSS+':>9s} {'peak+':>9s} {'wall s':>7s} {'cpu s':>7s}")
                for s in r["steps"]:
                    print(f"    {s['step']:44s} {s['rss_mib']:9.1f} {s['peak_mib']:9.1f} {s['wall_s']:7.2f} "
                          f"{s['cpu_s']:7.2f}")
                peak = max(s["peak_mib"] for s in r["steps"])
                wall, cpu = sum(s["wall_s"] for s in r["steps"]), sum(s["cpu_s"] for s in r["steps"])
                print(f"    {'run process: file list, peak / total':44s} {'':9s} {peak:9.1f} {wall:7.2f} {cpu:7.2f}")
                vv = v["verify"]
                print(f"    {'deid verify (own process)':44s} {'':9s} {vv['peak_mib']:9.1f} {vv['wall_s']:7.2f} "
                      f"{vv['cpu_s']:7.2f}  ok={v['verify_ok']} {v['problems'] or ''}")
    finally:
        if not a.keep and a.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
