"""Attribute-preserving k-Same (deid.anonymise.methods_attribute): other people's faces moved to the face's labels."""
from __future__ import annotations

import numpy as np
import pytest

from deid.errors import ConfigError
from deid.anonymise.methods import deidentify, guarantee, parrot_for
from deid.anonymise.methods_attribute import AttributePreserving

SHAPE = (10, 9)


def faces(n_people=30, seed=0):
    """Identity (4-D, sd 25) + expression (+-4) + gender (+-4), orthogonal: nearest faces mix attributes."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(SHAPE[0] * SHAPE[1], 6)))[0]
    u_id, u_ex, u_g = basis[:, :4], basis[:, 4], basis[:, 5]
    ident = rng.normal(scale=25, size=(n_people, 4))
    people = np.repeat(np.arange(n_people), 2)
    smile = np.tile([-1, 1], n_people)
    male = np.where(people % 3 == 0, 1, -1)
    x = (128 + ident[people] @ u_id.T + 4 * np.outer(smile, u_ex) + 4 * np.outer(male, u_g)
         + rng.normal(scale=0.5, size=(len(people), len(u_ex))))
    labels = {"expression": np.where(smile > 0, "smiling", "neutral"), "gender": np.where(male > 0, "m", "f")}
    return np.clip(np.rint(x), 0, 255).astype(np.uint8), people, labels, ident, smile, male, u_id, u_ex, u_g


def test_attribute_preserving_moves_other_peoples_faces_to_the_targets_attributes():
    x, people, labels, ident, smile, male, u_id, u_ex, u_g = faces()
    m = AttributePreserving(4, n_components=8).fit(x, people=people, labels=labels)
    for i, row in enumerate(m.donors_):  # k faces of k other people
        assert len(set(people[row])) == 4 and people[i] not in set(people[row])
    rel = m.released_ - 128
    # Attributes follow the target (the donors' own attributes are mixed, their moved average is not).
    np.testing.assert_allclose(rel @ u_ex, 4 * smile, atol=1.5)
    np.testing.assert_allclose(rel @ u_g, 4 * male, atol=1.5)
    # Without the transfer the donors' own attributes would show: far from the target's.
    # (enough faces whose donors' mean attribute is >= 2 off the target's, i.e. >= 1 of 4 donors differs).
    assert (np.abs(4 * smile[m.donors_].mean(axis=1) - 4 * smile) >= 2).sum() >= 10
    assert (np.abs(4 * male[m.donors_].mean(axis=1) - 4 * male) >= 2).sum() >= 10
    # Identity is the donors' mean, not the target's, plus what the gender direction carries:
    # gender is constant per person, so its direction also holds the sample's male - female
    # mean identity (the linear transfer moves that too).
    gap = ident[people[male > 0]].mean(axis=0) - ident[people[male < 0]].mean(axis=0)
    want = ident[people[m.donors_]].mean(axis=1) + np.outer((male - male[m.donors_].mean(axis=1)) / 2, gap)
    np.testing.assert_allclose(rel @ u_id, want, atol=3)
    assert np.abs(rel @ u_id - ident[people]).mean() > 5  # not the target's own identity (measured 9.2)


def test_attribute_preserving_by_name_parrot_and_errors():
    x, people, labels, *_ = faces(n_people=10, seed=1)
    released, clusters = deidentify(x, shape=SHAPE, people=people, method="attribute-preserving", k=3,
                                    n_components=6, labels=labels)
    assert clusters is None and released.dtype == np.uint8
    parrot = parrot_for("attribute-preserving", shape=SHAPE, people=people, k=3, n_components=6, labels=labels)
    np.testing.assert_array_equal(parrot(x), released)
    assert guarantee("attribute-preserving", 3).startswith("no formal guarantee; the empirical attacks decide")
    with pytest.raises(ConfigError, match="needs labels"):
        AttributePreserving(3).fit(x, people=people)
    with pytest.raises(ConfigError, match="alpha=0"):
        AttributePreserving(3, alpha=0).fit(x, people=people, labels=labels)
    with pytest.raises(ConfigError, match="at least 11 distinct people"):
        AttributePreserving(10).fit(x, people=people, labels=labels)
