"""Error types and the stable quarantine reason codes shared by every stage.

The type says what to fix, and the CLI's exit code follows from it alone (``deid.cli.EXIT_BY_TYPE``):
:class:`ConfigError` for what the steward configured (a setting, a CLI option, a function parameter),
:class:`DataError` for the input data (a drop's manifest, files, labels, vectors; one bad record is
quarantined instead), :class:`StateError` for the project's stored state (registry, ledger, staging,
keys present but inconsistent), :class:`EnvironmentFailure` for the machine.
"""
from __future__ import annotations

from dataclasses import dataclass


class DeidError(Exception):
    """Base class of every error deid raises on purpose."""


class ConfigError(DeidError, ValueError):
    """Bad configuration: a setting, CLI option or parameter; the message names it, its value, the valid range and the fix."""


class DataError(DeidError, ValueError):
    """Input data that cannot be used as a whole (the run writes a signed rejection and exits 2)."""


class DropError(DataError):
    """A drop that cannot be processed at all (no manifest, not CSV, missing required column)."""


class StateError(DeidError):
    """The project's stored state forbids going on (a publish undone, keys or registry inconsistent, a ledger entry not claimed)."""


class EnvironmentFailure(DeidError):
    """The machine failed the run, not the data: disk full, I/O error, permission denied.

    Never a verdict on the data: the CLI gives it its own exit code. ``errno`` is the OS error
    number when there is one.
    """

    def __init__(self, message: str, *, errno: int | None = None):
        super().__init__(message)
        self.errno = errno

    @classmethod
    def from_oserror(cls, exc: OSError, *, doing: str) -> EnvironmentFailure:
        """Wrap ``exc`` with what was being done and what to do about it."""
        import errno as _errno  # noqa: PLC0415
        import os as _os  # noqa: PLC0415

        code = exc.errno
        what = _os.strerror(code) if code else str(exc)
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        hint = {_errno.ENOSPC: "free space on that filesystem and run again",
                _errno.EDQUOT: "raise the quota or free space and run again",
                _errno.EACCES: "fix the permissions of that location",
                _errno.EROFS: "that filesystem is read-only; point DEID_DATA_DIR / DEID_REPORTS_DIR elsewhere",
                _errno.EIO: "check the disk; an I/O error is not a property of the data"}.get(code, "run again")
        return cls(f"{doing}: {what}{where}; {hint}", errno=code)


class VerificationError(DeidError):
    """A signed report or release that does not verify (this base class: any problem not typed below)."""


class BadSignature(VerificationError):
    """The signature is malformed, missing its addendum signature, or does not match the signed bytes."""


class WrongKey(VerificationError):
    """The report names another signer than the trusted public key the verifier gave."""


class MissingFile(VerificationError):
    """A file the report lists (or report.json / its signature itself) is not there."""


class HashMismatch(VerificationError):
    """A listed file's size or SHA-256 differs from what the signed report lists (tampered or truncated)."""


class UnlistedFile(VerificationError):
    """A file in the release or report directory that the signed report does not list (smuggled in)."""


class ReleaseRejected(DeidError):
    """The gate rejected the release (a verdict, signed and reported, not a failure of the run).

    Carried by the ``Rejected`` state of the Prefect flow run; ``result`` is the run's
    :class:`~deid.operations.run_result.RunResult` (or the deployment's summary row).
    """

    def __init__(self, message: str, *, result: object = None):
        super().__init__(message)
        self.result = result


class RecordError(DeidError):
    """One record that cannot be used; it is quarantined with ``code`` and ``message``."""

    def __init__(self, code: str, message: str):
        if code not in REASONS:
            raise ValueError(f"unknown quarantine reason code {code!r}; add it to deid.errors.REASONS")
        super().__init__(message)
        self.code = code
        self.message = message


# Stable, machine-readable reason codes -> one-line human description.
REASONS: dict[str, str] = {
    # files
    "missing_file": "the manifest names a file that does not exist in the drop",
    "unsafe_path": "the path is absolute, contains '..', or goes through a symlink (refused when the file is opened)",
    "duplicate_path": "the same image path is listed more than once in the manifest",
    "duplicate_across_people": "the same image bytes are listed under two different subject ids",
    "not_regular_file": "the path is a directory, FIFO, device or other non-regular file",
    "empty_file": "the file has zero bytes",
    "unreadable_file": "the file could not be read",
    "unsupported_format": "the bytes are not a supported image format",
    "corrupt_image": "the image could not be decoded (truncated or corrupt)",
    "image_too_large": "the image exceeds the pixel limit (possible decompression bomb)",
    # manifest rows
    "bad_row": "the manifest row has more cells than the header",
    "missing_subject_id": "the subject_id cell is empty",
    "missing_label": "a declared utility label is missing or empty",
    "bad_eye_points": "eye coordinates are not numbers, are incomplete, or lie outside the image",
    "missing_points_file": "the points column names a landmark file that does not exist in the drop",
    "bad_points": "the landmark file is unreadable or malformed, or its number of points differs from the drop's",
    "unreadable_video": "a video file that OpenCV/FFmpeg cannot open or decode, or that declares no frame rate",
    "video_fps_too_high": "drop.yaml's fps is above a video's own frame rate (frames would repeat)",
    "video_no_face": "a video frame in which no face was found (the subject left the frame or turned away)",
    "video_ambiguous_faces": "a video frame with several faces, none continuing the subject's track",
    "video_track_lost": "a video frame whose only face is away from the subject's track right after it was seen",
    "bad_sequence": "the sequence/frame cells are incomplete, the frame is not an integer >= 0, the (sequence, "
                    "frame) pair is listed twice, or the sequence also holds frames of another subject",
    # faces
    "no_face": "no face was found in the image",
    "multiple_faces": "more than one face was found and no eye points were given",
    "eyes_not_found": "a face was found but its eyes could not be located",
    "eyes_too_close": "the eyes are closer than the minimum distance",
    "face_too_small": "the face is so small that alignment would upsample it too much",
    "pose": "the head is turned (estimated yaw) beyond DEID_MAX_YAW_DEGREES: averaged with frontal faces it "
            "would leave double outlines",
    # feature vectors (feature drops, deid.intake.features)
    "missing_record_id": "the record id cell of a feature row is empty",
    "duplicate_record_id": "the same record id is listed more than once in the feature table",
    "missing_features": "the feature vector is null or holds null values",
    "wrong_length": "the feature vector does not have the drop's dimension",
    "non_finite_features": "the feature vector holds NaN or infinite values",
    "undeclared_label": "a label value is not among the values drop.yaml declares for it (label_values)",
    # identity
    "same_face_other_id": "the face matches a record under another subject id (duplicate_ids=quarantine)",
    # partitions (withheld, not quarantined)
    "partition_too_small": "the label partition has fewer than k distinct people and policy is suppress",
    # clusters (withheld by the de-identify stage's near-copy repair, deid.anonymise.near_copy)
    "near_copy": "the cluster's released average lay within the gate's leak threshold of a member's own face, "
                 "and merging it with its nearest cluster did not move it away",
}


@dataclass(frozen=True)
class Quarantined:
    """One record withheld from processing, with its stable reason code."""

    record_id: str
    image: str
    code: str
    message: str
    stage: str
