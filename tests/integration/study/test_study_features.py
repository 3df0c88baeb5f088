"""``deid study`` on a feature drop: the feature methods on its vectors, judged by the feature-space gate."""
from __future__ import annotations

import csv

from deid.cli import main
from deid.intake.synth_features import make_feature_drop


def test_study_runs_the_feature_methods_on_a_feature_drop_and_refuses_image_methods(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path / "project"))
    drop = make_feature_drop(tmp_path / "voices", people=10, per_person=2, dim=8, seed=1)
    out = tmp_path / "study"
    argv = ["study", str(drop), "--k", "2", "--sigma", "0.5", "--methods", "k-same,noise", "--repeats", "1",
            "--attackers", "feature-euclidean", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "20 feature records" in printed
    with open(out / "study.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    verdicts = {(r["method"], r["strength"]): r for r in rows if r["kind"] == "verdict"}
    assert set(verdicts) == {("k-same", "2"), ("noise", "0.5")}
    # k-Same gives each cluster one vector (the exact share decides); noise keeps every record's own vector
    # and the parrot re-running it finds them: the gate rejects it, as it rejects blur for faces.
    assert verdicts[("k-same", "2")]["exact_bound"] == "True"
    assert float(verdicts[("k-same", "2")]["max_person_share"]) <= 0.5
    assert verdicts[("noise", "0.5")]["verdict"] == "fail"
    attacks = {(r["method"], r["attacker"], r["mode"]) for r in rows if r["kind"] == "privacy"}
    assert attacks == {(m, "feature-euclidean", mode) for m in ("k-same", "noise")
                       for mode in ("naive", "reverse", "parrot")}
    assert (out / "reidentification_k.png").read_bytes().startswith(b"\x89PNG")
    assert not (out / "examples.png").exists()  # no faces to draw
    # A face-only method is refused with the reason and the exit code of bad input.
    assert main(["study", str(drop), "--methods", "blur", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "methods=['blur']" in err and "feature drop" in err
