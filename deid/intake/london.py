"""Importer: the Face Research Lab London Set's published layout -> a deid drop.

DeBruine, L., & Jones, B. (2017). Face Research Lab London Set (Version 5). figshare.
https://doi.org/10.6084/m9.figshare.5047666.v5 (CC BY 4.0).
"""
from __future__ import annotations

import csv
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from deid.errors import ConfigError, DropError

log = logging.getLogger(__name__)

HEADER = ["image", "subject_id", "gender", "expression", "eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y",
          "points"]
FOLDERS = {"neutral": ("neutral_front", "03"), "smile": ("smiling_front", "08")}
# The set's licence and the attribution it requires (its README, "Licence and attribution"); the DOI without
# its address form, as the dataset card carries no address.
LICENSE = "cc-by-4.0"
CITATION = ("DeBruine, L., & Jones, B. (2017). Face Research Lab London Set (Version 5). figshare. "
            "doi:10.6084/m9.figshare.5047666.v5")


def read_tem_eyes(path: Path) -> tuple[tuple[float, float], tuple[float, float]]:
    """Pupil centres from a ``.tem`` template: point 0 is image-left, point 1 image-right."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    try:
        n = int(lines[0].strip())
        p0 = [float(v) for v in lines[1].split()[:2]]
        p1 = [float(v) for v in lines[2].split()[:2]]
    except (ValueError, IndexError) as exc:
        raise DropError(f"{path}: not a .tem landmark file (first line N, then N lines 'x<TAB>y'): {exc}") from exc
    if n < 2 or len(p0) != 2 or len(p1) != 2:
        raise DropError(f"{path}: a .tem file needs at least two points (the pupils); found {n}")
    if p0[0] > p1[0]:
        # The drop format's "left" eye is the one with the smaller x; keep that invariant.
        log.warning("%s: point 0 is right of point 1; swapping them so eye_left has the smaller x", path)
        p0, p1 = p1, p0
    return (p0[0], p0[1]), (p1[0], p1[1])


def _gender(value: str, where: str) -> str:
    v = value.strip().lower()
    if v in ("female", "f", "woman"):
        return "female"
    if v in ("male", "m", "man"):
        return "male"
    raise DropError(f"{where}: face_gender={value!r} is not male/female")


def _place(src: Path, dst: Path) -> None:
    """Hard link when possible (no copy of 92 MB), else copy; never a symlink (ingest rejects them)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def read_london_info(info_path: Path) -> dict[str, str]:
    """``london_info.csv``: each participant's 3-digit id -> gender (female/male)."""
    with open(info_path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        need = {"face_id", "face_gender"}
        if not need <= set(reader.fieldnames or []):
            raise DropError(f"{info_path}: needs columns {sorted(need)}; found {reader.fieldnames}")
        return {row["face_id"].strip().zfill(3): _gender(row["face_gender"], f"{info_path} face_id={row['face_id']}")
                for row in reader}


@dataclass(frozen=True)
class LondonPhoto:
    """One front photo of the London set where it lies (read in place, never copied)."""

    path: Path
    person: str  # the participant's 3-digit id (the file name's first three characters)
    gender: str  # female | male (london_info.csv)
    expression: str  # a key of FOLDERS: neutral | smile
    eyes: tuple[tuple[float, float], tuple[float, float]] | None  # the .tem pupils (left, right); None: detect


def london_photos(src: str | os.PathLike) -> list[LondonPhoto]:
    """Every front photo of the London set at ``src``: the neutral folder, then the smiling one, by file name.

    The order and the eyes are those the tests and benchmarks have always aligned (their London
    loader, :func:`deid.alignment.london.align_london`): a photo's pupils from its ``.tem`` file
    when it has one (:func:`read_tem_eyes`), else None (the aligner detects them).
    """
    src = Path(src)
    info = read_london_info(src / "london_info.csv")
    photos = []
    for expression, (folder, suffix) in FOLDERS.items():
        for f in sorted((src / folder).glob(f"*_{suffix}.jpg")):
            tem = f.with_suffix(".tem")
            person = f.name[:3]
            photos.append(LondonPhoto(f, person, info[person], expression, read_tem_eyes(tem) if tem.is_file() else None))
    return photos


def import_london(src: str | os.PathLike, drop_dir: str | os.PathLike, *, name: str = "london") -> Path:
    """Convert the London set at ``src`` into a drop at ``drop_dir``.

    The drop has labels ``gender`` (female/male, from ``london_info.csv``) and ``expression``
    (neutral/smile, from the folder), the neutral images' hand-placed pupil centres from their
    ``.tem`` files, and empty eye cells ("detect") for the smiling images, which have none. The
    neutral images' ``.tem`` files (189 hand-placed landmarks) are placed in the drop too and
    named in the ``points`` column (empty for the smiling images): k-Same-M takes its shape
    from them. drop.yaml states the set's licence (CC BY 4.0) and its citation, which the dataset
    card carries. ``_READY`` is written last.
    """
    src, drop = Path(src), Path(drop_dir)
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"name={name!r} must be a non-empty string (the drop's name in drop.yaml)")
    if not src.is_dir():
        raise DropError(f"src={str(src)!r} is not a directory; pass the London set's folder "
                        "(with london_info.csv, neutral_front/ and smiling_front/)")
    info_path = src / "london_info.csv"
    missing = [p for p in (info_path, src / "neutral_front", src / "smiling_front") if not p.exists()]
    if missing:
        raise DropError(f"{src} is not the London set's layout: missing {', '.join(str(m) for m in missing)}")
    if drop.exists() and (not drop.is_dir() or any(drop.iterdir())):
        raise ConfigError(f"drop directory {drop} exists and is not empty; choose a new directory")
    people = read_london_info(info_path)
    rows = []
    for sid, gender in sorted(people.items()):
        for expression, (folder, suffix) in FOLDERS.items():
            image = src / folder / f"{sid}_{suffix}.jpg"
            if not image.is_file():
                log.warning("London import: %s is missing; subject %s has no %s image", image, sid, expression)
                continue
            rel = f"{folder}/{sid}_{suffix}.jpg"
            eyes = ["", "", "", ""]
            points = ""
            tem = image.with_suffix(".tem")
            if expression == "neutral" and tem.is_file():
                (lx, ly), (rx, ry) = read_tem_eyes(tem)
                eyes = [f"{lx:.2f}", f"{ly:.2f}", f"{rx:.2f}", f"{ry:.2f}"]
                points = f"{folder}/{sid}_{suffix}.tem"
            rows.append([rel, sid, gender, expression, *eyes, points])
    if not rows:
        raise DropError(f"{src}: no images found under neutral_front/ or smiling_front/")
    # Every check above passed before anything is written, so a bad source leaves no half drop.
    for rel, *_, points in rows:
        _place(src / rel, drop / rel)
        if points:
            _place(src / points, drop / points)
    drop.mkdir(parents=True, exist_ok=True)
    with open(drop / "manifest.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(HEADER)
        writer.writerows(rows)
    with open(drop / "drop.yaml", "w", encoding="utf-8") as fh:
        yaml.safe_dump({"name": name, "labels": ["gender", "expression"], "license": LICENSE, "citation": CITATION},
                       fh, sort_keys=False, width=1000)
    # _READY last: consumers only pick up complete drops.
    (drop / "_READY").touch()
    log.info("London import: %d images of %d people into %s", len(rows), len(people), drop)
    return drop
