"""The typed contracts between the release stages, and the staging layout every stage writes into.

Each stage (:class:`deid.operations.runner.Steps`) takes contracts in and returns one out, the same whether the
Prefect flow (:mod:`deid.flows.release`) or the plain runner (:mod:`deid.operations.runner`) calls it::

    drop -> Ingested -> Aligned -> Featurized -> Partitioned -> Deidentified [-> LineageApplied]
         -> Staged (deid.release.staged) -> GateResult (deid.evaluation.gate) -> Report (deid.reporting.report)
         -> SignedReport [-> Published] -> RunResult (deid.operations.run_result)

The contracts that hold a higher layer's types live in that layer (:class:`~deid.release.staged.Staged`,
:class:`~deid.operations.run_result.RunResult`), so this base module depends on no layer above evaluation's
checks.

All are frozen dataclasses; paths are :class:`~pathlib.Path`; quarantine records stay
:class:`~deid.errors.Quarantined` and checks :class:`~deid.evaluation.checks.Check` from the stage that
made them to the report. :class:`StagingLayout` names every path of a run's staging directory.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from deid.evaluation.checks import Check
from deid.errors import Quarantined
from deid.run_files import COMPLETE_MARKER, LOCK_NAME, RELEASE_SUBDIR

if TYPE_CHECKING:  # pragma: no cover - typing only
    import pyarrow as pa

    from deid.anonymise.near_copy import NearCopyRepair

# Drop-level checks that, failed, send the run straight to a (rejected) gate.
BLOCKING_DROP_CHECKS = ("drop_not_empty", "enough_people", "lineage_color", "lineage_canonical_size")
LINEAGE_PARTITION = "lineage"  # hive key of the returning people's records (released as registered averages)


# --------------------------------------------------------------------------- the staging directory


@dataclass(frozen=True)
class StagingLayout:
    """Every path of one run's private staging directory ``<data>/staging/<release_id>/``.

    The one place that knows the layout: stages, the gate, recovery and tests ask it, never
    join path strings themselves.
    """

    root: Path

    @classmethod
    def for_run(cls, data_path: Path, release_id: str) -> StagingLayout:
        """The staging directory of release ``release_id`` under the data directory."""
        return cls(Path(data_path) / "staging" / release_id)

    @property
    def ingested(self) -> Path:
        """The staged originals (Parquet, one row group per align batch)."""
        return self.root / "ingested.parquet"

    @property
    def aligned_dir(self) -> Path:
        return self.root / "aligned"

    def aligned_part(self, row_group: int) -> Path:
        """The aligned grey faces of one row group of :attr:`ingested`."""
        return self.aligned_dir / f"part-{row_group:05d}.parquet"

    @property
    def aligned_color_dir(self) -> Path:
        """The aligned colour faces (``DEID_COLOR``), one part per grey part, same name."""
        return self.root / "aligned_color"

    def color_part(self, aligned_part: Path | str) -> Path:
        return self.aligned_color_dir / Path(aligned_part).name

    @property
    def features_dir(self) -> Path:
        return self.root / "features"

    def feature_part(self, aligned_part: Path | str) -> Path:
        """The eigenface features of one aligned part (same name)."""
        return self.features_dir / Path(aligned_part).name

    @property
    def partitions_dir(self) -> Path:
        """The Hive-partitioned faces (``partition=p000/...``), input of de-identification and the gate."""
        return self.root / "partitions"

    @property
    def partition_index(self) -> Path:
        """Which label values each opaque Hive key holds (for people reading the staging directory)."""
        return self.partitions_dir / "_index.json"

    def partition_dir(self, key: str) -> Path:
        return self.partitions_dir / f"partition={key}"

    @property
    def deidentified_dir(self) -> Path:
        return self.root / "deidentified"

    def deidentified_part(self, partition_dir: Path | str) -> Path:
        """The de-identified records of one partition (``partition=p000.parquet``)."""
        return self.deidentified_dir / f"{Path(partition_dir).name}.parquet"

    @property
    def release_dir(self) -> Path:
        """The would-be release; renamed into ``<data>/releases/<id>`` only after the report is signed."""
        return self.root / RELEASE_SUBDIR

    @property
    def linkage(self) -> Path:
        """The encrypted linkage record until publication moves it to ``<data>/private/<id>/``."""
        return self.root / "linkage.bin"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine.parquet"

    @property
    def lock(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def complete(self) -> Path:
        """Written when the run ended normally (JSON: its verdict): recovery keeps this staging directory."""
        return self.root / COMPLETE_MARKER

    @property
    def kept_when_finished(self) -> tuple[Path, ...]:
        """What a finished run keeps under every ``DEID_KEEP_STAGING`` policy (deid.operations.retention).

        No later run reads a finished run's staging: the lineage registry keeps its own sealed averages
        (``data/private/lineage/``), the linkage record moves to ``data/private/<id>/`` at publication,
        verification reads the release and the report, and recovery only looks at unfinished runs. Kept: the
        markers (a finished run, still recognisable as one) and the quarantine table, the one record of which
        input was quarantined and why (the report has counts only).
        """
        return (self.lock, self.complete, self.quarantine)


# --------------------------------------------------------------------------- stage results


@dataclass(frozen=True)
class UnreadableDrop:
    """The drop as a whole cannot be read (no manifest, not CSV, a declared label missing ...)."""

    reason: str


@dataclass(frozen=True, eq=False)
class Ingested:
    """The staged originals and what the drop said about itself.

    ``metadata`` is the ingested table without its image bytes (record ids, subject ids,
    source paths and hashes, labels, eye points): read once here, then handed to every stage
    that needs it, so only the align stage reads ``ingested.parquet`` again (for the bytes).
    """

    path: Path
    row_groups: int
    records_in: int
    staged: int
    labels: tuple[str, ...]
    name: str
    license: str | None
    dataset: str
    extra_columns: tuple[str, ...]
    fingerprint: str
    quarantined: tuple[Quarantined, ...]
    people: int
    validation: Mapping[str, Any]
    checks: tuple[Check, ...]
    metadata: pa.Table
    attribution: Mapping[str, str] = field(default_factory=dict)  # drop.yaml's license_name, license_link, citation
    colour_sample: tuple[int, int] = (0, 0)  # (colour images, images sampled) for DEID_COLOR=auto; (0, 0): not sampled
    # Private: sequence key (a video row's record id) -> the rate its frames were taken at; the release's
    # video of that recording plays at it (deid.intake.video). Empty: frame drops (VIDEO_FPS).
    sequence_fps: Mapping[str, float] = field(default_factory=dict)
    sensitive: tuple[str, ...] = ()  # drop.yaml's sensitive columns (in metadata; never labels, deid.evaluation.sensitive)

    @property
    def proceed(self) -> bool:
        """An empty drop, or one with fewer than k people, goes straight to a (rejected) gate."""
        return self.staged > 0 and all(c.passed for c in self.checks if c.name in BLOCKING_DROP_CHECKS)


@dataclass(frozen=True)
class Aligned:
    """Aligned grey faces (one Parquet part per ingested row group) and the records that did not align."""

    parts: tuple[Path, ...] = ()
    quarantined: tuple[Quarantined, ...] = ()
    eye_sources: Mapping[str, int] = field(default_factory=dict)
    validation: Mapping[str, Any] | None = None
    checks: tuple[Check, ...] = ()
    pose: Mapping[str, Any] = field(default_factory=dict)  # the pose spread (deid.operations.worker_align.pose_spread)

    @property
    def n_aligned(self) -> int:
        return int(sum(self.eye_sources.values()))


@dataclass(frozen=True)
class Featurized:
    """Eigenface features, one part per aligned part.

    ``identity_dims``: the parts also hold the identity first pass's features (column ``identity``,
    :func:`deid.operations.featurize_partition.identity_first_pass`), computed while the pixels were read for the
    eigenfaces; 0 when the drop is small enough for the recogniser to embed every face.
    """

    parts: tuple[Path, ...]
    n_components: int
    identity_dims: int = 0


@dataclass(frozen=True)
class PartitionInfo:
    """One label partition: its opaque Hive key, the label values it holds, its size (``dir``: None for features)."""

    name: str
    key: tuple[str, ...]
    dir: Path | None
    records: int
    people: int


class _HasSmall(Protocol):
    """What :meth:`SmallPartition.of_plan` reads of a partition plan (typed structurally: no import of anonymise)."""

    @property
    def small(self) -> Sequence[Mapping[str, Any]]: ...


@dataclass(frozen=True)
class SmallPartition:
    """A label partition with fewer than k people: counts and the policy's action, never its label values."""

    records: int
    people: int
    action: str

    @classmethod
    def of_plan(cls, plan: _HasSmall) -> tuple[SmallPartition, ...]:
        """The small partitions of a :class:`deid.anonymise.partition.PartitionPlan` (its ``small`` entries)."""
        return tuple(cls(records=e["records"], people=e["people"], action=e["action"]) for e in plan.small)


