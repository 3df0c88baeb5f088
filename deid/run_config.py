"""One run's configuration: built once from the settings and the caller's overrides, validated once.

:meth:`RunConfig.resolve` takes :class:`deid.settings.Settings` (the environment) and what the
CLI or the flow's caller chose (k, method, labels ...), fills every default, checks every value
and returns a frozen :class:`RunConfig` that is passed explicitly to every stage
(:class:`deid.operations.runner.Steps`). Nothing downstream reads the environment again.
"""
from __future__ import annotations

import re

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deid.errors import ConfigError
from deid.method_registry import COLOR_METHODS, FEATURE_METHODS, IMAGE_ONLY_METHODS, REGISTRY, MethodSpec, method_spec
from deid.anonymise.randomness import ReleaseSeed
from deid.settings import SMALL_PARTITION_POLICIES, Settings, StagingRetention, check_range

if TYPE_CHECKING:
    from deid.evaluation.gate_types import GateConfig


@dataclass(frozen=True)
class AlignerParams:
    """The canonical face geometry: sent as a plain dict to the Dask workers that align."""

    size: tuple[int, int]  # (width, height) of the canonical face
    eye_left: tuple[float, float]  # eye centres in canonical pixels
    eye_right: tuple[float, float]
    max_upsample: float = 4.0
    min_eye_distance: float = 8.0
    color: bool = False
    max_yaw: float | None = None  # degrees; None: no pose estimate, no pose quarantine (DEID_MAX_YAW_DEGREES=90)

    @classmethod
    def from_settings(cls, settings: Settings) -> AlignerParams:
        left, right = settings.canonical_eyes()
        return cls(size=settings.canonical_size, eye_left=left, eye_right=right,
                   max_upsample=settings.max_upsample, min_eye_distance=settings.min_eye_distance_px,
                   color=settings.color is True,
                   max_yaw=None if settings.max_yaw_degrees >= 90 else float(settings.max_yaw_degrees))

    @property
    def shape_hw(self) -> tuple[int, int]:
        """(height, width): the shape of a canonical face array."""
        return int(self.size[1]), int(self.size[0])

    def to_dict(self) -> dict[str, Any]:
        """What :func:`deid.operations.worker_align.make_aligner` takes (picklable, no deid import needed to read it)."""
        return {"size": list(self.size), "eye_left": list(self.eye_left), "eye_right": list(self.eye_right),
                "max_upsample": self.max_upsample, "min_eye_distance": self.min_eye_distance, "color": self.color,
                "max_yaw": self.max_yaw}


# The run parameters a caller may override (the flow's parameters), in the flow's order.
RUN_PARAMETERS = ("k", "method", "labels", "small_partitions", "name", "sigma", "block")


