"""Issue 27 item 4 on the London set: a lineage registry rolled back, then bypassed.

Usage: .venv/bin/python bench/bench_lineage_rollback.py [--london PATH] [--out DIR] [--leaving N]

Builds three drops of one dataset under ``--out`` (hard links to the London photos where the file
system allows, else copies; never inside the repo): release 1 is London without its last ``N``
people, release 2 all of London, release 3 London without one of those ``N``. The registry is copied
after release 1, release 2 is published, the copy is restored and release 3 is run: it must be
refused (a signed ``state`` rejection, exit 70 from the CLI). Then the registry check is bypassed in
this process (as an older deid without the anchor would run) and release 3 is run again: the
gate's ``lineage_published_differencing`` check must find the person who left (her neutral and
smiling faces: two clusters of release 2 that release 3 repeats without her), while
``lineage_differencing_attack`` (the registry's view) finds nothing. The steward's linkage record
of release 2 names who is missing from each matched cluster.

Quick settings (no recogniser identity check, 20-record deep sample, one CV repeat), k=5.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import deid.release.lineage_anchor as anchor  # noqa: E402
import deid.release.lineage_checks as lineage_checks  # noqa: E402
from deid.cli import exit_code_for  # noqa: E402
from deid.errors import StateError  # noqa: E402
from deid.intake.london import import_london  # noqa: E402
from deid.operations.runner import run_release  # noqa: E402
from deid.release.linkage import linkage_path, load_linkage_key, read_linkage  # noqa: E402
from deid.release.lineage_registry import lineage_dir  # noqa: E402
from deid.run_config import RunConfig  # noqa: E402
from deid.settings import Settings  # noqa: E402
from london_set import add_london_option, london_dir  # noqa: E402

DATASET = "london-rollback"


def _link_tree(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        try:
            os.link(p, dst / p.name)
        except OSError:
            shutil.copy2(p, dst / p.name)


def _drops(full: Path, out: Path, leaving: int) -> tuple[Path, Path, Path, str]:
    rows = list(csv.DictReader(open(full / "manifest.csv", newline="", encoding="utf-8")))
    subjects = sorted({r["subject_id"] for r in rows})
    later, leaver = set(subjects[-leaving:]), subjects[-1]
    made = []
    for name, without in (("r1", later), ("r2", set()), ("r3", {leaver})):
        d = out / name
        for sub in {r["image"].split("/")[0] for r in rows}:
            _link_tree(full / sub, d / sub)
        with open(d / "manifest.csv", "w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(r for r in rows if r["subject_id"] not in without)
        (d / "drop.yaml").write_text((full / "drop.yaml").read_text() + f"dataset: {DATASET}\n")
        (d / "_READY").touch()
        made.append(d)
    return made[0], made[1], made[2], leaver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_london_option(ap)
    ap.add_argument("--out", required=True, help="a scratch directory outside the repo")
    ap.add_argument("--leaving", type=int, default=12)
    args = ap.parse_args()
    out = Path(args.out)
    full = out / "all"
    if not (full / "manifest.csv").exists():
        import_london(london_dir(args.london), full)
    r1d, r2d, r3d, leaver = _drops(full, out, args.leaving)
    config = RunConfig.resolve(Settings(project_dir=out / "project", identity_embed_max=0, deep_attack_sample=20,
                                        cv_repeats=1), k=5)
    t0 = time.time()
    r1 = run_release(r1d, config)
    print(f"release 1: {r1.verdict} ({time.time() - t0:.0f} s)")
    reg = lineage_dir(config.data_path, DATASET)
    shutil.copytree(reg, out / "registry-after-1", dirs_exist_ok=True)
    r2 = run_release(r2d, config)
    print(f"release 2: {r2.verdict}, registry_head {r2.report.lineage['registry_head']}")
    shutil.rmtree(reg)
    shutil.copytree(out / "registry-after-1", reg)
    try:
        run_release(r3d, config)
        print("release 3 on the restored registry: NOT REFUSED")
    except StateError as exc:
        print(f"release 3 on the restored registry: refused, exit {exit_code_for(exc)}: {exc}")
    anchor.check_registry_head = lambda *a, **kw: None   # bypassed, as an older deid would run
    found = []
    attack = lineage_checks.published_differencing_attack

    def keep(*a, **kw):
        found.append(attack(*a, **kw))
        return found[-1]

    lineage_checks.published_differencing_attack = keep
    r3 = run_release(r3d, config)
    print(f"release 3 with the registry bypassed: {r3.verdict}")
    for c in r3.report.checks:
        if c.name in ("lineage_differencing_attack", "lineage_published_differencing"):
            print(f"  {c.name}: passed={c.passed} value={c.value}: {c.detail}")
    rows = read_linkage(linkage_path(config.data_path, r2.release_id),
                        load_linkage_key(config.data_path / "keys" / "dev_linkage.key"))
    for m in found[0].matches if found else ():
        cid = m.registered.split("/")[1]
        members = sorted(r["source_image"] for r in rows if r["cluster_id"] == cid)
        print(f"  match {m.kind} sizes {m.sizes}: release 2 cluster of {len(members)}; person {leaver} in it: "
              f"{any(s.split('/')[-1].startswith(leaver + '_') for s in members)}")


if __name__ == "__main__":
    main()
