"""Image sequences: one de-identified identity per person across all their frames, expression frame by frame.

The multi-factor model (:class:`deid.anonymise.methods_factor.MultiFactor`) already fits one
identity factor per *person* (from all their frames and stills) and de-identifies it once,
with people-aware k-Same; every frame of a person then carries the same de-identified identity
(the cluster's mean identity), in every sequence of that person. :class:`SequenceMultiFactor`
gives each frame the effects of its own labels (``non_identity="labels"``, the release flow's
choice): expression changes from frame to frame as the frames' labels do. Keeping each frame's
own residual (``"frames"``, a mouth half open stays half open) is possible but the gate rejects
it: the residual identifies the source frame (see :data:`SEQUENCE_NON_IDENTITY`). The method
``multi-factor-expression`` keeps it with privacy: each frame's residual averaged over a group of
frames of >= k people with the same labels (:data:`SEQUENCE_MODES`, MultiFactor's ``"label-groups"``).

Methods that cluster *images* (the k-Same family) put the frames of one person into different
clusters, so their identity flickers from frame to frame: :func:`sequence_warning` says so.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from deid.errors import ConfigError, DataError
from deid.anonymise.methods_factor import MultiFactor

logger = logging.getLogger(__name__)

# What each frame of a sequence keeps as its non-identity factor (MultiFactor's ``non_identity``):
# its labels' effects. The release flow's gate judged the alternatives on a synthetic sequence drop
# (30 people x 2 sequences x 12 frames, k=3): "frames" fails re-identification (the parrot attacker,
# holding the source frames, matches every released frame: 1.0) and expression utility (a classifier
# trained on the release: 0.30 on held-out real faces vs 0.90); "grouped" passes re-identification
# (exact bound) but fails the same utility (0.39); "labels" is released (see SequenceMultiFactor).
SEQUENCE_NON_IDENTITY = "labels"
# The multi-factor methods of the registry and the non-identity mode each runs with on sequences:
# "multi-factor" the labels' effects (above), "multi-factor-expression" each frame's own expression
# residual averaged over a group of frames of >= k distinct people with the same labels
# (MultiFactor's "label-groups"; bench/bench_expression_frames.py measures it against "labels").
SEQUENCE_MODES: dict[str, str] = {"multi-factor": SEQUENCE_NON_IDENTITY, "multi-factor-expression": "label-groups"}


@dataclass(frozen=True)
class Sequences:
    """Sequence membership of n records: ``keys[i]`` (None: a still image) and ``frames[i]``.

    ``order`` maps each sequence key to its record indices in frame order.
    """

    keys: tuple[Hashable | None, ...]
    frames: tuple[int | None, ...]
    order: Mapping[Hashable, tuple[int, ...]]

    @property
    def n_sequences(self) -> int:
        return len(self.order)


def check_sequences(sequences: Sequence[Hashable | None], frames: Sequence[Any] | None, *,
                    people: Sequence[Hashable], n: int) -> Sequences:
    """Validate per-record sequence keys and frame numbers (one person per sequence, no repeated frame).

    ``frames`` None numbers each sequence's records in the given order. Raises ConfigError naming the problem.
    """
    keys = list(sequences)
    if len(keys) != n or len(people) != n:
        raise ConfigError(f"sequences has {len(keys)} entries and people {len(people)}, but images has {n} rows; "
                          "pass one sequence key (None for a still image) and one person per face")
    if frames is None:
        seen: dict[Hashable, int] = {}
        nums: list[int | None] = []
        for key in keys:
            nums.append(None if key is None else seen.setdefault(key, 0))
            if key is not None:
                seen[key] += 1
    else:
        nums = list(frames)
        if len(nums) != n:
            raise ConfigError(f"frames has {len(nums)} entries but images has {n} rows; one frame number per face")
    order: dict[Hashable, list[tuple[int, int]]] = {}
    owner: dict[Hashable, Hashable] = {}
    for i, (key, f) in enumerate(zip(keys, nums)):
        if key is None:
            if f is not None:
                raise DataError(f"record {i} has frame {f!r} but no sequence; give both or neither")
            continue
        if isinstance(f, bool) or not isinstance(f, Integral) or f < 0:
            raise DataError(f"frames[{i}]={f!r} must be an integer >= 0 (the frame's position in its sequence)")
        if owner.setdefault(key, people[i]) != people[i]:
            raise DataError(f"sequence {key!r} holds frames of people {owner[key]!r} and {people[i]!r}; a sequence "
                              "shows one person (fix the manifest's sequence or subject_id column)")
        order.setdefault(key, []).append((int(f), i))
    for key, items in order.items():
        fs = [f for f, _ in items]
        if len(set(fs)) != len(fs):
            raise DataError(f"sequence {key!r} lists a frame number twice; frames must be unique within a sequence")
    return Sequences(tuple(keys), tuple(None if f is None else int(f) for f in nums),
                     {key: tuple(i for _, i in sorted(items)) for key, items in order.items()})


class SequenceMultiFactor(MultiFactor):
    """Multi-factor de-identification of image sequences (the chapter's video extension).

    As :class:`deid.anonymise.methods_factor.MultiFactor`: each face's eigenface coefficients are an
    identity factor per person plus label effects plus a residual; the people's identity
    factors are de-identified once with people-aware k-Same (>= k distinct people per
    cluster). Here every frame keeps its non-identity factor inside the span of the label
    effects (by default its labels' effects) and takes its person's de-identified identity
    everywhere else, so outside that span all frames of a person, in all their sequences, carry
    exactly one identity. The registry's guarantee stays that of ``multi-factor`` (empirical);
    with ``"labels"`` the frames of a cell share one image and the gate finds the exact bound in
    the data when every cell holds >= k people (and no video narrows its cell's people below k:
    :func:`deid.evaluation.sequences.sequence_linkage_check`).

    Parameters
    ----------
    k, n_components, select_identity, n_iter, random_state
        As :class:`~deid.anonymise.methods_factor.MultiFactor`.
    non_identity : {"labels", "frames", "grouped", "label-groups", "projected", "residual"}, default "labels"
        ``"labels"`` gives every frame its labels' effects: all frames of one identity cluster
        with the same labels get the identical image, and ``labels_`` are those cells (so the
        gate sees the k-Same structure and its exact bound; a cell with fewer than k people or
        a person above 1/k is merged within its identity cluster, as for stills:
        :func:`~deid.anonymise.methods_factor.release_cells`). The video steps between label averages: expression changes
        are kept at the labels' granularity (a classifier trained on source frames gives the
        released frame the label it gives the source frame in 0.80 of frames, as with
        "frames"), not within a label. ``"frames"`` keeps each frame's own residual in the
        label-effect span: continuous expression, but a fingerprint of the source frame (the
        parrot attacker matches every released frame, 1.0) and a release on which a trained
        classifier transfers badly to real faces (0.39 vs 0.77 on held-out people; 0.73 before
        the uint8 rounding: the release varies in a few directions only and the classifier
        fits the rounding noise of the others). ``"grouped"`` averages that residual over
        groups of frames of all the people of an identity cluster (exact bound again) but has
        the same utility failure (0.41). ``"label-groups"`` (method ``multi-factor-expression``)
        averages it over groups of frames of >= k people with the same labels within an identity
        cluster's label cell, matched nearest in expression space (exact bound; see
        bench/bench_expression_frames.py). ``"projected"`` also carries the person's own identity
        component inside the label-effect span; ``"residual"`` keeps the whole deviation from
        the person's identity (leaks identity, see MultiFactor).

    Attributes
    ----------
    sequences_ : Sequences
        The validated sequence membership (``order``: record indices per sequence, in frame order).
    (and those of MultiFactor)

    References
    ----------
    R. Gross, L. Sweeney, J. Cohn, F. de la Torre, S. Baker. Face de-identification. In
    Protecting Privacy in Video Surveillance, Springer 2009, ch. 8 (multi-factor models and
    their use on video sequences).
    """

    def __init__(self, k: int = 5, *, n_components: int = 50, non_identity: str = SEQUENCE_NON_IDENTITY,
                 select_identity: bool = True, n_iter: int = 50, random_state: int = 0):
        super().__init__(k, n_components=n_components, non_identity=non_identity, select_identity=select_identity,
                         n_iter=n_iter, random_state=random_state)

    def fit(self, X: Any, *, people: Sequence[Hashable], labels: Mapping[str, Sequence[Hashable]] | None = None,
            sequences: Sequence[Hashable | None] | None = None,
            frames: Sequence[Any] | None = None) -> "SequenceMultiFactor":
        """Fit on frames (and stills) ``X`` of ``people``; ``sequences``/``frames`` place each in its sequence."""
        people = list(people)
        n = len(np.asarray(X))
        self.sequences_ = check_sequences([None] * n if sequences is None else sequences, frames, people=people, n=n)
        # With "labels", MultiFactor's clusters are the cells (identity cluster x labels) whose frames
        # share one image (deid.anonymise.methods_factor.release_cells): the k-Same structure the gate checks.
        super().fit(X, people=people, labels=labels)
        return self

    def fit_transform(self, X: Any, *, people: Sequence[Hashable],
                      labels: Mapping[str, Sequence[Hashable]] | None = None,
                      sequences: Sequence[Hashable | None] | None = None,
                      frames: Sequence[Any] | None = None) -> np.ndarray:
        """Fit, then return the released frames (uint8)."""
        from deid.anonymise.methods_ksame import to_uint8  # noqa: PLC0415

        return to_uint8(self.fit(X, people=people, labels=labels, sequences=sequences, frames=frames).released_)


def sequence_options(method: str) -> dict[str, Any] | None:
    """The estimator options ``method`` runs with on a drop of image sequences (None: its own defaults).

    The gate re-applies the method (parrot attacker, utility folds) with them, so it judges the
    model the release was made with: :class:`SequenceMultiFactor`'s non-identity factor.
    """
    return {"non_identity": SEQUENCE_MODES[method]} if method in SEQUENCE_MODES else None


def sequence_warning(method: str) -> str | None:
    """Why ``method`` does not keep one identity per person across frames, or None when it does."""
    if method in SEQUENCE_MODES:
        return None
    return (f"{method} de-identifies each frame on its own (k-Same clusters images, not people), so the frames of "
            "one sequence can take different identities; use --method multi-factor (or multi-factor-expression) for "
            "image sequences")
