"""Secret randomness (issue 27 item 5): a release's seed from the OS, kept only in the linkage record;
the flow, the gate and the study share one parrot policy (deid.anonymise.randomness)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from deid.anonymise.methods import deidentify, method_runner
from deid.anonymise.randomness import ReleaseSeed

SHAPE = (10, 9)


def _faces(n_people=12, seed=0):
    rng = np.random.default_rng(seed)
    people = np.repeat(np.arange(n_people), 2)
    x = rng.integers(0, 256, size=(len(people), SHAPE[0] * SHAPE[1]), dtype=np.uint8)
    labels = {"expression": list(np.tile(["neutral", "smiling"], n_people)),
              "gender": list(np.where(people % 2 == 0, "f", "m"))}
    return x, [f"p{p}" for p in people], labels


def test_the_seed_policy_secret_unless_fixed():
    a, b = ReleaseSeed.draw(), ReleaseSeed.draw()
    assert not a.fixed and 0 <= a.value < 2**31
    # Independent OS draws (equal with probability 2**-31).
    assert a.value != b.value and a.for_parrot() != a.value
    assert str(a.value) not in repr(a) and str(a.value) not in json.dumps(a.to_report())
    assert a.to_report() == {"seed_fixed": False, "statement": a.statement}
    assert a.statement.startswith("secret: drawn from the OS") and a.to_linkage() == {"value": a.value, "fixed": False}
    fixed = ReleaseSeed.draw(7)
    assert fixed.fixed and fixed.value == 7 and fixed.for_parrot() == 7  # the attacker is assumed to know it
    assert fixed.statement.startswith("seed fixed: not secret")


def test_the_run_configuration_draws_a_seed_per_release(tmp_path):
    from deid.run_config import RunConfig
    from deid.settings import Settings

    config = RunConfig.resolve(Settings(project_dir=tmp_path))
    first, second = config.for_release().release_seed, config.for_release().release_seed
    assert not first.fixed and first.value != second.value
    assert str(first.value) not in repr(config.for_release())
    fixed = RunConfig.resolve(Settings(project_dir=tmp_path, seed=11))
    assert fixed.seed_fixed and fixed.for_release().release_seed == ReleaseSeed(11, True)


@pytest.mark.parametrize("method", ["attribute-preserving", "selective-mean"])
def test_two_releases_of_a_random_method_differ_and_only_a_known_seed_lets_the_parrot_rebuild_them(method):
    x, people, labels = _faces()
    # Mutual information instead of selective-mean's random forest: the same draws, a fraction of the CPU.
    options = {"relevance": "mutual-info"} if method == "selective-mean" else None
    run = dict(shape=SHAPE, people=people, method=method, k=3, n_components=6, labels=labels, options=options)
    one, two = ReleaseSeed.draw(), ReleaseSeed.draw()
    first, second = deidentify(x, seed=one.value, **run)[0], deidentify(x, seed=two.value, **run)[0]
    assert (first != second).any(axis=1).mean() > 0.5  # most faces differ between the two releases
    parrot = method_runner(method, shape=SHAPE, k=3, n_components=6, seed=one.for_parrot(), options=options)
    assert (parrot(x, people=people, labels=labels) != first).any(axis=1).mean() > 0.5
    known = ReleaseSeed.draw(5)
    fixed = deidentify(x, seed=known.value, **run)[0]
    rebuilt = method_runner(method, shape=SHAPE, k=3, n_components=6, seed=known.for_parrot(), options=options)
    np.testing.assert_array_equal(rebuilt(x, people=people, labels=labels), fixed)


def test_flow_features_and_study_take_the_parrot_seed_from_the_one_policy(tmp_path, monkeypatch):
    from deid.contracts import Deidentified, Partitioned, RecordCounts
    from deid import study
    from deid.evaluation.gate_types import GateConfig
    from deid.operations import gate_publish
    from deid.run_config import RunConfig
    from deid.settings import Settings

    calls = []

    def spy(self):
        calls.append(self)
        return 424242

    monkeypatch.setattr(ReleaseSeed, "for_parrot", spy)
    # The flow's gate inputs (images).
    config = RunConfig.resolve(Settings(project_dir=tmp_path), method="selective-mean", k=3).for_release()
    inputs = gate_publish.gate_inputs(Deidentified(), Partitioned(root=tmp_path), config, labels=[],
                                  counts=RecordCounts(records_in=0))
    assert calls == [config.release_seed] and inputs.deidentify.seed == 424242
    # The feature path's gate inputs: its parrot runner too (an empty release: no vectors to attack).
    from types import SimpleNamespace

    from deid.operations.features import FeatureDeidentified, feature_gate_inputs

    empty = FeatureDeidentified(np.zeros(0, np.int64), np.zeros((0, 4), np.float32), (), (), (), None)
    seen = []
    monkeypatch.setattr("deid.operations.features.vector_method_runner", lambda m, **kw: seen.append(kw["seed"]))
    feature_gate_inputs(SimpleNamespace(dim=4), None, empty, method="selective-mean", k=3, sigma=None,
                        seed=config.release_seed, records_in=0, suppressed=0, quarantined=0)
    assert calls == [config.release_seed] * 2 and seen == [424242]
    # The study: one point, its parrot runner built from the same policy.
    import deid.anonymise.methods as methods

    made, original = [], methods.method_runner  # _study_point imports it when it runs
    monkeypatch.setattr(methods, "method_runner", lambda *a, **kw: made.append(kw["seed"]) or original(*a, **kw))
    x, people, labels = _faces()
    gate = GateConfig(k=2, method="k-same", attackers=("pca-whitened-cosine",), modes=("parrot",), repeats=1,
                      folds=3, n_components=6)
    calls.clear()
    study.run_study(x, people, labels, SHAPE, study.StudyConfig(ks=(3,), methods=("attribute-preserving",), gate=gate))
    assert len(calls) == 1 and not calls[0].fixed and made == [424242]


@pytest.mark.slow
def test_a_release_keeps_its_seed_in_the_linkage_record_and_no_report_holds_it(tmp_path):
    """One small flow run of a random method, DEID_SEED unset: the seed from the private record, grepped."""
    from deid.intake.synth import make_synthetic_drop
    from deid.operations import release_staging
    from deid.operations.runner import Steps, run_release
    from deid.release.linkage import ensure_linkage_key, read_linkage_seed
    from deid.run_config import RunConfig
    from deid.settings import Settings

    drop = make_synthetic_drop(tmp_path / "drop", people=12, images_per_person=2, seed=1)
    config = RunConfig.resolve(Settings(project_dir=tmp_path / "project", identity_embed_max=0,
                                        deep_attack_sample=20, cv_repeats=1), k=3, method="attribute-preserving")
    assert not config.seed_fixed
    seeds = []

    def stage(*args, **kwargs):
        staged = release_staging.stage(*args, **kwargs)
        key = ensure_linkage_key(configured=None, keys_dir=args[3].keys_dir)[0]
        seeds.append(read_linkage_seed(staged.linkage, key))  # read before a rejection withholds it
        return staged

    result = run_release(drop, config, steps=Steps(stage=stage))
    (seed,) = seeds
    assert seed["fixed"] is False and isinstance(seed["value"], int)
    report = json.loads(Path(result.report_path).read_text())
    assert report["configuration"]["randomness"]["seed_fixed"] is False
    assert report["configuration"]["randomness"]["statement"].startswith("secret")
    # The value as a number anywhere in the report's files (and the release's, if published).
    value = re.compile(rb"(?<![0-9])%d(?![0-9])" % seed["value"])
    files = [p for d in (result.report_dir, result.release_dir) if d is not None for p in Path(d).rglob("*")
             if p.is_file()]
    assert any(p.name == "report.json" for p in files)
    assert [p for p in files if value.search(p.read_bytes())] == []
