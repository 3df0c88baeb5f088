"""Synthetic feature drops with a known identity and label structure (``deid synth --kind features``).

Record ``i`` of person ``p`` is the sum of three seeded parts, in ``dim`` dimensions::

    x = identity_scale * u[p] + label_scale * sum_l w_l[value_l(p, i)] + noise * e[p, i]

with ``u``, ``w`` and ``e`` standard normal. A *person label* (e.g. gender) has one value per
person, drawn at random; a *record label* (e.g. expression) varies within a person: record
``i`` of person ``p`` takes value ``(p + i) mod V``, so everyone shows several values. The
identity part makes people recognisable: by default (identity 2, labels 1, noise 0.5) two
records of one person differ by their record labels and noise, about ``sqrt(2 dim (1 +
0.25))``, two people with the same labels by about ``sqrt(2 dim (4 + 0.25))``, so a record's
nearest neighbour is its own person's. The label parts make the labels learnable: what
de-identification must hide and what it must keep. The same arguments give the same bytes;
person ``p`` is the same in every drop of a seed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from numbers import Integral, Real
from pathlib import Path

import numpy as np

from deid.errors import ConfigError
from deid.intake.features import write_feature_drop

DEFAULT_LABELS = ("gender", "expression")
DEFAULT_PERSON_LABELS = ("gender",)


@dataclass(frozen=True)
class SyntheticFeatures:
    """Vectors (n, dim) float32 with their people, labels and which labels are person-level."""

    vectors: np.ndarray
    people: tuple[str, ...]
    record_ids: tuple[str, ...]
    labels: dict[str, tuple[str, ...]]
    person_labels: tuple[str, ...]


def parse_labels(spec: str | list[str] | tuple[str, ...] | None) -> dict[str, int]:
    """``"gender,expression=3"`` -> ``{"gender": 2, "expression": 3}`` (label name -> number of values)."""
    if spec is None:
        return {x: 2 for x in DEFAULT_LABELS}
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    out: dict[str, int] = {}
    for item in items:
        if not item:
            continue
        name, _, v = item.partition("=")
        name = name.strip()
        try:
            values = int(v) if v else 2
        except ValueError:
            raise ConfigError(f"labels={spec!r}: {item!r} must be NAME or NAME=V with V an integer, e.g. "
                              "gender,expression=3") from None
        if not name or not 2 <= values <= 100 or name in out:
            raise ConfigError(f"labels={spec!r}: {item!r} needs a new name and 2 <= V <= 100 values, e.g. "
                              "gender,expression=3")
        out[name] = values
    return out


def _check_int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or not lo <= value <= hi:
        raise ConfigError(f"{name}={value!r} must be an integer between {lo} and {hi}")
    return int(value)


def _check_scale(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= value <= 1000:
        raise ConfigError(f"{name}={value!r} must be a number in [0, 1000]; e.g. 1.0")
    return float(value)


def synthetic_features(*, people: int, per_person: int = 2, dim: int = 32, labels: str | list[str] | None = None,
                       person_labels: tuple[str, ...] | list[str] | None = None, seed: int = 0,
                       identity_scale: float = 2.0, label_scale: float = 1.0, noise: float = 0.5) -> SyntheticFeatures:
    """Seeded feature vectors with identity, label and noise parts (see the module docstring)."""
    people = _check_int("people", people, 1, 10_000_000)
    per_person = _check_int("per_person", per_person, 1, 10_000)
    dim = _check_int("dim", dim, 2, 100_000)
    _check_int("seed", seed, 0, 2**63 - 1)
    scales = [_check_scale(n, v) for n, v in (("identity_scale", identity_scale), ("label_scale", label_scale),
                                                ("noise", noise))]
    spec = parse_labels(labels)
    plabels = tuple(DEFAULT_PERSON_LABELS if person_labels is None else person_labels)
    unknown = [x for x in plabels if x not in spec]
    if unknown and person_labels is not None:
        raise ConfigError(f"person_labels={list(plabels)!r} names {unknown}, which are not among labels {list(spec)}")
    plabels = tuple(x for x in plabels if x in spec)
    directions = {x: np.random.default_rng([seed, 2, j]).standard_normal((v, dim))
                  for j, (x, v) in enumerate(spec.items())}
    n = people * per_person
    out = np.empty((n, dim), dtype=np.float32)
    who, rids = [], []
    values: dict[str, list[str]] = {x: [] for x in spec}
    r = 0
    for p in range(people):
        rng = np.random.default_rng([seed, 1, p])
        u = rng.standard_normal(dim)
        fixed = {x: int(rng.integers(spec[x])) for x in plabels}
        noise_rng = np.random.default_rng([seed, 3, p])
        for i in range(per_person):
            x = scales[0] * u + scales[2] * noise_rng.standard_normal(dim)
            for name, v in spec.items():
                value = fixed[name] if name in fixed else (p + i) % v
                x = x + scales[1] * directions[name][value]
                values[name].append(f"{name[0]}{value}")
            out[r] = x
            who.append(f"s{p:06d}")
            rids.append(f"rec-{p:06d}-{i:03d}")
            r += 1
    return SyntheticFeatures(out, tuple(who), tuple(rids), {x: tuple(v) for x, v in values.items()}, plabels)


def make_feature_drop(drop_dir: str | os.PathLike, *, people: int, per_person: int = 2, dim: int = 32,
                      labels: str | list[str] | None = None, person_labels: tuple[str, ...] | list[str] | None = None,
                      seed: int = 0, identity_scale: float = 2.0, label_scale: float = 1.0, noise: float = 0.5,
                      name: str | None = None) -> Path:
    """Write a synthetic feature drop (``vectors.parquet``, ``drop.yaml``, ``_READY``); return its path."""
    drop = Path(drop_dir)
    if drop.exists() and (not drop.is_dir() or any(drop.iterdir())):
        raise ConfigError(f"drop_dir={str(drop)!r} exists and is not an empty directory; pass a new or empty "
                          "directory so no existing drop is mixed in")
    s = synthetic_features(people=people, per_person=per_person, dim=dim, labels=labels, person_labels=person_labels,
                           seed=seed, identity_scale=identity_scale, label_scale=label_scale, noise=noise)
    return write_feature_drop(drop, vectors=s.vectors, subject_ids=list(s.people),
                              labels={x: list(v) for x, v in s.labels.items()}, record_ids=list(s.record_ids),
                              name=name, extra_yaml={"synthetic": {
                                  "seed": seed, "people": people, "per_person": per_person, "dim": dim,
                                  "person_labels": list(s.person_labels), "identity_scale": float(identity_scale),
                                  "label_scale": float(label_scale), "noise": float(noise)}})
