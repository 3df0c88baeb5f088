"""Sequence releases on seeded data: the non-identity modes' cluster structure, the video linkage check,
the videos' metadata (FFmpeg's tags blanked and checked) and the dataset card's videos."""
from __future__ import annotations


import cv2
import numpy as np
import pytest

from deid.anonymise.methods_factor import MultiFactor
from deid.anonymise.sequences import SequenceMultiFactor
from deid.errors import ConfigError
from deid.evaluation.leaks import avi_has_metadata, release_files_metadata
from deid.evaluation.sequences import sequence_linkage_check
from deid.release.card import DatasetCard
from deid.release.publish import blank_encoder_tags, read_video, write_video


def _factor_faces(people: int = 9, frames: int = 6, pixels: int = 120, seed: int = 0):
    """Faces = mean + a person's identity + the frame's expression (3 values, varying within people) + noise."""
    rng = np.random.default_rng(seed)
    ident = rng.normal(0, 25, (people, pixels))
    expr = rng.normal(0, 15, (3, pixels))
    P, E, X = [], [], []
    for p in range(people):
        for f in range(frames):
            e = f % 3
            P.append(f"p{p}")
            E.append(["neutral", "smile", "talk"][e])
            X.append(120 + ident[p] + expr[e] * (0.7 + 0.1 * f) + rng.normal(0, 2, pixels))
    return np.clip(np.rint(X), 0, 255).astype(np.uint8), P, E


def test_labels_mode_releases_cells_of_identical_images_within_identity_clusters():
    X, P, E = _factor_faces()
    seqs = [f"{p}-q" for p in P]
    model = SequenceMultiFactor(3, n_components=10).fit(X, people=P, labels={"expression": E}, sequences=seqs)
    released = np.clip(np.rint(model.released_), 0, 255).astype(np.uint8)
    people, cells = np.asarray(P), model.labels_
    identity = model.person_clusters_[[model.people_.index(p) for p in P]]  # each frame's identity cluster
    # Stills get the same cells (issue 14): MultiFactor's clusters are the cells it releases.
    np.testing.assert_array_equal(MultiFactor(3, n_components=10).fit(X, people=P, labels={"expression": E}).labels_,
                                  cells)
    for c in np.unique(cells):
        rows = np.flatnonzero(cells == c)
        assert len({released[i].tobytes() for i in rows}) == 1  # one image per cell
        assert len(set(identity[rows])) == 1 and len(set(np.asarray(E)[rows])) == 1  # one cluster, one label
        assert len(set(people[rows])) >= 3
    assert len(np.unique(cells)) == len(np.unique(identity)) * 3


def test_grouped_mode_shares_each_image_among_all_people_of_its_identity_cluster():
    X, P, E = _factor_faces()
    people = np.asarray(P)
    frames = MultiFactor(3, n_components=10, non_identity="frames").fit(X, people=P, labels={"expression": E})
    grouped = MultiFactor(3, n_components=10, non_identity="grouped").fit(X, people=P, labels={"expression": E})
    # "frames" gives every face its own image: a fingerprint of its source frame.
    assert len({r.tobytes() for r in np.rint(frames.released_)}) == len(X)
    released = np.rint(grouped.released_)
    for g in np.unique(grouped.labels_):
        rows = np.flatnonzero(grouped.labels_ == g)
        cluster = set(frames.labels_[rows])
        assert len(cluster) == 1  # a group lies inside one identity cluster ...
        members = set(people[frames.labels_ == cluster.pop()])
        assert set(people[rows]) == members and len(rows) == len(members) >= 3  # ... one face of each member
        assert len({released[i].tobytes() for i in rows}) == 1


def test_sequence_linkage_counts_the_people_who_fit_every_frame_of_a_video():
    # Cluster a holds p, q, r; cluster b holds p, q, s: a video with frames in both fits p and q only.
    clusters = ["a", "a", "a", "b", "b", "b", "a"]
    people = ["p", "q", "r", "p", "q", "s", None]
    sequences = ["v1", None, None, "v1", None, None, None]
    check = sequence_linkage_check(sequences, clusters, people, k=3)
    assert not check.passed and check.value == 2 and "1 sequences below k" in check.detail
    check = sequence_linkage_check(["v1", "v2", "v2", None, None, None, None], clusters, people, k=3)
    assert check.passed and check.value == 3
    assert sequence_linkage_check([None] * 7, clusters, people, k=3).status == "not_applicable"


