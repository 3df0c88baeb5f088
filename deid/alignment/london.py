"""The London set aligned in memory: every front photo warped to the canonical face, read in place.

For tests and benchmarks that need real faces without a drop on disk (the London set is never
copied into the repository). The set's layout is read by :mod:`deid.intake.london`; the photos are
aligned as the pipeline aligns (:class:`deid.alignment.canonical.FaceAligner`).

References
----------
DeBruine, L., & Jones, B. (2017). Face Research Lab London Set (Version 5). figshare.
doi:10.6084/m9.figshare.5047666.v5 (CC BY 4.0).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from deid.alignment.canonical import FaceAligner
from deid.alignment.eyes import EyePair
from deid.errors import RecordError
from deid.intake.imaging import decode_gray
from deid.intake.london import london_photos

__all__ = ["AlignedLondon", "align_london"]


class AlignedLondon(NamedTuple):
    """Aligned faces (one flattened row each, read-only) and, row for row, their person, gender and expression."""

    faces: np.ndarray
    people: list[str]
    gender: list[str]
    expression: list[str]  # neutral | smile (deid.intake.london.FOLDERS)


def align_london(src: str | os.PathLike, aligner: FaceAligner | None = None) -> AlignedLondon:
    """Every front photo of the London set at ``src`` aligned (by default with :class:`FaceAligner`: the canonical grey face).

    Pupils come from the .tem files (neutral photos), the aligner's eye detection otherwise
    (smiling); a photo whose eyes cannot be found is skipped. Rows are in
    :func:`deid.intake.london.london_photos` order (neutral photos first, by file name).
    """
    aligner = FaceAligner() if aligner is None else aligner
    faces, people, gender, expression = [], [], [], []
    for photo in london_photos(src):
        eyes = None if photo.eyes is None else EyePair(*photo.eyes)
        try:
            face = aligner.align(decode_gray(photo.path.read_bytes()), eyes)
        except RecordError:
            continue
        faces.append(face.image.reshape(-1))
        people.append(photo.person)
        gender.append(photo.gender)
        expression.append(photo.expression)
    out = np.array(faces)
    out.setflags(write=False)
    return AlignedLondon(out, people, gender, expression)
