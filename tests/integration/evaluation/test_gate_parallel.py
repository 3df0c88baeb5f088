"""The gate's attackers and utility parts on a small run's process pool give the serial gate's figures, bit for bit."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from deid.anonymise.methods import deidentify, method_runner
from deid.evaluation.gate_types import GateConfig, GateInputs
from deid.evaluation.gate import evaluate
from deid.operations.executors import PoolExecutor

SHAPE = (24, 20)


def _drop(n_people: int = 30, seed: int = 1):
    """Two smooth random 'faces' per person; the label 'bright' shows in the upper half."""
    rng = np.random.default_rng(seed)
    base = rng.normal(128, 40, (n_people, SHAPE[0] // 4, SHAPE[1] // 4))
    ident = np.repeat(np.repeat(base, 4, axis=1), 4, axis=2).reshape(n_people, -1)
    who = np.repeat(np.arange(n_people), 2)
    faces = ident[who] + rng.normal(0, 6, (len(who), ident.shape[1]))
    label = np.asarray(["a" if p % 2 else "b" for p in who], dtype=object)
    faces.reshape(len(who), *SHAPE)[label == "a", : SHAPE[0] // 2] += 40
    return np.clip(faces, 0, 255).astype(np.uint8), np.asarray([f"p{p}" for p in who], dtype=object), label


def _gate_inputs(n_people: int = 30, seed: int = 1) -> GateInputs:
    """The gate's inputs for a k-Same-Select release (k=5) of :func:`_drop`, with its method for the parrot."""
    faces, people, label = _drop(n_people, seed)
    released, clusters = deidentify(faces, shape=SHAPE, people=people, partitions=list(label),
                                    method="k-same-select", k=5, n_components=10)
    return GateInputs.from_arrays(
        shape=SHAPE, people=people, released=released, originals=faces, clusters=clusters.astype(object),
        partitions=label, labels={"bright": label}, records_in=len(people),
        release_columns=("record_id", "image", "cluster_id"),
        deidentify=method_runner("k-same-select", shape=SHAPE, k=5, n_components=10))


def test_the_parallel_gate_gives_the_serial_figures(caplog, monkeypatch):
    import functools
    import logging

    from deid.evaluation import gate_parts as g  # where the gate's parts report their progress

    inputs = _gate_inputs()
    config = GateConfig(k=5, method="k-same-select", labels=("bright",), repeats=1, deep_attack_sample=5, min_probes=1,
                        attackers=("pca-whitened-cosine", "lbp-chi2", "dlib-resnet"))
    # The serial gate names its parts and beats while one runs, as the parallel one does (a heartbeat every
    # 15 s in a run; every 10 ms here, so every part's run shows one).
    monkeypatch.setattr(g, "PartsProgress", functools.partial(g.PartsProgress, every_seconds=0.01))
    with caplog.at_level(logging.INFO, logger="deid.progress"):
        serial = evaluate(inputs, config)
    lines = [r.getMessage() for r in caplog.records if r.name == "deid.progress" and r.getMessage().startswith("gate:")]
    parts = ["attack pca-whitened-cosine+lbp-chi2", "attack dlib-resnet (cap 5)", "leaks", "membership", "cross-fit",
             "protocols"]
    assert lines[1] == "gate: 6 parts on 1 process(es): " + ", ".join(parts), lines[:3]
    assert [x.split(" done in")[0] for x in lines if " done in " in x and x.startswith("gate: part ")] == [
        f"gate: part {p}" for p in parts]
    assert any(x.startswith("gate: working;") and "running: attack pca-whitened-cosine+lbp-chi2 (" in x
               for x in lines), lines
    assert any(x.startswith("gate: part protocols done in") and "all 6 parts done in" in x for x in lines), lines
    monkeypatch.undo()
    pool = PoolExecutor(2, warm=None)
    parts = []
    map_ = pool.map
    pool.map = lambda fn, calls, **kw: (parts.extend(c["part"] for c in calls), map_(fn, calls, **kw))[1]
    try:
        parallel = evaluate(inputs, config, executor=pool)
    finally:
        pool.close()
    assert sorted(parts) == ["attack"] * 3 + ["cross-fit", "protocols"]
    assert parallel.checks == serial.checks
    assert parallel.reidentification == serial.reidentification and len(serial.reidentification) == 9
    assert parallel.utility == serial.utility and any(r.protocol == "cross-fit" for r in serial.utility)
    assert (parallel.max_rate, parallel.attack_sample) == (serial.max_rate, serial.attack_sample)


def test_the_pool_loads_the_recogniser_only_for_a_run_that_embeds_its_faces(tmp_path):
    from types import SimpleNamespace

    from deid.orchestration.cluster import needs_recognizer

    (tmp_path / "manifest.csv").write_text("image,subject_id\n" + "".join(f"{i}.png,p{i}\n" for i in range(5)))
    cfg = SimpleNamespace(kind="images", identity_embed_max=2000)
    assert needs_recognizer(cfg, tmp_path)
    assert not needs_recognizer(SimpleNamespace(kind="images", identity_embed_max=0), tmp_path)  # check off
    assert not needs_recognizer(SimpleNamespace(kind="images", identity_embed_max=4), tmp_path)  # too many faces
    assert not needs_recognizer(SimpleNamespace(kind="features", identity_embed_max=2000), tmp_path)
    assert not needs_recognizer(cfg, tmp_path / "missing")


def test_a_large_release_runs_its_gate_on_a_helper_process_with_the_serial_figures():
    """helper_min_records: the gate's parts (light attackers together, protocols, cross-fit, leaks) on this
    process and one spawned helper give the serial figures; nothing is computed twice."""
    from deid.evaluation import gate as g, gate_parts

    inputs = _gate_inputs(n_people=20, seed=2)
    config = GateConfig(k=5, method="k-same-select", labels=("bright",), repeats=1,
                        attackers=("pca-whitened-cosine", "lbp-chi2"), helper_min_records=0)
    serial = evaluate(inputs, config)
    calls = []
    parts = g.parallel_parts
    g.parallel_parts = lambda *a, **kw: (calls.append(kw), parts(*a, **kw))[1]
    try:
        helped = evaluate(inputs, replace(config, helper_min_records=inputs.n))
    finally:
        g.parallel_parts = parts
    assert calls == [{"large": True}]
    assert helped.checks == serial.checks and any(c.name == "no_near_copies" for c in serial.checks)
    assert helped.reidentification == serial.reidentification and len(serial.reidentification) == 6
    assert helped.utility == serial.utility and any(r.protocol == "cross-fit" for r in serial.utility)
    assert (helped.max_rate, helped.attack_sample) == (serial.max_rate, serial.attack_sample)
    assert not gate_parts.helper_size(inputs, config) and gate_parts.helper_size(inputs, replace(config, helper_min_records=40))
