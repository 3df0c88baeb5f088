"""Integration: the release flow end to end on synthetic drops and on the real London set."""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import cv2
import pyarrow.parquet as pq
import pytest
from helpers import identifying_text_in_reports, assert_nothing_published

from deid.release.card import split_card
from deid.intake.synth import make_synthetic_drop
from deid.reporting.verify import verify_report

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _run(drop: Path, **params) -> dict:
    from deid.flows.release import run_flow

    return run_flow(str(drop), **params).summary()


def _check_release_invariants(result: dict, *, k: int, drop: Path) -> dict:
    """Invariants 1 and 2 of DEVELOPERS.md on a published release; returns the release table."""
    rel = Path(result["release_dir"])
    table = pq.read_table(rel / "release.parquet").to_pydict()
    labels = json.loads(Path(result["report"]).read_text())["configuration"]["labels"]
    assert set(table) == {"record_id", "image", "cluster_id", *labels}
    n = len(table["record_id"])
    assert n == result["dataset"]["records_released"] > 0
    assert len(set(table["record_id"])) == n
    # Cluster sizes >= k (distinct people are checked by the gate against staging).
    sizes = defaultdict(int)
    for c in table["cluster_id"]:
        sizes[c] += 1
    assert min(sizes.values()) >= k
    # No source ids, paths or bytes: ids are fresh, files are our PNGs.
    manifest = (drop / "manifest.csv").read_text()
    for rid in table["record_id"][:20]:
        assert rid not in manifest
    sources = {p.read_bytes() for p in list(drop.rglob("*.png"))[:50] + list(drop.rglob("*.jpg"))[:50]}
    # DEID_COLOR=auto (the default): a colour drop is released in colour (BGR), a grey one in grey.
    ndim = 3 if json.loads(Path(result["report"]).read_text())["configuration"]["color"] else 2
    for name in table["image"]:
        data = (rel / name).read_bytes()
        assert data.startswith(b"\x89PNG") and data not in sources
        assert b"eXIf" not in data and b"tEXt" not in data
        img = cv2.imdecode(__import__("numpy").frombuffer(data, "uint8"), cv2.IMREAD_UNCHANGED)
        assert img.ndim == ndim
    report = json.loads(Path(result["report"]).read_text())
    assert report["privacy"]["min_distinct_people_per_cluster"] >= k
    # The Hugging Face imagefolder layout and the dataset card, with the gate's figures as signed.
    with open(rel / "metadata.csv", newline="", encoding="utf-8") as fh:
        meta = list(csv.DictReader(fh))
    assert sorted(r["file_name"] for r in meta) == sorted(table["image"])
    card, _ = split_card((rel / "README.md").read_text())
    assert (card["deid"]["k"], card["deid"]["records"]) == (k, n)
    assert card["deid"]["max_reidentification_rate"] == report["privacy"]["max_rate"]
    # Every released file is signed: the images through MANIFEST.sha256 (its sha256 in the report), the rest listed.
    from deid.release.manifest import read_manifest

    assert report["file_manifest"]["files"] == n
    assert {a["path"] for a in report["artifacts"]} | {p for _, p in read_manifest(rel / "MANIFEST.sha256")} == {
        p.relative_to(rel).as_posix() for p in rel.rglob("*") if p.is_file()}
    return table


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> SimpleNamespace:
    """What `make demo` does, run once for the module: `deid synth` (60 people x 2, seed 7), `deid run --k 5`.

    The installed `deid` command, default settings (no Prefect API configured: the run starts its
    own temporary server; two Dask workers), in a fresh project directory.
    """
    base = tmp_path_factory.mktemp("demo")
    deid = ROOT / ".venv" / "bin" / "deid"
    exe = [str(deid)] if deid.exists() else [sys.executable, "-m", "deid.cli"]
    env = {**os.environ, "DEID_PROJECT_DIR": str(base), "PREFECT_HOME": str(base / "prefect")}
    for var in ("PREFECT_API_URL", "DEID_SIGNING_KEY", "DEID_DASK_WORKERS", "DEID_DASK_ADDRESS"):
        env.pop(var, None)
    synth = subprocess.run([*exe, "synth", "drops/demo", "--people", "60", "--seed", "7"], cwd=base, env=env,
                           capture_output=True, text=True, timeout=300)
    run = subprocess.run([*exe, "run", "drops/demo", "--k", "5"], cwd=base, env=env, capture_output=True,
                         text=True, timeout=600) if synth.returncode == 0 else None
    return SimpleNamespace(project=base, drop=base / "drops" / "demo", exe=exe, env=env, synth=synth, run=run)


