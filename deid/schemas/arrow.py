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


def ingested(labels: list[str]) -> pa.Schema:
    """Raw records: ids, labels, manual eye points (null = detect), source hash, size and bytes."""
    return pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),
            pa.field("image", pa.string(), nullable=False),
            pa.field("subject_id", pa.string(), nullable=False),
            *[pa.field(x, pa.string(), nullable=False) for x in labels],
            *EYES,
            pa.field("source_sha256", pa.string(), nullable=False),
            pa.field("size", pa.int64(), nullable=False),
            pa.field("data", pa.large_binary(), nullable=False),
        ]
    )


def aligned() -> pa.Schema:
    """Aligned canonical faces (uint8, row-major height x width) and the eyes used."""
    return pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),
            pa.field("pixels", pa.binary(), nullable=False),
            pa.field("eye_source", pa.string(), nullable=False),
            *EYES,
        ]
    )


def features() -> pa.Schema:
    return pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),
            pa.field("features", pa.list_(pa.float32()), nullable=False),
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
FORBIDDEN_RELEASE_COLUMNS = ("subject_id", "source_sha256", "source_path", "path", "data", "size", "row")


def release(labels: list[str]) -> pa.Schema:
    return pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),
            pa.field("image", pa.string(), nullable=False),
            pa.field("cluster_id", pa.string(), nullable=False),
            *[pa.field(x, pa.string(), nullable=False) for x in labels],
        ]
    )
