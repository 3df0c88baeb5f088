"""Arrow schemas of the staging tables and the release table."""
from __future__ import annotations

import pyarrow as pa

QUARANTINE = pa.schema(
    [
        pa.field("record_id", pa.string(), nullable=False),
        pa.field("image", pa.string()),
        pa.field("code", pa.string(), nullable=False),
        pa.field("message", pa.string(), nullable=False),
        pa.field("stage", pa.string(), nullable=False),
    ]
)

EYES = [
    pa.field("eye_left_x", pa.float64()),
    pa.field("eye_left_y", pa.float64()),
    pa.field("eye_right_x", pa.float64()),
    pa.field("eye_right_y", pa.float64()),
]


# Landmarks flattened (x0, y0, x1, y1, ...): source pixels when ingested, canonical pixels once aligned.
POINTS = pa.field("points", pa.list_(pa.float64()))
# Image sequences: the steward's sequence id (private, never released) and the frame's position.
SEQUENCE = [pa.field("sequence", pa.string()), pa.field("frame", pa.int64())]
# A video frame's face box as tracked (x, y, width, height in the staged crop's pixels; null = a still).
FACE_BOX = pa.field("face_box", pa.list_(pa.float64()))
# A video frame's eyes as ingest found or followed them (left x, y, right x, y in the staged crop's pixels, then
# 1.0 when moved with the face from its detection frame, 0.0 when found there; null = alignment finds them).
FRAME_EYES = pa.field("frame_eyes", pa.list_(pa.float64()))


def ingested(labels: list[str], *, points: bool = False, sequences: bool = False, videos: bool = False,
             video_eyes: bool = False) -> pa.Schema:
    """Raw records: ids, labels, manual eye points (null = detect), source hash, size and bytes.

    ``points``: the drop has a points column (null = no landmarks for that record);
    ``sequences``: the drop has sequence/frame columns (null = a still image);
    ``videos``: the drop names video files, whose frames carry their tracked ``face_box``;
    ``video_eyes``: and their eyes as ingest found or followed them (``frame_eyes``).
    """
    return pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),
            pa.field("image", pa.string(), nullable=False),
            pa.field("subject_id", pa.string(), nullable=False),
            *[pa.field(x, pa.string(), nullable=False) for x in labels],
            *EYES,
            *([POINTS] if points else []),
            *(SEQUENCE if sequences else []),
            *([FACE_BOX] if videos else []),
            *([FRAME_EYES] if video_eyes else []),
            pa.field("source_sha256", pa.string(), nullable=False),
            pa.field("size", pa.int64(), nullable=False),
            pa.field("data", pa.large_binary(), nullable=False),
        ]
    )


def aligned(*, points: bool = False, yaw: bool = False) -> pa.Schema:
    """Aligned canonical faces (uint8, row-major height x width), the eyes used, with ``points`` the
    landmarks moved to canonical pixels by the same similarity as the face (null = none), and with
    ``yaw`` the estimated head yaw in degrees (deid.alignment.pose; null = not estimable)."""
    return pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),
            pa.field("pixels", pa.binary(), nullable=False),
            pa.field("eye_source", pa.string(), nullable=False),
            *EYES,
            *([POINTS] if points else []),
            *([pa.field("yaw", pa.float32(), nullable=True)] if yaw else []),
        ]
    )


def features(*, identity: bool = False) -> pa.Schema:
    """Eigenface features per record; ``identity``: also the identity first pass's (self-quotient) features."""
    return pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),
            pa.field("features", pa.list_(pa.float32()), nullable=False),
            *([pa.field("identity", pa.list_(pa.float32()), nullable=False)] if identity else []),
        ]
    )


def aligned_color() -> pa.Schema:
    """Aligned canonical faces in colour (uint8 BGR, row-major height x width x 3), DEID_COLOR only."""
    return pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),
            pa.field("color", pa.binary(), nullable=False),
        ]
    )


def deidentified(color: bool = False) -> pa.Schema:
    """De-identified faces: grey ``pixels`` (what the gate attacks) and, with colour, the BGR ``color``."""
    return pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),
            pa.field("cluster", pa.string(), nullable=False),
            *([pa.field("color", pa.binary(), nullable=False)] if color else []),
            pa.field("pixels", pa.binary(), nullable=False),
        ]
    )


# Columns a release may carry besides the utility labels; anything else is forbidden.
RELEASE_BASE_COLUMNS = ("record_id", "image", "cluster_id")
# The same for a feature release (release.parquet with the vectors in ``features``).
FEATURE_RELEASE_BASE_COLUMNS = ("record_id", "cluster_id", "features")
# Columns of a release of image sequences: a fresh random id per sequence and the frame's position.
RELEASE_SEQUENCE_COLUMNS = ("sequence_id", "frame")
FORBIDDEN_RELEASE_COLUMNS = ("subject_id", "source_sha256", "source_path", "path", "data", "size", "row")


def release(labels: list[str], *, sequences: bool = False) -> pa.Schema:
    """The release table; with ``sequences`` each frame's ``sequence_id`` (null for a still image) and ``frame``."""
    return pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),
            pa.field("image", pa.string(), nullable=False),
            pa.field("cluster_id", pa.string(), nullable=False),
            *[pa.field(x, pa.string(), nullable=False) for x in labels],
            *([pa.field("sequence_id", pa.string()), pa.field("frame", pa.int64())] if sequences else []),
        ]
    )


def feature_release(labels: list[str], dim: int) -> pa.Schema:
    """A feature release table: fresh random ids, random cluster ids, the labels, the de-identified vectors."""
    return pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),
            pa.field("cluster_id", pa.string(), nullable=False),
            *[pa.field(x, pa.string(), nullable=False) for x in labels],
            pa.field("features", pa.list_(pa.float32(), int(dim)), nullable=False),
        ]
    )


# Columns of image bytes and pixel rows, unique per row (dictionary encoding only wastes its page) and
# already compressed (source files: snappy + dictionary cost ~4x a JPEG decode per image, 4.7 ms vs
# 1.2 ms on London) or barely compressible (aligned pixels: snappy saved 8% of a part and made reading a
# part's pixels 3-4x slower, measured on a 100k drop's 512-face parts). Stored plain.
BLOB_COLUMNS = frozenset({"data", "pixels", "color"})


def writer_options(names) -> dict:
    """``pyarrow.parquet`` writer options of a staging table with these column names: blobs plain, the rest snappy."""
    names = list(names)
    return dict(compression={n: ("none" if n in BLOB_COLUMNS else "snappy") for n in names},
                use_dictionary=[n for n in names if n not in BLOB_COLUMNS])