def _printed(stdout: str, key: str) -> str:
    """The value of a ``key: value`` line printed by `deid run`."""
    return next(line.split(": ", 1)[1] for line in stdout.splitlines() if line.startswith(f"{key}: "))


def test_demo_path_cli(demo):
    """`make demo` through the installed `deid` command: exit 0, RELEASED, a signed report; a bad drop exits 2."""
    assert demo.synth.returncode == 0, demo.synth.stderr
    r = demo.run
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "verdict: RELEASED" in r.stdout
    report = _printed(r.stdout, "signed report")
    assert _printed(r.stdout, "report") == str(Path(report).parent / "report.html")  # the page a steward opens
    assert Path(report).is_file() and Path(report + ".sig").is_file()
    bad = subprocess.run([*demo.exe, "run", "drops/nope"], cwd=demo.project, env=demo.env, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_synthetic_release_end_to_end_and_verify(demo, tmp_path):
    """The demo's release (60 synthetic people x 2 at k=5): counts, invariants, signature, linkage, tampering."""
    assert demo.run is not None and demo.run.returncode == 0, (demo.synth.stderr, demo.run and demo.run.stderr[-3000:])
    project, out = demo.project, demo.run.stdout
    report_path = Path(_printed(out, "signed report"))
    report = json.loads(report_path.read_text())
    pub = project / "data" / "keys" / "dev_signing.pub.pem"
    assert f"--public-key {pub}" in out  # what `deid run` tells the steward to verify with
    result = {**report, "report": str(report_path), "report_dir": str(report_path.parent),
              "release_dir": _printed(out, "release")}
    assert result["verdict"] == "released", result["reasons"]
    assert result["release_dir"] == str(project / "data" / "releases" / report["release_id"])
    ds = result["dataset"]
    assert ds["records_in"] == 120
    assert ds["records_released"] + ds["records_suppressed"] + ds["records_quarantined"] == 120
    assert (f"records: 120 in, {ds['records_released']} released, {ds['records_suppressed']} suppressed, "
            f"{ds['records_quarantined']} quarantined") in out
    assert result["privacy"]["max_rate"] <= 1 / 5
    _check_release_invariants(result, k=5, drop=demo.drop)
    report_dir = Path(result["report_dir"])
    assert verify_report(report_dir, public_key=pub).ok
    html = (report_dir / "report.html").read_text()
    assert "released" in html.lower() and "http://" not in html and "https://" not in html
    # The private linkage record maps every released record back to its source, under a key.
    from deid.release.linkage import linkage_path, load_linkage_key, read_linkage

    rows = read_linkage(linkage_path(project / "data", report["release_id"]),
                        load_linkage_key(project / "data" / "keys" / "dev_linkage.key"))
    released_ids = set(pq.read_table(Path(result["release_dir"]) / "release.parquet").column("record_id").to_pylist())
    assert {r["released_record_id"] for r in rows} == released_ids
    assert all(r["subject_id"] and r["source_image"].startswith("images/") for r in rows)
    # The person index's face search ran (issue 27): no one was registered before, so its 60 people were searched
    # and none matched; the release registered its faces with its lineage.
    searched = {c["name"]: c for c in report["checks"]}["person_index"]
    assert searched["passed"] and searched["detail"].startswith("face search: 0 of the 60 people"), searched
    from deid.operations.person_index import PersonIndex

    key = load_linkage_key(project / "data" / "keys" / "dev_linkage.key")
    owners = PersonIndex.open(project / "data", key).face_search()[1]
    assert len(owners) == 120 - ds["records_quarantined"] and {d for d, _ in owners} == {report["lineage"]["dataset"]}
    # The staging quarantine table exists even when empty; nothing left behind in releases/.
    staging = project / "data" / "staging" / report["release_id"]
    assert (staging / ".complete").exists() and pq.read_table(staging / "quarantine.parquet").num_rows == 0
    releases = project / "data" / "releases"
    assert [p.name for p in releases.iterdir()] == [report["release_id"]]
    # One flipped byte in a released file breaks verification (on a copy: the module shares the release).
    rel_copy, rep_copy = tmp_path / "release", tmp_path / "report"
    shutil.copytree(result["release_dir"], rel_copy)
    shutil.copytree(report_dir, rep_copy)
    assert verify_report(rep_copy, public_key=pub, release_dir=rel_copy).ok
    victim = next((rel_copy / "images").iterdir())
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    bad = verify_report(rep_copy, public_key=pub, release_dir=rel_copy)
    assert not bad.ok and any("hash mismatch" in p for p in bad.problems)


def test_recipient_verifies_the_release_directory_alone(demo, tmp_path):
    """Issue 29 item 8: only the release directory, copied elsewhere, verifies with the steward's public key
    (`deid verify` and the card's no-deid commands); one flipped image byte and one flipped attestation byte
    are caught with their exit codes; no source subject id of the drop is anywhere in the release."""
    from deid.release.attestation import ATTESTATION_NAME, ATTESTATION_SIG_NAME

    assert demo.run is not None and demo.run.returncode == 0, demo.run and demo.run.stderr[-3000:]
    release = Path(_printed(demo.run.stdout, "release"))
    pub = demo.project / "data" / "keys" / "dev_signing.pub.pem"
    assert _printed(demo.run.stdout, "verify release") == f"deid verify {release} --public-key {pub}"
    report = json.loads(Path(_printed(demo.run.stdout, "signed report")).read_text())
    # The steward's signed report lists the attestation's two files too.
    assert {ATTESTATION_NAME, ATTESTATION_SIG_NAME} <= {a["path"] for a in report["artifacts"]}
    att = json.loads((release / ATTESTATION_NAME).read_text())
    assert (att["verdict"], att["k"], att["release_id"]) == ("released", 5, report["release_id"])
    assert att["file_manifest"]["sha256"] == report["file_manifest"]["sha256"]

    def verify(root: Path) -> subprocess.CompletedProcess:
        return subprocess.run([*demo.exe, "verify", str(root), "--public-key", str(pub)], cwd=tmp_path,
                              env=demo.env, capture_output=True, text=True, timeout=300)

    _recipient_verifies(release, pub, verify, tmp_path, k=5)

    # Every source subject id of the drop: in no file of the release (bytes), and in no report either.
    with open(demo.drop / "manifest.csv", newline="", encoding="utf-8") as fh:
        ids = sorted({row["subject_id"] for row in csv.DictReader(fh)})
    assert len(ids) == 60
    assert _bytes_found(release, ids) == []
    assert identifying_text_in_reports(demo.project / "reports", ids) == []


def _recipient_verifies(release: Path, pub: Path, verify, tmp_path: Path, *, k: int) -> None:
    """What a recipient does with only the release directory, copied elsewhere: it verifies with the steward's
    public key (``verify(root)``: `deid verify ROOT --public-key PUB`, and the card's no-deid commands), and one
    flipped image byte (exit 6) and one flipped attestation byte (k -> k^1, exit 3) are caught both ways."""
    from helpers import run_no_deid_check

    from deid.release.attestation import ATTESTATION_NAME

    copies = {}
    for name in ("intact", "image", "attestation"):
        copies[name] = tmp_path / name / "received"
        shutil.copytree(release, copies[name])
    ok = verify(copies["intact"])
    assert ok.returncode == 0 and "OK: ATTESTATION.json signature and every file of the release verified" in \
        ok.stdout, ok.stdout + ok.stderr
    runs = run_no_deid_check(copies["intact"], pub)
    assert [r.returncode for r in runs] == [0, 0, 0, 0], [(r.stdout, r.stderr) for r in runs]

    image = sorted((copies["image"] / "images").iterdir())[0]
    data = bytearray(image.read_bytes())
    data[len(data) // 2] ^= 0x01
    image.write_bytes(bytes(data))
    bad = verify(copies["image"])
    assert bad.returncode == 6 and f"hash mismatch images/{image.name}" in bad.stdout, bad.stdout + bad.stderr
    assert [r.returncode != 0 for r in run_no_deid_check(copies["image"], pub)] == [False, False, True, False]

    path = copies["attestation"] / ATTESTATION_NAME
    data = bytearray(path.read_bytes())
    data[data.index(f'"k":{k}'.encode()) + 4] ^= 0x01  # k=5 -> k=4: still canonical JSON, only the signature catches it
    path.write_bytes(bytes(data))
    bad = verify(copies["attestation"])
    assert bad.returncode == 3 and "bad signature" in bad.stdout, bad.stdout + bad.stderr
    assert [r.returncode != 0 for r in run_no_deid_check(copies["attestation"], pub)] == [True, False, False, True]


def _bytes_found(root: Path, needles) -> list[str]:
    """``"<file>: <needle>"`` for every needle found in the bytes of any file under ``root`` (the images too)."""
    coded = [n.encode() for n in needles]
    return [f"{p.relative_to(root)}: {n!r}" for p in sorted(root.rglob("*")) if p.is_file()
            for blob in [p.read_bytes()] for n in coded if n in blob]


def test_failed_gate_publishes_nothing_but_signs_a_rejection(project, prefect_server, tmp_path):
    # 14 people split by gender: at k=8 at least one gender x expression partition is too small.
    drop = make_synthetic_drop(tmp_path / "drop", people=14, images_per_person=2, seed=5)
    result = _run(drop, k=8, small_partitions="fail")
    assert result["verdict"] == "rejected"
    assert result["release_dir"] is None
    assert any("small_partitions" in r for r in result["reasons"])
    assert_nothing_published(project / "data" / "releases")
    report = json.loads(Path(result["report"]).read_text())
    assert report["verdict"] == "rejected" and report["artifacts"] == []
    res = verify_report(Path(result["report_dir"]), public_key=Path(result["public_key"]))
    assert res.ok and res.authenticated


@pytest.fixture
def quick_recogniser(monkeypatch):
    """For tests whose subject is not the recogniser's figures: the deep recogniser (~0.1 s of CPU a
    face) attacks a 20-record sample and the earlier utility protocols (report evidence only) run
    once. The gate still runs every check and attacker. The demo run keeps the defaults."""
    monkeypatch.setenv("DEID_DEEP_ATTACK_SAMPLE", "20")
    monkeypatch.setenv("DEID_MIN_PROBES", "4")  # the 20-record deep sample: 4 clusters, not grown
    monkeypatch.setenv("DEID_CV_REPEATS", "1")


@pytest.fixture
def no_face_embed(monkeypatch, quick_recogniser):
    """... and no recogniser identity check: on synthetic faces it finds the recogniser uninformative
    and only matches near-copies (the demo run and the fake-ids test run it)."""
    monkeypatch.setenv("DEID_IDENTITY_EMBED_MAX", "0")


def _as_sequences(drop: Path) -> None:
    """Make each person's two photos one image sequence (frames 0 and 1): the manifest's sequence/frame columns."""
    lines = (drop / "manifest.csv").read_text().splitlines()
    frame: dict[str, int] = {}
    rows = []
    for line in lines[1:]:
        subject = line.split(",")[1]
        frame[subject] = frame.get(subject, -1) + 1
        rows.append(f"{line},q-{subject},{frame[subject]}")
    (drop / "manifest.csv").write_text("\n".join([lines[0] + ",sequence,frame", *rows]) + "\n")


def test_bad_files_are_quarantined_and_counted(project, prefect_server, tmp_path, no_face_embed):
    # An image-sequence drop (issue 14): the Prefect flow carries the sequence columns to the stage,
    # which writes one video per sequence, and the gate judges how the videos link frames.
    drop = make_synthetic_drop(tmp_path / "drop", people=30, images_per_person=2, seed=2)
    _as_sequences(drop)
    (drop / "images" / "junk.png").write_bytes(b"not an image at all")
    (drop / "images" / "trunc.jpg").write_bytes(b"\xff\xd8\xff\xe0" + os.urandom(200))
    with open(drop / "manifest.csv", "a") as fh:  # still images (no sequence, no frame)
        fh.write("images/junk.png,s90001,male,neutral,,,,,,\n")
        fh.write("images/trunc.jpg,s90002,female,smile,,,,,,\n")
        fh.write("images/nowhere.png,s90003,female,smile,,,,,,\n")
        fh.write("../escape.png,s90004,female,smile,,,,,,\n")
    result = _run(drop, k=3)
    ds = result["dataset"]
    assert ds["records_in"] == 64
    assert ds["records_quarantined"] == 4
    assert ds["quarantine_by_reason"] == {"unsupported_format": 1, "corrupt_image": 1, "missing_file": 1,
                                          "unsafe_path": 1}
    # 4 of 64 quarantined is above DEID_MAX_QUARANTINE_FRACTION (0.05): rejected, the rest withheld.
    assert ds["records_released"] + ds["records_withheld"] + ds["records_suppressed"] + ds["records_quarantined"] == 64
    staging = Path(result["staging"])
    q = pq.read_table(staging / "quarantine.parquet").to_pydict()
    assert sorted(q["code"]) == sorted(["unsupported_format", "corrupt_image", "missing_file", "unsafe_path"])
    # The gate's progress lines (the core's deid.progress logger) are on the run's page in the Prefect UI.
    report = json.loads(Path(result["report"]).read_text())
    msgs = _run_log_messages(report["run_id"])
    assert any(m.startswith("gate: attacks on ") for m in msgs)
    # ... a progress artifact per long stage, each at 100% once its stage ended, on the run's page ...
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    with get_client(sync_client=True) as client:
        bars = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[report["run_id"]]), type=ArtifactFilterType(any_=["progress"])))
        run = client.read_flow_run(report["run_id"])
    keys = {a.key: a for a in bars}
    assert keys.keys() >= {"deid-progress-align", "deid-progress-gate-attacks"}, keys.keys()
    assert keys["deid-progress-gate-attacks"].data == 100.0 == keys["deid-progress-align"].data, keys
    # ... and its Parameters tab holds the values used: drop.yaml's labels, only the method's parameters.
    assert run.parameters["labels"] == report["configuration"]["labels"] and run.parameters["labels"]
    assert run.parameters["k"] == 3 and "sigma" not in run.parameters and "block" not in run.parameters
    # The 30 sequences of 2 frames reached the method and the stage (one video per staged sequence) ...
    assert report["configuration"]["method_inputs"] == {"points": 0, "sequences": 30, "frames": 60,
                                                        "shape_sources": {}}
    staged = [re.search(r"stage: (\d+) records staged for release in .*, (\d+) videos$", m) for m in msgs]
    (n_staged, n_videos), = [tuple(map(int, m.groups())) for m in staged if m]
    assert n_staged == 60 - ds["records_suppressed"] and 0 < n_videos <= 30
    # ... and the gate judged the videos' linkage with its bound (k-Same-Select clusters each frame apart).
    link = next(c for c in report["checks"] if c["name"] == "sequence_linkage_people")
    assert link["threshold"] == ">= 3" and link["passed"] == (link["value"] >= 3)