def small_detail(small: Sequence[SmallPartition]) -> str:
    """The gate's one-line account of the small partitions."""
    # Counts only, never the label values: a rare value held by one person is itself identifying.
    return "; ".join(f"a partition of {e.records} records has {e.people} people: {e.action}" for e in small)


@dataclass(frozen=True)
class LineagePlanned:
    """The lineage plan of the drop (:func:`deid.release.lineage_plan.plan_release`) and where its returning records are."""

    plan: Any
    state: Any
    record_ids: tuple[str, ...]
    returning_dir: Path | None


@dataclass(frozen=True)
class MethodInputs:
    """What the partitioned faces give the method beyond pixels and labels (counts of records).

    ``points``: records with landmark points (canonical pixels; k-same-m takes a cluster's shape
    from them); ``frames``: records that are frames of one of ``sequences`` image sequences
    (multi-factor keeps one identity per person, the release holds a video per sequence).
    """

    points: int = 0
    sequences: int = 0
    frames: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"points": self.points, "sequences": self.sequences, "frames": self.frames}

    @classmethod
    def of(cls, *, points: Sequence[Any] | None = None, sequences: Sequence[Any] | None = None) -> "MethodInputs":
        """The counts of per-record columns (an entry None: no landmarks / a still image; None: no such column)."""
        keys = [q for q in sequences or () if q is not None]
        return cls(points=sum(p is not None for p in points or ()), sequences=len(set(keys)), frames=len(keys))

    def gate_options(self, method: str) -> dict[str, Any] | None:
        """The estimator options the gate re-runs ``method`` with: a drop of image sequences runs the
        sequence model the release was made with (:func:`deid.anonymise.sequences.sequence_options`)."""
        from deid.anonymise.sequences import sequence_options  # noqa: PLC0415 - the contracts import no method

        return sequence_options(method) if self.frames else None

    def gate_points(self, method: str) -> bool:
        """Whether the gate re-runs ``method`` with the records' landmark points (k-same-m's cluster shapes)."""
        from deid.anonymise.methods import uses_points  # noqa: PLC0415

        return bool(self.points) and uses_points(method)


