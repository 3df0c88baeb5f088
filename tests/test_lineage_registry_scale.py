"""Issue 13: appending to the lineage registry does not decrypt and replay every entry again."""
from __future__ import annotations

import dataclasses

import numpy as np

from deid.release import lineage_registry as lr
from deid.release.lineage import replay
from tests.test_lineage import _two_releases


def _same_state(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "clusters":
            assert x.keys() == y.keys()
            for key in x:
                assert np.array_equal(x[key].image, y[key].image) and x[key].members == y[key].members
        else:
            assert x == y, f.name


def test_appends_equal_a_full_replay_and_skip_reloading_an_unchanged_registry(tmp_path, monkeypatch):
    w, reg, s2 = _two_releases(tmp_path)  # rel-a published, rel-b pending
    loads = []
    monkeypatch.setattr(lr.Registry, "load", lambda self, _load=lr.Registry.load: loads.append(1) or _load(self))
    s3 = reg.mark_published(s2, "rel-b")  # the state is the registry's: no reload
    assert loads == []
    _same_state(s3, replay(s3.dataset, s3.entries, seq=s3.seq, head=s3.head, images=s3.images))
    _same_state(s3, reg.load())
    assert [r.status for r in s3.releases] == ["published", "published"]


def test_a_registry_that_moved_on_is_reloaded_and_refused(tmp_path):
    import pytest

    w, reg, s2 = _two_releases(tmp_path)
    reg.mark_published(s2, "rel-b")
    with pytest.raises(lr.LineageError, match="moved on"):
        reg.mark_abandoned(s2, "rel-b")  # s2 is one entry behind the registry