def _run_log_messages(run_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    return [log.message for log in logs]


def _greppable_london_ids(drop: Path) -> tuple[list[str], list[str]]:
    """Give London's people ids a grep can find, and return them with the source file stems.

    London's subject ids are three digits (001-173): as text they are everywhere in a report (102 people,
    0.120, a hash), so a grep for them finds nothing or everything. Each person keeps their number in a
    distinctive id (``london-001``); the source file names carry the bare number, and their stems
    (``001_03``, ``001_08``: digits, an underscore, digits) are as greppable as they are.
    """
    path = drop / "manifest.csv"
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        r["subject_id"] = f"london-{r['subject_id']}"
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    stems = {Path(r[c]).stem for r in rows for c in ("image", "points") if r.get(c)}
    return sorted({r["subject_id"] for r in rows}), sorted(stems)


@pytest.mark.london
def test_london_k5_k_same_select_is_released(project, prefect_server, london_dir, tmp_path):
    """London at k=5 is released, and (issue 29 item 8) a recipient verifies it from the release directory alone;
    no London subject id is in the release, in any report (of this run and of a rejected one) or artifact."""
    from deid.intake.london import import_london

    drop = import_london(london_dir, tmp_path / "london")
    ids, stems = _greppable_london_ids(drop)
    assert len(ids) == 102 and len(stems) == 204  # two photos per person (a .tem file is named as its photo)
    manifest = (drop / "manifest.csv").read_text()
    assert all(n in manifest for n in (*ids, *stems))  # what the searches below look for is what the run read
    result = _run(drop, k=5, method="k-same-select")
    assert result["verdict"] == "released", result["reasons"]
    assert result["dataset"]["records_in"] == 204
    assert result["privacy"]["max_rate"] <= 0.2
    gender = next(u for u in result["utility"] if u["label"] == "gender")
    assert gender["deidentified_accuracy"] >= gender["original_accuracy"] - 0.05
    _check_release_invariants(result, k=5, drop=drop)
    # The Prefect UI shows the verdict, the checks and a link to the HTML report on the run.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    run_id = json.loads(Path(result["report"]).read_text())["run_id"]
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    assert {a.key for a in arts} >= {"deid-verdict", "deid-checks", "deid-report"}
    pub = Path(result["public_key"])
    # The recipient's side: the release directory alone, copied elsewhere, verified both ways; tampering caught.
    release = Path(result["release_dir"])
    _recipient_verifies(release, pub, lambda root: subprocess.run(
        [sys.executable, "-m", "deid.cli", "verify", str(root), "--public-key", str(pub)], capture_output=True,
        text=True, cwd=tmp_path, timeout=300), tmp_path / "recipient", k=5)
    # No London subject id, nor a source file name (which carries it), in any file of the release, nor in any
    # report of the project: this release's and a rejected run's (k above the people), their report.html,
    # validation pages and the catalogue, nor in either run's Prefect artifacts.
    rejected = _run(drop, k=200)
    assert rejected["verdict"] == "rejected" and rejected["release_dir"] is None, rejected["reasons"]
    needles = [*ids, *stems]
    assert _bytes_found(release, needles) == []
    assert identifying_text_in_reports(project / "reports", needles, must_read=(
        f"{result['release_id']}/report.json", f"{result['release_id']}/report.html",
        f"{result['release_id']}/validation/index.html", f"{rejected['release_id']}/report.json",
        f"{rejected['release_id']}/report.html", "index.html")) == []
    rejected_run = json.loads(Path(rejected["report"]).read_text())["run_id"]
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id, rejected_run])))
    assert {a.key for a in arts} >= {"deid-verdict", "deid-checks"} and len({a.flow_run_id for a in arts}) == 2
    shown = [f"{a.key}: {n}" for a in arts for n in needles if n in f"{a.description} {a.data}"]
    assert shown == []
    cli = [sys.executable, "-m", "deid.cli", "verify", result["report_dir"], "--public-key", str(pub)]
    ok = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    victim = sorted((Path(result["release_dir"]) / "images").iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 6 and "hash mismatch" in bad.stdout


@pytest.fixture
def london_drop(london_dir, tmp_path):
    """London as a drop (files linked, ~0.1 s), per test."""
    from deid.intake.london import import_london

    return import_london(london_dir, tmp_path / "london")


@pytest.mark.london
def test_london_gate_rejects_k_same_naive_and_publishes_nothing(project, prefect_server, london_drop, monkeypatch):
    """Issues 4 and 9: at k=5 the flow rejects k-Same-naive on privacy (London) and publishes nothing.

    Blur (sigma 4) and pixelation (block 6) are rejected by the same gate in
    tests/integration/study/test_study.py::test_london_study_supports_the_issue_claims, without a flow run each.
    """
    # Who-is-who is not the question here (London's ids are clean; test_london_k5 runs the
    # recogniser identity check): skip its per-face embedding to keep the suite fast. The real gate
    # decides, with every attacker; the deep recogniser (~0.09 s a face) attacks a 20-record sample
    # and the earlier utility protocols (report evidence only) run once: the rejection is decided
    # by the exact person share asserted below.
    monkeypatch.setenv("DEID_IDENTITY_EMBED_MAX", "0")
    monkeypatch.setenv("DEID_DEEP_ATTACK_SAMPLE", "20")
    monkeypatch.setenv("DEID_MIN_PROBES", "4")  # the 20-record deep sample: 4 clusters, not grown
    monkeypatch.setenv("DEID_CV_REPEATS", "1")
    result = _run(london_drop, k=5, method="k-same-naive")
    assert result["verdict"] == "rejected"
    assert result["release_dir"] is None
    assert_nothing_published(project / "data" / "releases")
    report = json.loads(Path(result["report"]).read_text())
    rows = report["privacy"]["reidentification"]
    assert {r["attacker"] for r in rows} >= {"pca-mahalanobis", "pca-whitened-cosine", "fisherfaces", "lbp-chi2",
                                             "release-refit-pca", "dlib-resnet"}
    assert {r["mode"] for r in rows} == {"naive", "reverse", "parrot"}
    for r in rows:  # every rate carries its interval and sample size
        assert 0 <= r["lower"] <= r["rate"] <= r["upper"] <= 1 and r["n_probes"] > 0
    assert report["guarantee"].startswith("no formal guarantee"), report["guarantee"]
    checks = {c["name"]: c for c in report["checks"]}
    failed = {name for name, c in checks.items() if not c["passed"]}
    assert all(c["status"] in ("pass", "fail", "inconclusive", "not_applicable") for c in checks.values())
    # Counting images, not people, lets one person hold two of a cluster's images: the exact bound
    # (largest one-person share) exceeds 1/k and decides.
    assert report["privacy"]["exact_bound"] is True
    assert "max_person_share" in failed and report["privacy"]["max_person_share"] > 0.2


# Issue 9: drops shaped like real ones (built with `deid synth` options) are released at k=5,
# possibly with utility inconclusive, and none is refused as bad input.
DROP_SHAPES = {
    "one-photo-per-person": dict(people=40, images_per_person=1, seed=1),
    "many-per-person-11-valued-label": dict(people=15, images_per_person=11, condition_values=11, image_format="gif",
                                            eyes=False, seed=2),
    "tight-small-grey-pgm-no-labels": dict(people=25, images_per_person=4, crop="tight", image_size=64,
                                           image_format="pgm", labels=False, eyes=False, seed=3),
    # (20 people x 3 tight GIFs *with* gender x expression labels was rejected: cells of ~5 people at
    # k=5 lose the smile, cross-fit delta +0.24 [+0.10, +0.38]. A fair verdict on so little data.)
    "tight-small-grey-gif-no-labels": dict(people=40, images_per_person=3, crop="tight", image_size=64,
                                           image_format="gif", grey=True, labels=False, eyes=False, seed=4),
}


@pytest.mark.parametrize("shape", sorted(DROP_SHAPES))
def test_real_drop_shapes_are_released(project, prefect_server, tmp_path, shape, no_face_embed):
    drop = make_synthetic_drop(tmp_path / shape, **DROP_SHAPES[shape])
    result = _run(drop, k=5)
    assert result["verdict"] == "released", result["reasons"]
    report = json.loads(Path(result["report"]).read_text())
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert all(s != "fail" for s in statuses.values()), statuses
    # Utility is decided, inconclusive (a warning with its numbers) or not applicable (no labels).
    util = {n: s for n, s in statuses.items() if n.startswith("utility")}
    assert util and all(s in ("pass", "inconclusive", "not_applicable") for s in util.values())
    if not DROP_SHAPES[shape].get("labels", True):
        assert util == {"utility": "not_applicable"}
    assert len(report.get("warnings", [])) == sum(s == "inconclusive" for s in util.values())
    # Landmarks or manifest eyes align nearly everything; the face-box guess stays rare.
    sources = report["configuration"]["eye_sources"]
    assert sources.get("face_geometry", 0) <= 0.02 * sum(sources.values())
    assert report["privacy"]["max_person_share"] <= 0.2


# Issue 26: the web-photo set that collapsed into one face per gender (24 people with 2 to 47 photos).
SKEWED_COUNTS = (47, 40, 33, 28, 24, 20, 17, 14, 12, 10, 9, 8, 7, 6, 5, 5, 4, 4, 3, 3, 3, 2, 2, 2)


def skewed_drop(path: Path, counts=SKEWED_COUNTS, *, seed: int = 26) -> Path:
    """`deid synth` with max(counts) photos each, then a subset of its manifest: person i keeps counts[i]."""
    drop = make_synthetic_drop(path, people=len(counts), images_per_person=max(counts), seed=seed, fast=True,
                               image_size=100)
    lines = (drop / "manifest.csv").read_text().splitlines()
    head = lines[0].split(",")
    col_subject, col_path = head.index("subject_id"), head.index("image")
    order = list(dict.fromkeys(line.split(",")[col_subject] for line in lines[1:]))
    kept, seen = [], defaultdict(int)
    for line in lines[1:]:
        fields = line.split(",")
        who = fields[col_subject]
        if seen[who] < counts[order.index(who)]:
            seen[who] += 1
            kept.append(line)
        else:
            (drop / fields[col_path]).unlink()
    (drop / "manifest.csv").write_text("\n".join([lines[0], *kept]) + "\n")
    return drop


def test_skewed_photo_counts_keep_every_partition(project, prefect_server, tmp_path, no_face_embed):
    """Issue 26: today 2 faces for the whole drop (one cluster per gender); now each gender keeps >= 0.8 x
    floor(records/k) clusters, every cluster >= k people, and the report states per partition the clusters
    formed against the feasible maximum."""
    drop = skewed_drop(tmp_path / "skewed")
    result = _run(drop, k=5, labels=["gender"])
    report = json.loads(Path(result["report"]).read_text())
    grouping = report["privacy"]["partitions"]
    assert len(grouping) == 2 and sum(g["records"] for g in grouping) == result["dataset"]["records_released"]
    for g in grouping:
        assert g["feasible_max"] == g["records"] // 5
        assert g["clusters"] >= 0.8 * g["feasible_max"], grouping
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["partition_clusters"]["passed"] and checks["partition_clusters"]["value"] >= 0.8
    assert report["privacy"]["min_distinct_people_per_cluster"] >= 5
    assert report["privacy"]["max_person_share"] <= 0.2
    # Every cross-fit fold used (today 0 of 15), and no headline rate from fewer than DEID_MIN_PROBES probes.
    cross = [u for u in report["utility"] if u.get("protocol") == "cross-fit"]
    assert cross and all(u["folds_run"] > 0 and u["folds_skipped"] == 0 for u in cross), cross
    headline = [r for r in report["privacy"]["reidentification"] if r["rate"] == report["privacy"]["max_rate"]]
    assert headline and all(r.get("status") != "insufficient_evidence" for r in headline), headline
    minimum = report["privacy"]["attack_sample"].get("min_probes")
    assert minimum and all(r["n_probes"] >= minimum for r in headline), headline


def test_one_face_under_five_fake_ids_is_one_person(project, prefect_server, tmp_path, quick_recogniser):
    """Issue 9: one photograph, lightly noised, listed under five fake subject ids, is one person."""
    import numpy as np

    drop = make_synthetic_drop(tmp_path / "dup", people=40, images_per_person=1, seed=5)
    lines = (drop / "manifest.csv").read_text().splitlines()
    header, first = lines[0], lines[1].split(",")
    src = cv2.imread(str(drop / first[0]), cv2.IMREAD_COLOR)
    rng = np.random.default_rng(0)
    extra = []
    for i in range(5):
        noisy = np.clip(src.astype(int) + rng.normal(0, 2, src.shape), 0, 255).astype(np.uint8)
        name = f"images/fake{i}.png"
        cv2.imwrite(str(drop / name), noisy)
        extra.append(",".join([name, f"Fake-ID-{i}", *first[2:]]))
    (drop / "manifest.csv").write_text("\n".join([header, *lines[1:], *extra]) + "\n")
    result = _run(drop, k=5)
    report = json.loads(Path(result["report"]).read_text())
    identity = report["configuration"]["identity"]
    assert identity["people"] == 40
    assert identity["records_in_face_merges"] == 6
    # Issue 28: the merges are named by their records' staging ids, never by subject id (nor a fake one).
    assert identity["examples"] and all(r.startswith("r") and "ids" not in m
                                        for m in identity["examples"] for r in m["records"])
    subjects = {line.split(",")[1] for line in lines[1:]} | {f"Fake-ID-{i}" for i in range(5)}
    subjects |= {s.casefold() for s in subjects}  # as normalised for matching
    leaked = identifying_text_in_reports(project / "reports", sorted(subjects))
    assert not leaked, f"subject ids in a report: {leaked[:10]}"
    # Released: that person may hold at most 1/k of any cluster, so the surplus copies were withheld.
    assert result["verdict"] == "released", result["reasons"]
    assert report["privacy"]["max_person_share"] <= 0.2
    assert report["dataset"]["records_suppressed"] >= 1


def test_near_identical_frames_are_not_dealt_alongside_the_same_people(project, prefect_server, tmp_path,
                                                                       no_face_embed, monkeypatch):
    """Issue 26's frames case: 48-pixel crops, 3 near-identical consecutive frames per image, frames not declared
    as sequences (the real set's shape). The greedy alone dealt each person's frames into clusters alongside the
    same other people (bench/bench_frames_grouping.py: 105 of 181 clusters of 61 people x 5 images shared their
    person-set); now no two clusters of a partition share one, and every rule holds."""
    monkeypatch.setenv("DEID_KEEP_STAGING", "last:1")
    drop = make_synthetic_drop(tmp_path / "frames", people=24, images_per_person=3, crop="tight", image_size=48,
                               frames_per_sequence=3, frame_jitter="small", seed=26)
    rows = list(csv.reader((drop / "manifest.csv").open()))
    keep = [i for i, c in enumerate(rows[0]) if c not in ("sequence", "frame")]
    with open(drop / "manifest.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([[r[i] for i in keep] for r in rows])
    result = _run(drop, k=5, labels=["expression"])
    staging = Path(result["staging"])
    parts = pq.read_table(staging / "partitions", columns=["record_id", "subject_id"]).to_pydict()
    person = dict(zip(parts["record_id"], parts["subject_id"]))
    files = sorted((staging / "deidentified").glob("*.parquet"))
    assert len(files) == 2  # one per expression
    for part in files:  # a person's images may be in both partitions: person-sets are compared within one
        deid = pq.read_table(part, columns=["record_id", "cluster"]).to_pydict()
        members: dict[str, list] = defaultdict(list)
        for r, c in zip(deid["record_id"], deid["cluster"]):
            members[c].append(person[r])
        assert len(members) >= 0.95 * (len(deid["record_id"]) // 5)  # the feasible maximum, issue 26's margin
        for who in members.values():
            assert len(set(who)) >= 5 and max(who.count(p) for p in who) * 5 <= len(who)
        sets = [frozenset(who) for who in members.values()]
        assert len(set(sets)) == len(sets), f"two clusters of {part.name} hold the same people"
    report = json.loads(Path(result["report"]).read_text())
    assert report["privacy"]["min_distinct_people_per_cluster"] >= 5 and report["privacy"]["max_person_share"] <= 0.2
