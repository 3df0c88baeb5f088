"""The one typed settings object; every environment read goes through it (prefix ``DEID_``)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from deid.errors import ConfigError
from deid.method_registry import METHODS

# The method names come from the registry (deid.method_registry), the one list of methods.
Method = Literal[METHODS]  # type: ignore[valid-type]
# What a partition with fewer than k people becomes (deid.anonymise.partition.plan_partitions, which reads
# this list): the setting's one list of values, here so that this base module imports no partition code.
SMALL_PARTITION_POLICIES: tuple[str, ...] = ("suppress", "merge", "fail")
SmallPartitionPolicy = Literal[SMALL_PARTITION_POLICIES]  # type: ignore[valid-type]


# DEID_FEATURE_MAX_BYTES: the most bytes a feature table may decode to (rows x dim x bytes per value, over its
# columns), checked from the Parquet metadata before anything is decoded (deid.intake.features). Parquet
# compresses a constant column ~100,000-fold (300 x 100,000 zeros: a 2 KB file, 240 MB decoded), and a run
# holds several copies at its peak (measured on that table: 1.2 GB to ingest it, 3.2 GB for the run).
FEATURE_MAX_BYTES = 200_000_000


KEEP_STAGING_FORMS = "none | failed | last:N (N >= 0) | all"


@dataclass(frozen=True)
class StagingRetention:
    """What a finished run keeps of its private staging directory (``DEID_KEEP_STAGING``; issue 32).

    Every finished run keeps the few files :attr:`deid.contracts.StagingLayout.kept_when_finished`
    names (its markers and quarantine table: no later run reads anything else of it); beyond that:

    - ``none`` (default): nothing more;
    - ``failed``: the whole staging of runs the gate rejected (to see why);
    - ``last:N``: the whole staging of the N most recently finished runs;
    - ``all``: everything (the behaviour before the policy).

    A live run's staging (its lock held) is never touched.
    """

    mode: Literal["none", "failed", "last", "all"] = "none"
    last: int = 0

    @classmethod
    def parse(cls, text: str) -> StagingRetention:
        """``none``, ``failed``, ``last:N`` or ``all``; a ValueError naming the value, the valid forms and an example."""
        t = str(text).strip().lower()
        if t in ("none", "failed", "all"):
            return cls(mode=t)  # type: ignore[arg-type]
        m = re.fullmatch(r"last:(\d{1,9})", t)
        if m:
            return cls(mode="last", last=int(m.group(1)))
        raise ValueError(f"keep_staging={text!r} must be one of {KEEP_STAGING_FORMS}, e.g. DEID_KEEP_STAGING=last:3 "
                         "(keep the whole staging of the 3 most recent finished runs) or unset it (none)")

    def __str__(self) -> str:
        return f"last:{self.last}" if self.mode == "last" else self.mode


class Settings(BaseSettings):
    """deid configuration. Every field can be set as ``DEID_<FIELD>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="DEID_", extra="ignore")

    project_dir: Path = Field(default_factory=Path.cwd, description="root for data/ and reports/")
    data_dir: Path | None = Field(default=None, description="runtime data (default: <project_dir>/data)")
    reports_dir: Path | None = Field(default=None, description="reports (default: <project_dir>/reports)")
    signing_key: Path | None = Field(default=None, description="Ed25519 private key PEM used to sign reports")
    signing_key_passphrase: SecretStr | None = Field(
        default=None, description="passphrase of an encrypted signing key (DEID_SIGNING_KEY_PASSPHRASE)")
    linkage_key: Path | None = Field(default=None, description="32-byte key file for the private linkage record")
    dask_address: str | None = Field(default=None, description="existing Dask scheduler, e.g. tcp://host:8786")
    dask_workers: int = Field(default=2, ge=1, le=256, description="workers of the default LocalCluster")
    local_pool_max_records: int = Field(
        default=2000, ge=0, le=10_000_000,
        description="a drop with at most this many manifest rows runs its heavy stages on DEID_DASK_WORKERS local "
                    "processes (the run's own included) instead of a Dask LocalCluster, whose start costs more than "
                    "such a drop's work; ignored with DEID_DASK_ADDRESS; 0 = always a LocalCluster")

    keep_staging: str = Field(
        default="none", description="what finished runs keep of data/staging/<release_id>/ beyond its markers and "
                                    f"quarantine table: {KEEP_STAGING_FORMS} (see StagingRetention; `deid gc` "
                                    "applies it to existing staging)")

    schedule_cron: str = Field(default="0 2 * * *", description="cron of the scheduled `release` deployment")
    incoming_dir: Path | None = Field(default=None, description="where drops arrive (default: <data>/incoming)")
    ledger_stale_after: float = Field(default=21600.0, gt=0, description="seconds before a running claim is stale")
    database_url: SecretStr | None = Field(
        default=None, description="PostgreSQL URL of the drop ledger and the lineage registries when several "
                                  "machines share the work (postgresql://user:password@host:5432/db); unset: "
                                  "<data>/ledger.sqlite and <data>/private/lineage/")

    k: int = Field(default=5, ge=2, le=1000, description="the minimum number of distinct people per cluster")
    method: Method = Field(default="k-same-select", description="the de-identification method (`deid run --help` "
                                                                 "lists them; the method registry)")
    small_partitions: SmallPartitionPolicy = Field(
        default="suppress", description="a label partition with fewer than k people: suppress (withheld), merge "
                                        "(into its nearest partition) or fail (the run)")
    sigma: float = Field(default=4.0, gt=0, le=100, description="Gaussian blur sigma (canonical pixels), method blur")
    block: int = Field(default=8, ge=2, le=64, description="pixelation block size (canonical pixels), method pixelate")
    utility_sample: int = Field(default=1000, ge=20, le=100_000,
                                description="most images (whole people, seeded sample) in the gate's cross-fitted "
                                            "utility protocol")
    leak_threshold: float = Field(default=2.0, ge=0, description="mean abs grey difference below which a released "
                                  "face counts as a near copy of an original")
    utility_tolerance: float = Field(default=0.05, ge=0.0, le=1.0,
                                     description="the largest accuracy drop per label the utility check passes "
                                                 "(decided from the drop's interval bounds)")
    min_cluster_fraction: float = Field(
        default=0.5, ge=0.0, le=1.0,
        description="the gate fails a release in which a label partition forms fewer than this share of the clusters "
                    "its people allow (floor(records/k) when a grouping exists: a partition collapsed into a few "
                    "faces has lost its labels); 0 = no such check")
    lineage_policy: Literal["invariant", "release-once"] = Field(
        default="invariant", description="successive releases of a dataset: returning people keep their registered "
                                         "cluster (invariant) or appear in one release only (release-once)")
    lineage_absent: Literal["republish", "suppress"] = Field(
        default="republish", description="a registered cluster with absent members: republished with counterfeit "
                                         "records, or suppressed in this release")
    lineage_merges: Literal["withhold", "refuse"] = Field(
        default="withhold", description="a registered cluster that this run's identity merges (or its registered "
                                        "photos under another subject id) leave below k people or with one person "
                                        "above 1/k: withheld from this release, or the run refused (gate check "
                                        "lineage_merges)")
    cross_dataset: Literal["refuse", "route"] = Field(
        default="refuse", description="a drop holding people another dataset of the project registered (the person "
                                      "index: same photograph, steward id, or face): refused naming that dataset, or "
                                      "planned in that dataset's lineage")
    cross_dataset_ids: Literal["linked", "project"] = Field(
        default="linked", description="steward ids name one person across the project's datasets (project), or only "
                                      "towards a dataset the drop shares a photograph with (linked)")
    duplicate_ids: Literal["merge", "quarantine"] = Field(
        default="merge", description="records whose faces match under different subject ids: one person, or withheld")
    identity_embed_max: int = Field(
        default=2000, ge=0, le=10_000_000,
        description="most faces the dlib recogniser embeds to find one person under several ids (~0.09 s per face "
                    "per worker core): every face of a drop this small, above it the faces a cheap first pass flags; "
                    "also the gate's within-cluster identity check's budget; 0 = eigenface near-duplicates only")
    utility_inconclusive: Literal["release", "reject"] = Field(
        default="release", description="what an inconclusive utility check does (it never hides the privacy verdict)")
    gate_confidence: float = Field(default=0.95, gt=0.5, lt=1.0,
                                   description="one-sided confidence of every empirical rate's interval")
    deep_attack_sample: int = Field(default=100, ge=10, le=1_000_000,
                                    description="most records the deep recogniser (dlib-resnet, ~0.09 s per face) "
                                                "attacks (whole clusters sampled at random beyond it)")
    attack_sample: int = Field(default=1000, ge=10, le=1_000_000,
                               description="most records attacked (whole clusters sampled at random beyond it)")
    min_probes: int = Field(default=20, ge=1, le=100_000,
                            description="fewest distinct probes behind a re-identification rate that may be the "
                                        "headline or decide the check; a rate from fewer is reported as "
                                        "'insufficient evidence', and the attack samples take at least this many "
                                        "whole clusters (people) when the release has them (1: every rate decides)")
    membership_max_advantage: float | None = Field(
        default=None, ge=0.0, le=1.0,
        description="largest membership advantage (2 x AUC - 1 of telling members from non-members by their "
                    "photo's nearest released face, deid.evaluation.membership) a release may show, decided from "
                    "its interval's lower bound; unset: measured and reported, deciding nothing")
    sensitive_l: int = Field(
        default=2, ge=1, le=1000,
        description="drop.yaml's sensitive columns are released only when every cluster holds at least this many "
                    "distinct values of each (distinct l-diversity), else withheld from the release")
    sensitive_diversity: Literal["distinct", "entropy"] = Field(
        default="distinct",
        description="how DEID_SENSITIVE_L is measured in every cluster: distinct (at least l distinct values) or "
                    "entropy (the entropy of the cluster's values at least log(l): stricter when one value dominates)")
    max_quarantine_fraction: float = Field(default=0.05, ge=0.0, le=1.0,
                                           description="a drop quarantining more than this fraction fails the gate")
    cv_folds: int = Field(default=5, ge=2, le=20, description="folds (of people) of the cross-fitted utility protocol")
    cv_repeats: int = Field(default=3, ge=1, le=100,
                            description="repeated grouped CV runs of the earlier utility protocols (report evidence)")

    canonical_width: int = Field(default=81, ge=16, le=1024, description="width of the aligned canonical face (px)")
    canonical_height: int = Field(default=92, ge=16, le=1024, description="height of the aligned canonical face (px)")
    color: bool | Literal["auto"] = Field(
        default="auto", description="release colour faces (each cluster's mean per channel): true, false, or auto "
                                    "(a dataset's first release: colour when most of a sample of the drop's images are "
                                    "colour and the method can release colour; later releases follow the lineage's "
                                    "colour mode, and an explicit setting that differs fails the gate's lineage_color "
                                    "check); eyes, features, identity and the gate's attacks stay grey")
    color_auto_max: int = Field(
        default=20_000, ge=0, le=10_000_000,
        description="DEID_COLOR=auto releases a dataset's first release in colour only up to this many staged records: "
                    "colour clusters are averaged in memory per partition (~22 KB per 81x92 face, twice), so above it "
                    "auto stays grey; a dataset already released in colour stays colour at any size")
    max_yaw_degrees: float = Field(
        default=30.0, ge=5.0, le=90.0,
        description="faces whose estimated head yaw (dlib 5-point landmarks, ~0.6 ms per face) is beyond this many "
                    "degrees either way are quarantined with reason 'pose' (averaged with frontal faces they ghost); "
                    "90 = no pose limit and no estimate")
    pose_grouping_degrees: float = Field(
        default=0.0, ge=0.0, le=180.0,
        description="k-Same groups faces by estimated head yaw (signed) as well as appearance: a yaw difference of "
                    "this many degrees counts as much as the typical distance between two faces of a partition "
                    "(deid.anonymise.ksame_pose); 0 = appearance only. Only faces with a pose estimate (eyes detected, "
                    "DEID_MAX_YAW_DEGREES below 90) have a yaw; the others count as frontal")
    # Eye centres in the canonical image, as fractions of width/height.
    eye_left: tuple[float, float] = Field(default=(0.30, 0.37), description="left eye centre in the canonical face "
                                                                            "(x, y fractions of width and height)")
    eye_right: tuple[float, float] = Field(default=(0.70, 0.37), description="right eye centre in the canonical "
                                                                             "face (x, y fractions)")
    max_upsample: float = Field(default=4.0, gt=0, description="largest magnification (canonical / source eye "
                                                                "distance); beyond it: quarantined, face_too_small")
    min_eye_distance_px: float = Field(default=8.0, gt=0, description="smallest source eye distance in pixels; "
                                                                       "below it: quarantined, eyes_too_close")
    max_pixels: int = Field(default=100_000_000, ge=1, description="decompression-bomb limit: the most pixels an "
                                                                    "image may decode to (at most 3 bytes each)")
    feature_max_bytes: int = Field(
        default=FEATURE_MAX_BYTES, ge=1,
        description="the most bytes a feature drop's table may decode to (rows x dim x bytes per value), checked from "
                    "its Parquet metadata before decoding; a run holds several copies at its peak")

    pca_components: int = Field(default=50, ge=1, le=2000, description="eigenface (PCA) components of the features "
                                                                       "that k-Same groups faces by")
    ksame_block_size: int = Field(default=2000, ge=2, le=10_000_000,
                                  description="faces of one partition above which k-Same groups blockwise, one Dask "
                                              "task per block of about half to all of this many faces")
    align_batch_size: int = Field(default=512, ge=1, le=100_000,
                                  description="max records per align task (small drops use smaller batches)")
    seed: int | None = Field(default=None, description="seed for the random parts (release ids, shuffling); None = OS randomness")

    @field_validator("eye_left", "eye_right")
    @classmethod
    def _fraction(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 < c < 1.0 for c in v):
            raise ValueError(f"eye position {v} must be fractions strictly between 0 and 1 of the canonical size")
        return v

    @field_validator("keep_staging")
    @classmethod
    def _keep_staging(cls, v: str) -> str:
        return str(StagingRetention.parse(v))

    @property
    def staging_retention(self) -> StagingRetention:
        """``keep_staging`` parsed (validated when the settings were read)."""
        return StagingRetention.parse(self.keep_staging)

    @property
    def data_path(self) -> Path:
        return (self.data_dir or self.project_dir / "data").resolve()

    @property
    def reports_path(self) -> Path:
        return (self.reports_dir or self.project_dir / "reports").resolve()

    @property
    def canonical_size(self) -> tuple[int, int]:
        """(width, height) of the aligned canonical face."""
        return (self.canonical_width, self.canonical_height)

    def canonical_eyes(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """Eye centres in canonical pixel coordinates (left, right)."""
        w, h = self.canonical_size
        return ((self.eye_left[0] * w, self.eye_left[1] * h), (self.eye_right[0] * w, self.eye_right[1] * h))


def declared_range(name: str) -> tuple[float | None, bool, float | None, bool, bool]:
    """The range :class:`Settings` declares for ``name`` (its Field's ``ge``/``gt``/``le``/``lt``): ``(low,
    low_inclusive, high, high_inclusive, integer)``. Each range is declared once, on the setting; every check of
    that parameter (settings, run configuration, CLI) reads it here."""
    field = Settings.model_fields[name]
    low = high = None
    low_in = high_in = True
    for m in field.metadata:
        for attr, is_low, inclusive in (("ge", True, True), ("gt", True, False), ("le", False, True),
                                        ("lt", False, False)):
            bound = getattr(m, attr, None)
            if bound is not None:
                if is_low:
                    low, low_in = bound, inclusive
                else:
                    high, high_in = bound, inclusive
    return low, low_in, high, high_in, field.annotation in (int, "int")


def range_text(name: str) -> str:
    """``name``'s declared range in words: "an integer from 2 to 1000", "a number in (0, 100]"."""
    low, low_in, high, high_in, integer = declared_range(name)
    if integer and low_in and high_in and low is not None and high is not None:
        return f"an integer from {low:g} to {high:g}"
    kind = "an integer" if integer else "a number"
    if low is not None and high is not None:
        return f"{kind} in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
    if low is not None:
        return f"{kind} {'>=' if low_in else '>'} {low:g}"
    if high is not None:
        return f"{kind} {'<=' if high_in else '<'} {high:g}"
    return kind


def in_declared_range(name: str, value: object) -> bool:
    """Whether ``value`` is of ``name``'s declared kind and within its declared range (booleans never are)."""
    low, low_in, high, high_in, integer = declared_range(name)
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        return False
    v = float(value)  # type: ignore[arg-type]
    return ((low is None or (v >= low if low_in else v > low))
            and (high is None or (v <= high if high_in else v < high)))


def check_range(name: str, value: object, *, meaning: str, example: str) -> None:
    """Raise :class:`~deid.errors.ConfigError` naming the parameter, its value, its declared range
    (:func:`declared_range`), what it means and an example, unless ``value`` is within that range."""
    if not in_declared_range(name, value):
        raise ConfigError(f"{name}={value!r} must be {range_text(name)} ({meaning}); e.g. {example}")
