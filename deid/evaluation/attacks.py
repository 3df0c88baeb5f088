"""Re-identification attacks used to check that a release keeps its 1/k promise.

Five face recognisers (``ATTACKERS``), each fitted by the attacker on the original aligned
faces, and three ways of using them (Newton et al. 2005; Gross et al. 2009 §2.2):

* ``naive``: released faces are the probes, originals the gallery;
* ``reverse``: originals are the probes, released faces the gallery;
* ``parrot``: the attacker applies the same de-identification to its gallery of originals
  first (and trains its recogniser on that), then matches released faces against it.

Credit for a probe is given at the person level (right person, any of their images) and
split evenly over every gallery item tied at the best score, so identical released images
can never be credited by their position in a list. :func:`attack_all` runs every
attacker in every mode. The recognisers are in :mod:`deid.evaluation.attackers`, the
scoring in :mod:`deid.evaluation.scoring`.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Iterable, Literal, Sequence

import numpy as np

from deid.errors import ConfigError
from deid.evaluation.attackers import (
    FisherfacesAttacker,
    LBPAttacker,
    MahalanobisAttacker,
    ReleaseRefitAttacker,
    WhitenedCosineAttacker,
    _as_matrix,
    _check_shape,
)
from deid.evaluation.feature_attackers import EuclideanAttacker, IdentityClassifierAttacker
from deid.evaluation.scoring import _BLOCK, _check_similarity, _credit_codes, _joint_codes, _rate, unique_rows


logger = logging.getLogger(__name__)


def attack_rate(
    attacker: WhitenedCosineAttacker,
    *,
    originals: Any,
    original_people: Sequence[Hashable],
    released: Any,
    released_people: Sequence[Hashable],
    mode: Literal["naive", "reverse"] = "naive",
    rtol: float = 1e-9,
) -> float:
    """Re-identification rate of an attacker that knows the original faces.

    The attacker is (re)fitted on ``originals`` in both modes.

    * ``"naive"``: released faces are the probes, originals the gallery (who is this
      released face?).
    * ``"reverse"``: originals are the probes, released faces the gallery (which released
      face is this person?).

    Parameters
    ----------
    attacker : WhitenedCosineAttacker
        Any object with ``fit(gallery, people=...)``, ``enroll(gallery, people=...)`` and
        ``similarity(probes)``.
    originals, released : array-like of shape (n, n_pixels)
    original_people, released_people : sequences of hashable
    mode : {"naive", "reverse"}
    rtol : float
        Tie tolerance, see :func:`rank_credit`.
    on_pair : callable, optional
        ``on_pair(attacker, mode)`` after each pair is scored (progress reporting).

    Returns
    -------
    float
        Mean credit over all probes; a k-Same release with one image per person per cluster
        scores at most 1/k in both modes.
    """
    if mode not in ("naive", "reverse"):
        raise ConfigError(f"mode={mode!r} must be 'naive' (released faces as probes) or 'reverse' (originals as probes)")
    orig = _as_matrix(originals, "originals")
    rel = _as_matrix(released, "released")
    attacker.fit(orig, people=original_people)
    if mode == "naive":
        probes, probe_people, gallery, gallery_people = rel, released_people, orig, original_people
    else:
        probes, probe_people, gallery, gallery_people = orig, original_people, rel, released_people
    pc, gc = _joint_codes(probe_people, gallery_people, len(probes), len(gallery))
    if mode == "reverse":
        attacker.enroll(gallery, people=gallery_people)  # PCA stays fitted on the originals
    credits = np.empty(len(probes), dtype=np.float64)
    for start in range(0, len(probes), _BLOCK):
        s = _check_similarity(attacker.similarity(probes[start:start + _BLOCK]), rtol)
        credits[start:start + _BLOCK] = _credit_codes(s, pc[start:start + _BLOCK], gc, rtol)
    return float(credits.mean())



def _dlib_resnet(shape: tuple[int, int]) -> Any:
    from deid.evaluation.recognizer import DlibResNetAttacker  # noqa: PLC0415 - recognizer imports this module

    return DlibResNetAttacker(tuple(shape))


ATTACKERS: dict[str, Callable[[tuple[int, int]], Any]] = {
    "pca-mahalanobis": lambda shape: MahalanobisAttacker(50),
    "pca-whitened-cosine": lambda shape: WhitenedCosineAttacker(50),
    "fisherfaces": lambda shape: FisherfacesAttacker(),
    "lbp-chi2": lambda shape: LBPAttacker(tuple(shape)),
    "release-refit-pca": lambda shape: ReleaseRefitAttacker(50),
    "dlib-resnet": _dlib_resnet,
}
"""Attacker name -> factory ``f(shape) -> unfitted recogniser`` (``shape`` = (height, width))."""

FEATURE_ATTACKERS: dict[str, Callable[[tuple[int, ...]], Any]] = {
    # The Mahalanobis-cosine of the CSU system on the vectors, whitening the leading 50
    # directions (all of them below 50 features). Whitening every direction is a weak
    # attacker: on London's dlib embeddings (204 x 128) the low-variance directions turn a
    # 0.1-sd noise into the dominant signal (rank-1 0.02 with 100+ components, 1.0 with 20-64).
    "feature-whitened-cosine": lambda shape: WhitenedCosineAttacker(min(int(shape[-1]), 50)),
    "feature-euclidean": lambda shape: EuclideanAttacker(),
    "identity-classifier": lambda shape: IdentityClassifierAttacker(),
}
"""Attackers of feature releases (``GateInputs.kind == "features"``): name -> factory
``f(shape) -> unfitted recogniser`` with ``shape = (n_features,)``. They need no image model:
nearest neighbour by whitened cosine and by Euclidean distance, and an identity classifier
trained on the original vectors (:mod:`deid.evaluation.feature_attackers`)."""

DEEP_ATTACKERS: frozenset[str] = frozenset({"dlib-resnet"})
"""Attackers that embed every face with a deep network (~0.09 s of one core per distinct face):
the gate runs them on a smaller sample of whole clusters (``deep_attack_sample``)."""

MODES = ("naive", "reverse", "parrot")


def _check_vector_shape(shape: Any) -> tuple[int]:
    try:
        dims = tuple(int(v) for v in shape)
    except (TypeError, ValueError):
        raise ConfigError(f"shape={shape!r} must be (n_features,) for feature-vector attackers, e.g. (128,)") from None
    if len(dims) != 1 or dims[0] < 1:
        raise ConfigError(f"shape={shape!r} must be (n_features,) with n_features >= 1 for feature-vector attackers")
    return dims


def attack_all(
    *,
    originals: Any,
    original_people: Sequence[Hashable],
    released: Any,
    released_people: Sequence[Hashable],
    shape: tuple[int, int],
    modes: Iterable[str] = MODES,
    parrot: Callable[[np.ndarray], np.ndarray] | None = None,
    attackers: Iterable[str] | None = None,
    rtol: float = 1e-9,
    on_pair: Callable[[str, str], None] | None = None,
) -> list[dict]:
    """Re-identification rate of every attacker in every mode.

    Each recogniser is fitted by the attacker on the images it knows: the originals in
    ``naive`` and ``reverse`` mode, ``parrot(originals)`` in ``parrot`` mode (the attacker
    trains on faces de-identified like the release), and the release itself for
    ``release-refit-pca``.

    * ``naive``: probes = released, gallery = originals;
    * ``reverse``: probes = originals, gallery = released;
    * ``parrot``: probes = released, gallery = ``parrot(originals)`` with the originals' people.

    Parameters
    ----------
    originals : array-like of shape (n, height * width)
        The aligned original faces the attacker holds (at least those of the released people).
    original_people : sequence of hashable, length n
    released : array-like of shape (m, height * width)
    released_people : sequence of hashable, length m
    shape : (int, int) or (int,)
        (height, width) of the aligned faces, or ``(n_features,)`` for the
        :data:`FEATURE_ATTACKERS` of feature vectors.
    modes : iterable of {"naive", "reverse", "parrot"}
    parrot : callable, optional
        ``parrot(originals) -> de-identified originals`` (same shape); required for the
        ``parrot`` mode, e.g. :func:`deid.anonymise.methods.parrot_for`.
    attackers : iterable of str, optional
        Names from :data:`ATTACKERS` (default all of them) or from :data:`FEATURE_ATTACKERS`.
    rtol : float
        Tie tolerance, see :func:`rank_credit`.
    on_pair : callable, optional
        ``on_pair(attacker, mode)`` after each pair is scored (progress reporting).

    Returns
    -------
    list of dict
        One ``{"attacker", "mode", "rate", "n_probes", "credit"}`` per attacker x mode;
        ``rate`` is the mean rank-1 credit at the person level over all probes (ties credited
        fractionally), ``n_probes`` the number of distinct probe images scored and ``credit``
        the summed credit over all probe records.

    References
    ----------
    E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images.
    IEEE TKDE 17(2):232-243, 2005. R. Gross, L. Sweeney, J. Cohn, F. de la Torre, S. Baker.
    Face de-identification. In Protecting Privacy in Video Surveillance, Springer, 2009.
    """
    modes = list(modes)
    names, known, shape, sets = _attack_inputs(originals, original_people, released, released_people, shape=shape,
                                               modes=modes, parrot=parrot, attackers=attackers)
    return _score_pairs(names, modes, known, shape, sets, rtol=rtol, on_pair=on_pair)


def _attack_inputs(originals: Any, original_people: Sequence[Hashable], released: Any,
                   released_people: Sequence[Hashable], *, shape: tuple[int, ...], modes: list[str],
                   parrot: Callable[[np.ndarray], np.ndarray] | None, attackers: Iterable[str] | None):
    """:func:`attack_all`'s arguments checked: ``(attacker names, every attacker by name, shape, sets)`` with
    ``sets`` the ``originals``, ``released`` and ``parrot`` (None without the parrot mode) image matrices and
    their people."""
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"modes={modes!r} must be a non-empty subset of {MODES}")
    names = list(ATTACKERS) if attackers is None else list(attackers)
    known = {**ATTACKERS, **FEATURE_ATTACKERS}
    unknown = [a for a in names if a not in known]
    if unknown or not names:
        raise ConfigError(f"attackers={names!r} must be a non-empty subset of {sorted(ATTACKERS)} (faces) or "
                          f"{sorted(FEATURE_ATTACKERS)} (feature vectors)")
    if any(a in ATTACKERS for a in names):
        if any(a in FEATURE_ATTACKERS for a in names):
            raise ConfigError(f"attackers={names!r} mixes face and feature-vector attackers; pass one kind")
        shape = _check_shape(shape)
        what = f"pixels but shape={tuple(shape)!r} has {shape[0] * shape[1]}; pass the (height, width) of the aligned faces"
    else:
        shape = _check_vector_shape(shape)
        what = f"values but shape={shape!r} says {shape[0]}; pass (n_features,) of the vectors"
    width = int(np.prod(shape))
    orig = _as_matrix(originals, "originals")
    rel = _as_matrix(released, "released")
    for name, a in (("originals", orig), ("released", rel)):
        if a.shape[1] != width:
            raise ConfigError(f"{name} have {a.shape[1]} {what}")
    original_people = list(original_people)
    released_people = list(released_people)
    _joint_codes(released_people, original_people, len(rel), len(orig))  # length checks up front
    gallery_parrot = None
    if "parrot" in modes:
        if parrot is None:
            raise ConfigError("modes includes 'parrot' but parrot=None; pass parrot=deid.anonymise.methods.parrot_for(method, ...) "
                              "or drop 'parrot' from modes")
        gallery_parrot = _as_matrix(parrot(np.asarray(originals)), "parrot(originals)")
        if gallery_parrot.shape != orig.shape:
            raise ConfigError(f"parrot(originals) returned shape {gallery_parrot.shape}; it must keep the originals' shape {orig.shape}")
    sets = {"originals": (orig, original_people), "released": (rel, released_people),
            "parrot": (gallery_parrot, original_people)}
    return names, known, shape, sets


def _score_pairs(names: list[str], modes: list[str], known: dict[str, Any], shape: tuple[int, ...],
                 sets: dict[str, tuple[Any, list]], *, rtol: float,
                 on_pair: Callable[[str, str], None] | None) -> list[dict]:
    """:func:`attack_all`'s rows: every attacker fitted once per training set and scored in every mode, each
    set's distinct rows found once."""
    distinct: dict[str, tuple[np.ndarray, np.ndarray, list]] = {}

    def distinct_rows(key: str) -> tuple[np.ndarray, np.ndarray, list]:
        if key not in distinct:
            a, people = sets[key]
            rows_, index = unique_rows(a)
            first = np.unique(index, return_index=True)[1]
            distinct[key] = (rows_, index, [people[i] for i in first])
        return distinct[key]

    gallery_of = {"naive": "originals", "reverse": "released", "parrot": "parrot"}
    probes_of = {"naive": "released", "reverse": "originals", "parrot": "released"}
    rows = []
    for name in names:
        # One fit per training set: naive and reverse share the recogniser fitted on the
        # originals, and an attacker fitted on the release serves every mode.
        fitted: dict[str, Any] = {}
        for mode in modes:
            attacker = known[name](shape)
            on_release = getattr(attacker, "fit_on", "originals") == "released"
            train_key = "released" if on_release else ("parrot" if mode == "parrot" else "originals")
            if train_key not in fitted:
                train, train_people = sets[train_key]
                fitted[train_key] = attacker.fit(train, people=train_people)
            attacker = fitted[train_key]
            g_rows, g_index, g_people = distinct_rows(gallery_of[mode])
            attacker.enroll(g_rows, people=g_people)
            p_rows, p_index, _ = distinct_rows(probes_of[mode])
            rate, n, credit = _rate(attacker, (p_rows, p_index), sets[probes_of[mode]][1], sets[gallery_of[mode]][1],
                                    rtol, g_index)
            rows.append({"attacker": name, "mode": mode, "rate": rate, "n_probes": n, "credit": credit})
            logger.debug("attack %s/%s: %.4f over %d distinct probes", name, mode, rate, n)
            if on_pair is not None:
                on_pair(name, mode)
    return rows
