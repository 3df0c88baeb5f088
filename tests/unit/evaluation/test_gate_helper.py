"""A gate helper started before the gate (GateHelper) builds the inputs and runs the deep attackers ahead: same figures."""
from __future__ import annotations

from dataclasses import replace

from deid.evaluation.checks import Check
from deid.evaluation.gate_types import GateConfig
from deid.evaluation.gate_parts import GateHelper
from deid.evaluation.gate import evaluate
from integration.evaluation.test_gate_parallel import _gate_inputs

CONFIG = GateConfig(k=5, method="k-same-select", labels=("bright",), repeats=1, deep_attack_sample=5, min_probes=1,
                    attackers=("pca-whitened-cosine", "dlib-resnet"), helper_min_records=0)
STAGING = dict(extra_checks=(Check("from_staging", True, 0, "= 0", "a check staging added"),),
               file_metadata={"x.png": ["EXIF"]})


def build(n_people: int, seed: int, config: object):
    """What the helper process runs first (importable there: spawned processes get this sys.path).

    ``config`` as pipeline.gate_inputs takes the run's: GateHelper.start's own is positional-only.
    """
    assert config == "the run's"
    return _gate_inputs(n_people=n_people, seed=seed)


def test_a_helper_started_before_the_gate_gives_the_gates_figures_and_runs_the_deep_attack_once():
    serial = evaluate(replace(build(20, 2, "the run's"), **STAGING), CONFIG)
    helper = GateHelper.start(CONFIG, build, n_people=20, seed=2, config="the run's")
    parts = []
    try:
        map_ = helper.pool.map
        helper.pool.map = lambda fn, calls, **kw: (parts.extend((c["part"], c.get("attackers")) for c in calls),
                                                   map_(fn, calls, **kw))[1]
        inputs = replace(helper.inputs(), **STAGING)
        assert set(helper.ready()) == {("attack", ("dlib-resnet",))}
        helped = evaluate(inputs, CONFIG, helper=helper)
    finally:
        helper.close()
    # The deep attack ran once, on the helper, ahead; the gate ran the rest.
    assert sorted(parts, key=str) == [("attack", ("pca-whitened-cosine",)), ("cross-fit", None), ("leaks", None),
                                      ("protocols", None)]
    assert helped.checks == serial.checks
    assert [c.name for c in serial.checks].count("from_staging") == 1
    assert next(c for c in serial.checks if c.name == "no_source_metadata").status == "fail"
    assert helped.reidentification == serial.reidentification
    assert {r.attacker for r in serial.reidentification} == {"pca-whitened-cosine", "dlib-resnet"}
    assert helped.utility == serial.utility and (helped.max_rate, helped.attack_sample) == (serial.max_rate,
                                                                                          serial.attack_sample)


def test_a_part_sent_to_the_helper_carries_only_the_inputs_the_helper_did_not_build(monkeypatch):
    """HelperInputs (issue 32): pickled without the per-record fields; unpickled in the helper, the inputs it built
    with the fields the gate added (staging's checks and file metadata); elsewhere a StateError, never other inputs."""
    import pickle

    import pytest

    from deid.errors import StateError
    from deid.evaluation import gate_parts

    built = gate_parts.read_samples_once(build(20, 2, "the run's"), CONFIG)  # as the helper keeps them
    built = replace(built, fetch=replace(built.fetch, fallback=None))
    sent = replace(built, **STAGING)
    blob = pickle.dumps(gate_parts.HelperInputs(sent))
    assert len(blob) < len(pickle.dumps(sent)) / 2
    monkeypatch.setattr(gate_parts, "_PREPARED", {"inputs": built})
    got = pickle.loads(blob)
    assert got.people is built.people and got.clusters is built.clusters and got.fetch is built.fetch
    assert (got.file_metadata, got.extra_checks) == (STAGING["file_metadata"], STAGING["extra_checks"])
    monkeypatch.setattr(gate_parts, "_PREPARED", {"inputs": build(21, 2, "the run's")})
    with pytest.raises(StateError, match=f"on {built.n} records"):
        pickle.loads(blob)
    monkeypatch.setattr(gate_parts, "_PREPARED", {})
    with pytest.raises(StateError, match="no inputs"):
        pickle.loads(blob)