def test_videos_carry_no_text_tags_and_the_check_finds_them(tmp_path):
    frames = [np.random.default_rng(i).integers(0, 255, (12, 9), dtype=np.uint8) for i in range(4)]
    raw = tmp_path / "raw.avi"
    w = cv2.VideoWriter(str(raw), cv2.VideoWriter_fourcc(*"MJPG"), 10.0, (10, 12), isColor=False)
    for f in frames:
        w.write(cv2.copyMakeBorder(f, 0, 0, 0, 1, cv2.BORDER_REPLICATE))
    w.release()
    found = avi_has_metadata(raw.read_bytes())
    # OpenCV's FFmpeg names itself twice: the INFO list (ISFT Lavf...) and each frame's JPEG comment (Lavc...).
    assert "LIST INFO" in found and any(f.startswith("JPEG COM Lavc") for f in found)
    clean = blank_encoder_tags(raw.read_bytes())
    assert avi_has_metadata(clean) == [] and len(clean) == raw.stat().st_size and b"Lav" not in clean
    (tmp_path / "videos").mkdir()
    released = write_video(tmp_path / "videos" / "q.avi", frames)
    assert avi_has_metadata(released.read_bytes()) == []
    assert np.array_equal(read_video(released), read_video(raw))  # same pixels, only the text is gone
    # A date chunk added after the frames, and bytes after the RIFF, are reported.
    tagged = bytearray(released.read_bytes())
    date = b"IDIT" + (8).to_bytes(4, "little") + b"20261122"
    tagged[4:8] = (int.from_bytes(tagged[4:8], "little") + len(date)).to_bytes(4, "little")
    (tmp_path / "videos" / "t.avi").write_bytes(bytes(tagged) + date + b"tail")
    assert release_files_metadata(tmp_path) == {"videos/t.avi": ["chunk IDIT", "data after the RIFF"]}
    with pytest.raises(ConfigError, match="not an AVI"):
        avi_has_metadata(b"\x89PNG\r\n\x1a\n")


def _released_report(*, videos: int, exact: bool) -> dict:
    return {
        "release_id": "rel-0123456789abcdef", "verdict": "released", "k": 3, "method": "multi-factor",
        "guarantee": "no formal guarantee; the empirical attacks decide (identity factors ...)",
        "created_at": "2026-11-22T12:00:00Z", "dataset": {"name": "talking", "records_released": 48},
        "privacy": {"bound": 1 / 3, "max_rate": 0.25, "exact_bound": exact, "min_distinct_people_per_cluster": 3,
                    "reidentification": []},
        "configuration": {"labels": ["expression"], "canonical_size": [81, 92], "clusters": {"count": 6},
                          "method_inputs": {"points": 0, "sequences": videos, "frames": 12 * videos}},
        "artifacts": [{"path": f"videos/q-{i:012x}.avi", "sha256": "0" * 64, "bytes": 1} for i in range(videos)],
    }


def test_the_card_lists_the_videos_and_states_which_bound_holds():
    card = DatasetCard.from_report(_released_report(videos=4, exact=True))
    text = card.render()
    assert card.videos == 4 and card.header()["deid"]["videos"] == 4
    assert "`videos/*.avi`: 4 videos" in text and "48 frames" in text and "`sequence_id`" in text
    assert "every cluster's faces are one identical image" in text and "probability at most 1/3" in text
    empirical = DatasetCard.from_report(_released_report(videos=4, exact=False)).render()
    assert "not identical copies" in empirical and "probability at most" not in empirical
    still = DatasetCard.from_report(_released_report(videos=0, exact=True)).render()
    assert "videos/" not in still and "sequence_id" not in still
