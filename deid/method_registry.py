"""The method registry: what each de-identification method promises and how the pipeline treats it.

The one list of methods: the CLI's ``--method`` choices, the settings' ``Method`` type, the
flow (partitions or not, colour), the gate, the study and the report read it. Light on
purpose (no NumPy or OpenCV import), so the CLI can offer the choices without loading them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from deid.errors import ConfigError


def _formal(what: str) -> Callable[[int | None], str]:
    def text(k: int | None) -> str:
        return (f"formal: 1/k = 1/{k} bound on re-identification by any recogniser, because every released face "
                f"is {what} of a cluster of at least k={k} distinct people, identical for every member (structural "
                "check min_distinct_people_per_cluster >= k; Newton et al. 2005, counting people)")
    return text


def _empirical(why: str) -> Callable[[int | None], str]:
    return lambda k: f"no formal guarantee; the empirical attacks decide ({why})"


# How the CLI help presents each group of methods, in this order.
GROUPS: dict[str, str] = {
    "formal": "formal k-Same guarantee",
    "empirical": "the gate's attacks decide",
    "comparison": "for comparison: the gate rejects them",
    "control": "a control the gate must reject",
}


@dataclass(frozen=True)
class MethodSpec:
    """What the rest of deid needs to know about one de-identification method.

    Attributes
    ----------
    name : str
        The ``--method`` name.
    strength : str
        The keyword that sets its strength (``k``, ``sigma`` or ``block``).
    partitions_by_labels : bool
        The release flow partitions the faces by the utility labels before it runs.
    identical_within_cluster : bool
        Every member of a cluster gets the identical image (the k-Same structure).
    clustered : bool
        It returns a cluster index per face, every cluster holding >= k distinct people.
    guarantee : callable
        ``guarantee(k) -> str``: what the method promises, for the report.
    cluster_mean : bool
        The released face is the plain pixel mean of its cluster (k-Same on the eigenface
        features): the same mean per colour channel is then the colour release (``DEID_COLOR``).
    counts_people : bool
        Its clusters count distinct people (False: k-same-naive counts images, no guarantee).
    clusters_people : bool
        It clusters *people*, not images: every face of a person takes the person's one
        de-identified identity (multi-factor), so a partition allows at most ``floor(people / k)``
        identity clusters, however many faces (video frames) each person has.
    group : str
        How the CLI help and the messages present it (:data:`GROUPS`): ``formal`` (the k-Same
        guarantee), ``empirical`` (the gate's attacks decide), ``comparison`` (kept to show what the
        gate rejects) or ``control`` (feature drops' analogue of blur).
    on_features : bool
        It also runs on feature-vector drops (:mod:`deid.anonymise.features`).
    note : str
        A few words the CLI help adds after its name (e.g. what kind of drop it is for).
    """

    name: str
    strength: str
    partitions_by_labels: bool
    identical_within_cluster: bool
    clustered: bool
    guarantee: Callable[[int | None], str]
    cluster_mean: bool = False
    counts_people: bool = True
    clusters_people: bool = False
    group: str = "formal"
    on_features: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"MethodSpec {self.name!r}: group={self.group!r} must be one of {list(GROUPS)}")

    @property
    def repairs_near_copies(self) -> bool:
        """The de-identification stage repairs near-copy clusters (:mod:`deid.anonymise.near_copy`).

        Only where every member receives its cluster's identical pixel mean and clusters count
        people: merging two such clusters keeps >= k people and every share <= 1/k, and the merged
        image is the mean of the union. Every other method is judged by the gate as made.
        """
        return self.identical_within_cluster and self.cluster_mean and self.counts_people


_NAIVE = ("no formal guarantee: clusters count images, not people, so one person's images can make up "
          "several of the k members of a cluster")
REGISTRY: dict[str, MethodSpec] = {s.name: s for s in (
    MethodSpec("k-same-select", "k", True, True, True, _formal("the pixel average"), cluster_mean=True,
               on_features=True, note="default"),
    MethodSpec("k-same", "k", False, True, True, _formal("the pixel average"), cluster_mean=True, on_features=True),
    MethodSpec("k-same-naive", "k", False, True, True, lambda k: _NAIVE, cluster_mean=True,
               counts_people=False, group="comparison", on_features=True),
    MethodSpec("blur", "sigma", False, False, False, lambda k: "no formal guarantee", group="comparison"),
    MethodSpec("pixelate", "block", False, False, False, lambda k: "no formal guarantee", group="comparison"),
    # k-Same-Eigen and k-Same-M run inside the label partitions, as k-Same-Select does: without
    # them London at k=5 fails the gate's utility checks (gender/expression cv accuracy 0.68/0.67
    # and 0.71/0.70 against 0.88/0.91 on the originals); with them both are released.
    MethodSpec("k-same-eigen", "k", True, True, True,
               _formal("the eigenface reconstruction of the mean coefficients")),
    MethodSpec("k-same-m", "k", True, True, True,
               _formal("the shape-and-appearance (landmark or optical-flow registered) average")),
    # k-Same-M as the paper fits it: clusters in an AAM's parameter space (deid.anonymise.methods_aam).
    MethodSpec("k-same-aam", "k", True, True, True,
               _formal("the rendering of the mean parameters of a fitted shape-and-appearance model (AAM)")),
    MethodSpec("multi-factor", "k", False, False, True,
               _empirical("identity factors are k-Same averaged over >= k people and every face keeps a non-identity "
                          "factor: its labels' effects by default, so the faces of an identity cluster x label cell "
                          "share one image and the gate can find the exact bound in the data; its own residual in "
                          "the other modes"), clusters_people=True, group="empirical", on_features=True),
    MethodSpec("multi-factor-expression", "k", False, False, True,
               _empirical("multi-factor with per-frame expression: identity factors are k-Same averaged over >= k "
                          "people and each face's own expression residual is replaced by the mean over a group of "
                          ">= k distinct people's faces with the same labels in its identity cluster; a group's faces "
                          "share one image, so the gate can find the exact bound in the data"), clusters_people=True,
               group="empirical", note="video: expression per frame"),
    MethodSpec("selective-mean", "k", False, False, False,
               _empirical("each face is a weighted mean over its own random set of k faces of k people, in which "
                          "it keeps a higher weight on label-relevant features; sets overlap, there are no clusters"),
               group="empirical", on_features=True),
    MethodSpec("attribute-preserving", "k", False, False, False,
               _empirical("each face is the average of k random faces of k other people (drawn with the release's "
                          "secret seed), moved to its labels by a linear transfer in eigenface space (not the "
                          "paper's GAN); no clusters"), group="empirical", on_features=True),
)}

# Methods of feature-vector releases (deid.anonymise.features). ``noise`` (Gaussian noise on each
# vector) is the feature analogue of blur: a control without a guarantee, which the gate must
# reject. It is kept out of REGISTRY, which lists the methods of face releases (the flow, the
# CLI's DEID_METHOD, the study).
FEATURE_ONLY: dict[str, MethodSpec] = {s.name: s for s in (
    MethodSpec("noise", "sigma", False, False, False,
               lambda k: "no formal guarantee: each vector plus Gaussian noise (a control, like blur for faces)",
               group="control", on_features=True, note="feature drops"),
)}
# Methods of feature-vector drops: those of REGISTRY that also run on vectors, then the feature-only ones.
FEATURE_METHODS: tuple[str, ...] = (*(n for n, s in REGISTRY.items() if s.on_features), *FEATURE_ONLY)
# Face methods that need face images (never run on feature vectors): what a feature drop's message names.
IMAGE_ONLY_METHODS: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if not s.on_features)


def method_help() -> str:
    """The ``--method`` help of the CLI, from the registry: each group of methods with what it promises."""
    specs = [*REGISTRY.values(), *FEATURE_ONLY.values()]
    parts = []
    for group, says in GROUPS.items():
        names = [s.name + (f" ({s.note})" if s.note else "") for s in specs if s.group == group]
        if names:
            parts.append(f"{', '.join(names)}: {says}")
    return ("; ".join(parts) + f". Feature drops take {', '.join(FEATURE_METHODS)}; "
            f"{', '.join(IMAGE_ONLY_METHODS)} need face images")


def method_spec(method: str) -> MethodSpec:
    """The :class:`MethodSpec` of a face method (:data:`REGISTRY`) or a feature-only one (:data:`FEATURE_ONLY`)."""
    spec = REGISTRY.get(method) or FEATURE_ONLY.get(method)
    if spec is None:
        raise ConfigError(f"method={method!r} must be one of {list(REGISTRY)} (faces) or {list(FEATURE_METHODS)} "
                          "(feature vectors)")
    return spec


METHODS: tuple[str, ...] = tuple(REGISTRY)
# Methods whose strength is k (the gate's 1/k bound is the reference for them).
K_METHODS: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.strength == "k")
# Methods that release clusters of >= k distinct people (what a method releasing one image per face is told to use).
CLUSTER_METHODS: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.clustered and s.counts_people)
# Which keyword sets each method's strength.
STRENGTH: dict[str, str] = {n: s.strength for n, s in REGISTRY.items()}


def _check_method(method: Any) -> str:
    if method not in METHODS:
        raise ConfigError(f"method={method!r} must be one of {list(METHODS)}")
    return method


# Methods whose released face is the plain mean of its cluster (colour releases, DEID_COLOR).
COLOR_METHODS: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.cluster_mean)


def guarantee(method: str, k: int | None = None) -> str:
    """One-line statement of what the method promises, for the report (:attr:`MethodSpec.guarantee`)."""
    return method_spec(method).guarantee(k)


def release_guarantee(method: str, k: int, *, exact: bool, promise: str | None = None) -> str:
    """What the report says a run guarantees: the method's promise, or the exact bound the gate found in the data.

    ``exact``: the gate found every released cluster one identical image (or vector) of >= k
    distinct people with no person above 1/k (``exact_bound`` with both structural checks holding).
    A method without a formal guarantee then carries the k-Same bound in this release (e.g.
    multi-factor in its "labels" mode, whose cells are identical images); otherwise its own promise
    stands. ``promise``: the method's promise on this kind of drop (default: on faces, :func:`guarantee`).
    """
    text = guarantee(method, k) if promise is None else promise
    if not exact or not text.startswith("no formal guarantee"):
        return text
    return (f"exact in this release: 1/k = 1/{k} bound on re-identification by any recogniser, because the gate "
            f"found every released record identical for every member of its cluster, each cluster of at least k={k} "
            f"distinct people with no person above 1/k of its images (structural checks min_distinct_people_per_"
            f"cluster >= k, max_person_share <= 1/k on identical copies); the method itself promises less: {text}")