@dataclass(frozen=True)
class RunConfig:
    """Everything one release run is configured with; see :meth:`resolve`.

    ``gate`` holds the run's k and method and every gate setting (:data:`deid.evaluation.gate_types.GATE_SETTINGS`),
    stored once: ``k``, ``method``, ``pca_components`` and ``seed`` read it.
    """

    small_partitions: str
    sigma: float
    block: int
    data_path: Path
    reports_path: Path
    aligner: AlignerParams
    gate: GateConfig  # labels=(): the drop's labels are known only after ingest (see gate_config)
    labels: tuple[str, ...] | None = None  # None: the drop's drop.yaml decides
    name: str | None = None  # None: drop.yaml's name or the directory name
    kind: str = "images"  # "features": a drop of feature vectors (drop.yaml kind: features; deid.operations.features)
    max_pixels: int = 100_000_000
    feature_max_bytes: int | None = None  # DEID_FEATURE_MAX_BYTES (None: its default)
    align_batch_size: int = 512
    dask_workers: int = 2
    ksame_block_size: int = 2000  # k-Same groups blockwise above this many faces (one Dask task per block)
    pose_grouping_degrees: float = 0.0  # DEID_POSE_GROUPING_DEGREES: k-Same groups by yaw too (0: appearance only)
    dask_address: str | None = None
    seed_fixed: bool = False  # DEID_SEED was set (else a random method's release draws its own secret seed)
    # The method's random state (deid.anonymise.randomness): drawn from the OS unless DEID_SEED fixes it,
    # drawn again for every release (run_release: for_release); never shown, never in a report.
    release_seed: ReleaseSeed | None = field(default=None, repr=False, compare=False)
    duplicate_ids: str = "merge"
    identity_embed_max: int = 2000
    sensitive_l: int = 2  # DEID_SENSITIVE_L: distinct values every cluster needs to release a sensitive column
    sensitive_diversity: str = "distinct"  # DEID_SENSITIVE_DIVERSITY: distinct or entropy l-diversity
    lineage_policy: str = "invariant"
    lineage_absent: str = "republish"
    lineage_merges: str = "withhold"  # DEID_LINEAGE_MERGES (deid.release.lineage_state.MERGE_POLICIES)
    color_auto_max: int = 20_000  # DEID_COLOR_AUTO_MAX: auto chooses colour for a first release up to this many records
    cross_dataset: str = "refuse"  # DEID_CROSS_DATASET (deid.operations.person_index)
    cross_dataset_ids: str = "linked"  # DEID_CROSS_DATASET_IDS
    color_auto: bool = False  # DEID_COLOR=auto: the run decides after ingest (deid.operations.ingest_align.resolve_color)
    color_reason: str = ""  # why the run releases colour or grey (the report's configuration.color_decision)
    keep_staging: StagingRetention = StagingRetention()  # DEID_KEEP_STAGING: applied at the run's end
    signing_key: Path | None = None
    linkage_key: Path | None = None
    # Never shown: repr=False keeps it out of logs and task parameter reprs.
    signing_passphrase: Any = field(default=None, repr=False, compare=False)
    # DEID_DATABASE_URL (a SecretStr: it may hold a password): the lineage registry lives there when set.
    database_url: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check(self)
        if self.release_seed is None or self.release_seed.fixed != self.seed_fixed:
            object.__setattr__(self, "release_seed", ReleaseSeed.draw(self.seed if self.seed_fixed else None))

    def for_release(self) -> RunConfig:
        """This configuration with a fresh :class:`~deid.anonymise.randomness.ReleaseSeed` (one per release)."""
        return replace(self, release_seed=ReleaseSeed.draw(self.seed if self.seed_fixed else None))

    @classmethod
    def resolve(cls, settings: Settings | None = None, *, k: int | None = None, method: str | None = None,
                labels: list[str] | tuple[str, ...] | None = None, small_partitions: str | None = None,
                name: str | None = None, sigma: float | None = None, block: int | None = None,
                kind: str | None = None) -> RunConfig:
        """The run's configuration: each override if given, else the setting (``DEID_*``), validated.

        ``kind`` is the drop's (:func:`deid.intake.features.drop_kind`): ``features`` admits the
        feature-vector methods (``noise`` needs an explicit ``sigma``).

        Raises
        ------
        ConfigError
            Naming the parameter, its value, the valid range and what to do.
        """
        from deid.evaluation.gate_types import GateConfig  # noqa: PLC0415 - the gate imports scipy and the attacks

        s = settings or Settings()
        if kind == "features" and (method or s.method) == "noise" and sigma is None:
            raise ConfigError("method='noise' needs sigma=... (the noise in feature standard deviations), e.g. "
                              "--sigma 0.1")
        k, method = s.k if k is None else k, method or s.method
        _check_run(k, method, kind or "images")  # before the gate checks k, so the message names the CLI option
        return cls(
            gate=GateConfig.from_settings(s, k=k, method=method),
            small_partitions=small_partitions or s.small_partitions,
            sigma=s.sigma if sigma is None else sigma, block=s.block if block is None else block,
            labels=None if labels is None else tuple(labels), name=name or None, kind=kind or "images",
            data_path=s.data_path, reports_path=s.reports_path, aligner=AlignerParams.from_settings(s),
            max_pixels=s.max_pixels, feature_max_bytes=s.feature_max_bytes, align_batch_size=s.align_batch_size, dask_workers=s.dask_workers,
            ksame_block_size=s.ksame_block_size, pose_grouping_degrees=s.pose_grouping_degrees,
            dask_address=s.dask_address, seed_fixed=s.seed is not None,
            duplicate_ids=s.duplicate_ids, identity_embed_max=s.identity_embed_max, lineage_policy=s.lineage_policy,
            lineage_absent=s.lineage_absent, lineage_merges=s.lineage_merges, cross_dataset=s.cross_dataset, cross_dataset_ids=s.cross_dataset_ids,
            keep_staging=s.staging_retention, sensitive_l=s.sensitive_l,
            sensitive_diversity=s.sensitive_diversity,
            color_auto=s.color == "auto", color_auto_max=s.color_auto_max,
            color_reason="" if s.color == "auto" else f"DEID_COLOR={str(s.color).lower()}",
            signing_key=s.signing_key, linkage_key=s.linkage_key, signing_passphrase=s.signing_key_passphrase,
            database_url=s.database_url)

    # ------------------------------------------------------------------ derived facts

    @property
    def k(self) -> int:
        return self.gate.k

    @property
    def method(self) -> str:
        return self.gate.method

    @property
    def pca_components(self) -> int:
        """Eigenface components: the featurize stage's and the gate's attackers'."""
        return self.gate.n_components

    @property
    def seed(self) -> int:
        return self.gate.seed

    @property
    def spec(self) -> MethodSpec:
        return method_spec(self.method)

    @property
    def shape_hw(self) -> tuple[int, int]:
        """(height, width) of the canonical face."""
        return self.aligner.shape_hw

    @property
    def color(self) -> bool:
        return self.aligner.color

    @property
    def keys_dir(self) -> Path:
        return self.data_path / "keys"

    @property
    def releases_dir(self) -> Path:
        return self.data_path / "releases"

    @property
    def lineage_applies(self) -> bool:
        """Only methods that give every cluster member the identical image have registered averages to keep."""
        # Faces and feature vectors alike: a k-Same cluster's released average is what the lineage keeps.
        return bool(self.spec.identical_within_cluster and self.spec.clustered)

    def select(self, labels: tuple[str, ...] | list[str]) -> bool:
        """Does the run partition by the utility labels (the method does, and the drop has labels)?"""
        return bool(self.spec.partitions_by_labels and labels)

    def parameters(self) -> dict[str, Any]:
        """The run parameters as used (defaults resolved): what the flow run records."""
        return {"k": self.k, "method": self.method, "labels": None if self.labels is None else list(self.labels),
                "small_partitions": self.small_partitions, "name": self.name, "sigma": self.sigma,
                "block": self.block}

    def used_parameters(self, *, labels: list[str] | tuple[str, ...] | None = None,
                        name: str | None = None) -> dict[str, Any]:
        """The parameters the run used, for the flow run's Parameters tab: only those the method takes.

        ``labels`` and ``name``: what the drop's drop.yaml gave (an override in the configuration wins,
        as in :func:`deid.intake.drop.read_drop`). ``sigma`` only for a method whose strength is sigma,
        ``block`` only for one whose strength is block (k-same-select takes neither).
        """
        p = self.parameters()
        if p["labels"] is None and labels is not None:
            p["labels"] = list(labels)
        p["name"] = p["name"] or name
        strength = self.spec.strength
        for key in ("sigma", "block"):
            if strength != key:
                del p[key]
        return p

    def gate_config(self, labels: tuple[str, ...] | list[str]) -> GateConfig:
        """The gate's :class:`~deid.evaluation.gate_types.GateConfig` for the drop's labels."""
        return replace(self.gate, labels=tuple(labels))


