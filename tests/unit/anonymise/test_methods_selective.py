"""Selective weighted mean (deid.anonymise.methods_selective): set size, purity, retention, weight."""
from __future__ import annotations

import numpy as np
import pytest

from deid.errors import ConfigError
from deid.anonymise.methods import deidentify, guarantee, parrot_for
from deid.anonymise.methods_selective import SelectiveMean

SHAPE = (10, 9)


def faces(n_people=30, seed=0):
    """Two faces per person (neutral, smiling); smiling adds 40 grey levels along one direction."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(SHAPE[0] * SHAPE[1], 5)))[0]
    u_id, u_ex = basis[:, :4], basis[:, 4]
    ident = rng.normal(scale=25, size=(n_people, 4))
    people = np.repeat(np.arange(n_people), 2)
    smile = np.tile([0, 1], n_people)
    x = 128 + ident[people] @ u_id.T + 40 * np.outer(smile, u_ex) + rng.normal(scale=0.5, size=(len(people), len(u_ex)))
    expr = np.where(smile == 1, "smiling", "neutral")
    return np.clip(np.rint(x), 0, 255).astype(np.uint8), people, expr, u_ex


@pytest.mark.parametrize("purity, same", [(1.0, 4), (0.5, 2), (0.0, 0)])
def test_sets_have_k_distinct_people_and_the_requested_purity(purity, same):
    x, people, expr, _ = faces()
    m = SelectiveMean(5, purity=purity, n_components=8).fit(x, people=people, labels={"expression": expr})
    assert m.sets_.shape == (len(x), 5)
    np.testing.assert_array_equal(m.sets_[:, 0], np.arange(len(x)))
    for i, row in enumerate(m.sets_):
        assert len(set(people[row])) == 5
        assert (expr[row[1:]] == expr[i]).sum() == same


def test_retained_features_keep_the_label_and_weights_follow_the_formula():
    x, people, expr, u_ex = faces(seed=1)
    labels = {"expression": expr}
    smile = expr == "smiling"
    kept = SelectiveMean(5, purity=0.0, weight=1.0, retention=0.25, n_components=8).fit(x, people=people, labels=labels)
    plain = SelectiveMean(5, purity=0.0, weight=0.2, retention=0.25, n_components=8).fit(x, people=people, labels=labels)
    assert kept.retained_.sum() == 2  # round(0.25 * 8)

    def ex(model):  # the expression component, centred
        return (model.released_ - 128) @ u_ex - 20

    # Every other set member has the other expression (purity 0): a plain mean pulls the
    # expression towards the middle; full own weight on the retained features keeps it.
    assert ((ex(kept) > 0) == smile).mean() == 1.0
    assert np.abs(ex(kept) - np.where(smile, 20, -20)).max() < 5  # measured 3.2
    assert ((ex(plain) > 0) == smile).mean() < 0.2  # 0.2 own + 0.8 other expression: flipped
    # The released coefficients are the weighted means of the formula.
    from deid.alignment.features import Eigenfaces
    e = Eigenfaces(8, random_state=0).fit(x)
    z = e.transform(x).astype(float)
    w = np.where(kept.retained_, 1.0, 0.2)
    want = w * z + (1 - w) * z[kept.sets_[:, 1:]].mean(axis=1)
    np.testing.assert_allclose(e.transform(kept.released_), want, atol=1e-2)


def test_selective_mean_by_name_mutual_info_parrot_and_errors():
    x, people, expr, _ = faces(n_people=12, seed=2)
    labels = {"expression": expr}
    released, clusters = deidentify(x, shape=SHAPE, people=people, method="selective-mean", k=3, n_components=6,
                                    labels=labels, options={"relevance": "mutual-info"})
    assert clusters is None and released.shape == x.shape
    parrot = parrot_for("selective-mean", shape=SHAPE, people=people, k=3, n_components=6, labels=labels,
                        options={"relevance": "mutual-info"})
    np.testing.assert_array_equal(parrot(x), released)
    nolabels = SelectiveMean(3, n_components=6).fit(x, people=people)
    assert not nolabels.retained_.any()
    assert guarantee("selective-mean", 3).startswith("no formal guarantee; the empirical attacks decide")
    for kw, msg in (({"purity": 1.5}, "purity=1.5"), ({"weight": 0.1}, "weight=0.1"),
                    ({"relevance": "svm"}, "relevance='svm'"), ({"attribute": "age"}, "attribute='age'")):
        with pytest.raises(ConfigError, match=msg):
            SelectiveMean(3, **kw).fit(x, people=people, labels=labels)
    with pytest.raises(ConfigError, match="at least 13 distinct people"):
        SelectiveMean(13).fit(x, people=people)