@dataclass(frozen=True)
class Partitioned:
    """The faces split by utility labels into Hive-partitioned Parquet, plus what was held back."""

    root: Path
    partitions: tuple[PartitionInfo, ...] = ()
    suppressed: tuple[str, ...] = ()
    small: tuple[SmallPartition, ...] = ()
    failed: bool = False
    identity: Mapping[str, Any] | None = None
    quarantined: tuple[Quarantined, ...] = ()
    lineage: LineagePlanned | None = None
    inputs: MethodInputs = field(default_factory=MethodInputs)
    # The person index's face search (issue 27): its ``person_index`` check, the report's note when it routed the
    # drop, and the staged descriptors the release registers (None: nothing to register).
    checks: tuple[Check, ...] = ()
    notes: tuple[str, ...] = ()
    person_faces: Path | None = None
    # Identity resolution's near misses (PeopleResolution.suspects) by staging record id, closest first: the gate's
    # within-cluster check looks at their clusters whatever its sample.
    identity_suspects: tuple[str, ...] = ()

    @property
    def gate_keys(self) -> dict[tuple[str, ...], str]:
        """Label values -> Hive key: the partition a returning person's record joins in the gate."""
        return {p.key: p.name for p in self.partitions}

    @property
    def small_detail(self) -> str:
        return small_detail(self.small)


@dataclass(frozen=True)
class ClusterInfo:
    """One released cluster: its random name, its records of this drop and their distinct people."""

    cluster: str
    size: int
    people: int


@dataclass(frozen=True)
class Deidentified:
    """De-identified parts (one per partition) and their clusters.

    ``shape_sources``: for k-same-m and k-same-aam, how many clusters took their shape from landmark points and
    how many from optical flow (``{"points": n, "flow": m}``); empty for other methods.
    ``suppressed``: records withheld as near copies (:mod:`deid.anonymise.near_copy`), in no part;
    ``near_copies``: what that repair did (:class:`~deid.anonymise.near_copy.NearCopyRepair`; None:
    the method gets no repair).
    """

    parts: tuple[Path, ...] = ()
    clusters: tuple[ClusterInfo, ...] = ()
    shape_sources: Mapping[str, int] = field(default_factory=dict)
    suppressed: tuple[str, ...] = ()
    near_copies: NearCopyRepair | None = None

    @property
    def records(self) -> int:
        return sum(c.size for c in self.clusters)