def _check_run(k: Any, method: Any, kind: Any = "images") -> None:
    """The run's k, method and drop kind; every message names the parameter, its value, the valid range and the fix."""
    check_range("k", k, meaning="the minimum number of distinct people per cluster", example="--k 5")
    if kind not in ("images", "features"):
        raise ConfigError(f"kind={kind!r} must be 'images' or 'features' (drop.yaml's kind)")
    if kind == "features" and method not in FEATURE_METHODS:
        raise ConfigError(f"method={method!r} does not run on feature vectors; use one of {list(FEATURE_METHODS)} "
                          f"({', '.join(IMAGE_ONLY_METHODS)} need face images); e.g. --method k-same-select")
    if kind == "images" and method not in REGISTRY:
        raise ConfigError(f"method={method!r} must be one of {list(REGISTRY)}; e.g. --method k-same-select")


# A dataset name (--name): a slug, never a path ("../../x" made the lineage name "-..-x").
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,127}$")


def _check(c: RunConfig) -> None:
    """Validate once; every message names the parameter, its value, the valid range and the fix."""
    _check_run(c.k, c.method, c.kind)
    if c.kind == "images" and c.color and c.method not in COLOR_METHODS:
        raise ConfigError(f"method={c.method!r} cannot release colour (DEID_COLOR=true); use one of "
                          f"{list(COLOR_METHODS)} or unset DEID_COLOR")
    if c.small_partitions not in SMALL_PARTITION_POLICIES:
        raise ConfigError(f"small_partitions={c.small_partitions!r} must be one of {list(SMALL_PARTITION_POLICIES)}; "
                          "e.g. --small-partitions suppress")
    check_range("sigma", c.sigma, meaning="Gaussian blur in canonical pixels; noise on feature drops: feature "
                "standard deviations", example="--sigma 4")
    check_range("block", c.block, meaning="pixels per pixelation block side", example="--block 8")
    if c.labels is not None:
        bad = [x for x in c.labels if not isinstance(x, str) or not x.strip()]
        if bad or not c.labels:
            raise ConfigError(f"labels={list(c.labels)!r} must be a non-empty list of manifest column names; "
                              "e.g. --labels gender,expression (or leave it out to use drop.yaml's)")
    if c.name is not None and (not isinstance(c.name, str) or not _NAME.match(c.name)):
        raise ConfigError(f"name={c.name!r} must be a dataset name of 1-128 letters, digits, spaces, '.', '_' or '-' "
                          "starting with a letter or digit (no path: it names the dataset and its lineage); "
                          "e.g. --name london-2026")