@dataclass(frozen=True)
class LineageApplied:
    """The release as the dataset's lineage sees it (:class:`deid.release.lineage.LineageRelease`).

    ``deidentified`` now includes the returning people's part (their registered averages);
    ``republished`` is the gate's view of the clusters released again
    (:class:`deid.evaluation.gate_types.Republished`: registered members, counterfeit rows, stored
    images), or None when there are none.
    """

    release: Any
    state: Any  # the deid.release.lineage_state.LineageState the release was planned on
    deidentified: Deidentified
    checks: tuple[Check, ...]
    republished: Any = None
    record_ids: tuple[str, ...] = ()  # staging record id of each drop record the release indexes


@dataclass(frozen=True, eq=False)
class CounterfeitRow:
    """A counterfeit record of a republished cluster: its stored average and the labels it carries, no source.

    ``average`` is the cluster's stored average as registered: a face's flat uint8 pixels or a
    feature drop's float vector. Only the private linkage record marks the row as counterfeit.
    """

    record_id: str
    cluster: str
    average: np.ndarray
    labels: Mapping[str, str]


@dataclass(frozen=True, eq=False)
class ReleaseRows:
    """Every record of the would-be release, in staging order, before the release shuffles and renames them.

    ``vectors`` (n, d), an array or an array-like indexed by row (:class:`deid.operations.worker_rows.IndexedRows`:
    each cluster's image stored once): flat faces (uint8 grey, or BGR with ``shape`` (h, w, 3)) or a feature drop's
    float vectors (``shape`` (d,)); ``clusters`` the internal cluster names; ``labels`` label name ->
    per-record values; ``record_ids`` the staging ids (counterfeits included). An image-sequence drop
    adds each record's private ``sequences`` key and ``frames`` number (None for a still image).
    """

    vectors: np.ndarray
    shape: tuple[int, ...]
    clusters: tuple[str, ...]
    labels: Mapping[str, tuple[str, ...]]
    record_ids: tuple[str, ...]
    sequences: tuple[str | None, ...] | None = None
    frames: tuple[int | None, ...] | None = None

    def label_rows(self, names: Sequence[str]) -> list[tuple[str, ...]]:
        """Each record's values of the labels ``names``, in order."""
        return list(zip(*(self.labels[x] for x in names))) if names else [()] * len(self.record_ids)

    def with_counterfeits(self, fakes: Sequence[CounterfeitRow]) -> ReleaseRows:
        """These rows and the counterfeits after them (a counterfeit is a still image: no sequence, no frame)."""
        if not fakes:
            return self
        extra = [np.asarray(f.average, dtype=self.vectors.dtype).reshape(1, -1) for f in fakes]
        none = (None,) * len(fakes)
        # A matrix-like that keeps each distinct row once (deid.operations.worker_rows.IndexedRows) appends in place.
        vectors = (self.vectors.with_rows(np.vstack(extra)) if hasattr(self.vectors, "with_rows") else
                   np.vstack([self.vectors, *extra]))
        return replace(self, vectors=vectors,
                       clusters=(*self.clusters, *(f.cluster for f in fakes)),
                       record_ids=(*self.record_ids, *(f.record_id for f in fakes)),
                       labels={x: (*v, *(f.labels[x] for f in fakes)) for x, v in self.labels.items()},
                       sequences=None if self.sequences is None else (*self.sequences, *none),
                       frames=None if self.frames is None else (*self.frames, *none))


@dataclass(frozen=True)
class RecordCounts:
    """Where every record of the drop went; the gate's accounting checks and the report's tiles read this.

    ``judged`` records were de-identified and put before the gate: *released* when it passes,
    *withheld* when it rejects. ``suppressed`` were held back before the gate (label partitions
    with fewer than k people, the lineage's waiting newcomers), ``quarantined`` never made it
    through ingest, alignment or identity resolution. A drop refused before de-identification
    (empty, fewer than k people) leaves its staged records unjudged: withheld as well.
    """

    records_in: int
    judged: int = 0
    suppressed: int = 0
    quarantined: int = 0

    @property
    def unjudged(self) -> int:
        """Staged records that never reached the gate (the drop was refused before de-identification)."""
        return max(0, self.records_in - self.judged - self.suppressed - self.quarantined)

    def released(self, passed: bool) -> int:
        return self.judged if passed else 0

    def withheld(self, passed: bool) -> int:
        return 0 if passed else self.judged + self.unjudged


@dataclass(frozen=True)
class SignedReport:
    """Where the signed report went and which key signed it."""

    path: Path
    public_key: Path | None
    key_origin: str

    @property
    def dir(self) -> Path:
        return self.path.parent


@dataclass(frozen=True)
class Published:
    """The published release and its filed linkage record."""

    path: Path
    linkage: Path
