"""One person index per project across datasets (issue 27 item 2), on tiny in-memory drops.

The renamed-dataset scenario: dataset ``cohort-a`` is released, then the same photographs (plus
three new people) arrive as ``cohort-b``, with the same ids or re-keyed ones. Each drop goes through
the person index, the lineage plan of the dataset the index routes it to, and ``build_release``,
with k-Same's clusters stood in for by consecutive groups of the new records. Measured across the two
releases: cluster pairs whose member records differ by 1..k-1, and returning records released with
another image. The control (no index: ``cohort-b`` in a lineage of its own) shows the leak the
figures would catch.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from deid.errors import DataError, StateError
from deid.operations import worker_lineage
from deid.operations.descriptor_search import DescriptorSearch
from deid.operations.person_index import PersonIndex
from deid.operations.person_routing import CrossDatasetRefusal, Matches, decide, decide_faces
from deid.release.lineage import build_release
from deid.release.lineage_state import empty_state

KEY = bytes(range(32))
K = 3
SHAPE = (2, 3)


def _photo(n: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, 6, dtype=np.uint8).tobytes()


def _drop(people: list[str], photos: list[int]) -> pa.Table:
    """One record per (person, photo number); the fingerprint is the photo's bytes' SHA-256, whatever the id."""
    px = [_photo(n) for n in photos]
    return pa.table({"record_id": [f"r{i:04d}" for i in range(len(people))], "subject_id": people, "pixels": px,
                     "source_sha256": [hashlib.sha256(p).hexdigest() for p in px]})


def _release(faces: pa.Table, state, release_id: str):
    """The lineage release of ``faces`` planned on ``state``: new records clustered in consecutive groups of >= K."""
    sources = faces.select(["record_id", "source_sha256"])
    plan = worker_lineage.plan_lineage(faces, sources, state, key=KEY, k=K, policy="invariant", absent="republish",
                               labels=[], select=False)
    new = list(plan.new_records)
    groups = [new[a:a + K] for a in range(0, len(new) - len(new) % K, K)]
    if len(new) % K:
        groups[-1] += new[len(new) - len(new) % K:]
    pix = np.stack([np.frombuffer(p, np.uint8) for p in faces.column("pixels").to_pylist()]) if len(faces) else None
    labels = np.zeros(len(new), np.int64)
    images = np.zeros((len(new), 6), np.uint8)
    at = {i: n for n, i in enumerate(new)}
    for g, members in enumerate(groups):
        avg = np.rint(pix[members].mean(axis=0)).astype(np.uint8)
        for i in members:
            labels[at[i]], images[at[i]] = g, avg
    rel = build_release(plan, state, release_id=release_id, method="k-same", new_labels=labels, new_images=images,
                        shape=SHAPE)
    return rel, state.with_entry(rel.to_entry())


def _run(index: PersonIndex | None, states: dict, dataset: str, faces: pa.Table, release_id: str, **policy):
    """One run: the person index decides the lineage (None: no index, the drop's own), then plan and release."""
    routing = None
    if index is not None:
        ids = faces.column("subject_id").to_pylist()
        routing = index.claim(dataset, ids, faces.column("source_sha256").to_pylist(), **policy)
        dataset = routing.dataset
        faces = faces.set_column(1, "subject_id", pa.array([routing.aliases.get(s, s) for s in ids]))
    state = states.get(dataset) or empty_state(dataset)
    rel, states[dataset] = _release(faces, state, release_id)
    clusters = {key: ({fp for fp, _ in c.members}, c.image.tobytes())
                for key, (c, _) in rel.released_clusters(state).items()}
    images = {rel.fingerprints[i]: clusters[key][1] for i, key in enumerate(rel.record_cluster) if key is not None}
    return routing, clusters, images


def _leaks(first, second) -> tuple[int, int]:
    """(cluster pairs across the two releases whose members differ by 1..K-1 records, returning records with
    another image)."""
    (_, c1, im1), (_, c2, im2) = first, second
    pairs = sum(1 for m1, _ in c1.values() for m2, _ in c2.values() if m1 & m2 and 1 <= len(m1 ^ m2) <= K - 1)
    changed = sum(1 for fp, img in im2.items() if fp in im1 and im1[fp] != img)
    return pairs, changed


COHORT_A = ["participant-%02d" % i for i in range(6)]
# The same six photographs in another order with three new people: consecutive groups then mix them.
ORDER = [0, 1, 2, 6, 3, 4, 5, 7, 8]


def _cohort_b(rekey: bool) -> pa.Table:
    ids = [("rekeyed-%02d" if rekey or n >= 6 else "participant-%02d") % n for n in ORDER]
    return _drop(ids, ORDER)


def test_without_the_index_a_renamed_dataset_leaks(tmp_path):
    """The control: cohort-b in its own lineage re-clusters cohort-a's records; the figures catch it."""
    states: dict = {}
    first = _run(None, states, "cohort-a", _drop(COHORT_A, list(range(6))), "rel-1")
    second = _run(None, states, "cohort-b", _cohort_b(False), "rel-2")
    assert _leaks(first, second) == (1, 3)


@pytest.mark.parametrize("rekey", [False, True], ids=["same-ids", "rekeyed-ids"])
def test_a_renamed_dataset_is_routed_into_the_lineage_that_released_its_people(tmp_path, rekey):
    index = PersonIndex.open(tmp_path, KEY)
    states: dict = {}
    first = _run(index, states, "cohort-a", _drop(COHORT_A, list(range(6))), "rel-1")
    assert first[0].dataset == "cohort-a" and not first[0].note
    second = _run(index, states, "cohort-b", _cohort_b(rekey), "rel-2", policy="route")
    routing = second[0]
    assert routing.dataset == "cohort-a" and routing.routed_from == "cohort-b" and routing.overlap == {"cohort-a": 6}
    assert "cohort-a" in routing.note and "DEID_CROSS_DATASET=route" in routing.note
    # Re-keyed records are the registered people again (found by their bytes), listed under their registered ids.
    assert routing.aliases == ({f"rekeyed-{n:02d}": f"participant-{n:02d}" for n in range(6)} if rekey else {})
    assert _leaks(first, second) == (0, 0)
    assert len(second[2]) == 9  # every record released: the six returning ones and one new cluster of three
    new_photos = _drop(["x"] * 3, [6, 7, 8]).column("source_sha256").to_pylist()
    assert {d: len(r) for d, r in index.lookup(["x"] * 3, new_photos).records.items()} == {"cohort-a": 3}
    # A third run of cohort-b goes to cohort-a again (its people are registered there, never under cohort-b).
    again = _run(index, states, "cohort-b", _cohort_b(rekey), "rel-3", policy="route")
    assert again[0].dataset == "cohort-a" and _leaks(first, again) == (0, 0) and "cohort-b" not in states


def test_a_renamed_dataset_is_refused_naming_the_other_dataset_and_claims_nothing(tmp_path):
    index = PersonIndex.open(tmp_path, KEY)
    states: dict = {}
    _run(index, states, "cohort-a", _drop(COHORT_A, list(range(6))), "rel-1")
    held = index.count()
    for rekey in (False, True):
        with pytest.raises(DataError, match="registered under dataset 'cohort-a' \\(6 people\\).*dataset: cohort-a"):
            _run(index, states, "cohort-b", _cohort_b(rekey), "rel-2")  # refuse is the default
    assert index.count() == held and "cohort-b" not in states
    # Under its registered name the drop is that lineage's next release.
    ok = _run(index, states, "cohort-a", _cohort_b(True), "rel-2")
    assert ok[0].dataset == "cohort-a" and ok[0].routed_from is None and len(ok[0].aliases) == 6


def test_rekeyed_ids_in_the_same_dataset_are_aliases_not_a_state_error(tmp_path):
    states: dict = {}
    first = _run(None, states, "cohort-a", _drop(COHORT_A, list(range(6))), "rel-1")
    # Without the index the lineage alone knows the registered bytes: the same people under aliases, no longer a
    # state error that blocked it for good (issue 27 item 3), and nothing leaks either.
    assert _leaks(first, _run(None, dict(states), "cohort-a", _cohort_b(True), "rel-2")) == (0, 0)
    index = PersonIndex.open(tmp_path, KEY)
    index.register("cohort-a", COHORT_A, _drop(COHORT_A, list(range(6))).column("source_sha256").to_pylist())
    second = _run(index, states, "cohort-a", _cohort_b(True), "rel-2")
    assert _leaks(first, second) == (0, 0)


def test_steward_ids_alone_count_only_when_the_project_says_they_are_project_wide(tmp_path):
    index = PersonIndex.open(tmp_path, KEY)
    states: dict = {}
    _run(index, states, "site-1", _drop(COHORT_A, list(range(6))), "rel-1")
    other_people = _drop(COHORT_A, list(range(100, 106)))  # the same ids, other photographs
    assert _run(index, states, "site-2", other_people, "rel-2")[0].dataset == "site-2"  # linked (default)
    with pytest.raises(DataError, match="'site-1'"):
        _run(index, states, "site-3", _drop(COHORT_A, list(range(200, 206))), "rel-3", id_scope="project")


def test_decide_counts_ids_towards_a_dataset_the_drop_shares_a_photo_with():
    ids = ["a", "b", "c"]
    shared = Matches(records={"x": {0: "a"}}, ids={"x": {"a", "b"}, "y": {"c"}})
    r = decide(shared, ids, dataset="mine", policy="route")
    assert r.dataset == "x" and r.overlap == {"x": 2}  # "b" by id (corroborated), "c" not (no photo shared with y)
    with pytest.raises(DataError, match="'x'.*'y'"):
        decide(shared, ids, dataset="mine", policy="route", id_scope="project")  # two other lineages: refused
    with pytest.raises(DataError, match="own dataset 'mine'"):
        decide(Matches(records={"x": {0: "a"}, "mine": {1: "b"}}), ids, dataset="mine", policy="route")
    with pytest.raises(DataError, match="different people"):
        decide(Matches(records={"mine": {0: "p", 1: "q"}}), ["a", "a", "c"], dataset="mine")
    with pytest.raises(DataError, match="different people"):  # one photo registered under its id, one under another
        decide(Matches(records={"mine": {0: "a", 1: "q"}}), ["a", "a", "c"], dataset="mine")
    assert decide(Matches(records={"mine": {0: "A ", 1: "q"}}), ["a", "b", "c"], dataset="mine").aliases == {"b": "q"}
    with pytest.raises(Exception, match="DEID_CROSS_DATASET="):
        decide(Matches(), ids, dataset="mine", policy="merge")


def test_the_index_holds_no_id_or_fingerprint_in_clear_and_refuses_another_key(tmp_path):
    index = PersonIndex.open(tmp_path, KEY)
    faces = _drop(COHORT_A, list(range(6)))
    fps = faces.column("source_sha256").to_pylist()
    index.register("cohort-a", COHORT_A, fps)
    raw = b"".join(p.read_bytes() for p in (Path(tmp_path) / "private").iterdir())
    assert b"participant-" not in raw and not any(f.encode() in raw for f in fps) and b"cohort-a" in raw
    assert (Path(tmp_path) / "private" / "person_index.sqlite").stat().st_mode & 0o077 == 0
    assert sum(len(v) for v in index.lookup(COHORT_A, fps).records.values()) == 6
    with pytest.raises(StateError, match="another linkage key"):
        PersonIndex.open(tmp_path, bytes(32)).lookup(COHORT_A, fps)


def _people_descriptors(n_people: int, per: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic 128-d descriptors shaped like dlib's: people ~0.8 apart, photos of one person ~0.3."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 0.05, (n_people, 128))
    return centres, np.repeat(centres, per, axis=0) + rng.normal(0, 0.02, (n_people * per, 128))


def test_other_photographs_of_registered_people_under_new_ids_are_matched_by_face(tmp_path):
    index = PersonIndex.open(tmp_path, KEY)
    centres, faces = _people_descriptors(20, 2, 1)
    index.register_faces("cohort-a", [f"participant-{i // 2:02d}" for i in range(40)], faces)
    rng = np.random.default_rng(2)
    # A third drop: new photographs of 10 of them under new ids, and 10 people never registered.
    probes = np.vstack([centres[:10] + rng.normal(0, 0.02, (10, 128)), rng.normal(0, 0.05, (10, 128))])
    found = index.match_faces(probes)
    assert [(m.row, m.dataset, m.subject_id) for m in found] == [(i, "cohort-a", f"participant-{i:02d}")
                                                                 for i in range(10)]
    assert all(m.distance < 0.45 for m in found)


def test_the_inverted_file_finds_what_the_exact_search_finds():
    centres, faces = _people_descriptors(2500, 2, 3)
    probes = centres[::10] + np.random.default_rng(4).normal(0, 0.02, (250, 128))
    exact_i, exact_d = DescriptorSearch(faces).search(probes)  # below exact_below: every probe against all
    ivf = DescriptorSearch(faces, exact_below=1000)
    assert ivf.lists is not None and len(ivf.lists) == 71 and max(map(len, ivf.lists)) < len(faces) / 8
    ivf_i, ivf_d = ivf.search(probes)
    assert np.all(ivf_d >= exact_d - 1e-5)  # never nearer than the true nearest (a miss, not a false match)
    assert np.mean(ivf_i // 2 == exact_i // 2) >= 0.95  # the same person found
    # Every registered face within a radius: the inverted file finds the exact search's pairs it can reach (its
    # lists), never one the exact search does not have.
    exact = set(zip(*[a.tolist() for a in DescriptorSearch(faces).within(probes, 0.45)[:2]]))
    found = set(zip(*[a.tolist() for a in ivf.within(probes, 0.45)[:2]]))
    assert found <= exact and len(found) >= 0.95 * len(exact) and len(exact) >= 2 * len(probes)
    # The inverted file keeps one copy of the descriptors (list by list), and gives them back in input order.
    assert len(ivf.X) == 0 and np.array_equal(ivf.vectors(), faces.astype(np.float32))


def test_the_registered_faces_open_a_batch_at_a_time_with_their_owners(tmp_path, monkeypatch):
    """face_search decrypts row batches into one array (a million registered faces: no row list, no vector objects);
    the owners come back row for row, a dataset name held once."""
    from deid.operations.person_index import Owners
    from deid import sqlstore

    index = PersonIndex.open(tmp_path, KEY)
    _, faces = _people_descriptors(30, 2, 5)
    index.register_faces("cohort-a", [f"a-{i // 2}" for i in range(40)], faces[:40])
    index.register_faces("cohort-b", [f"b-{i // 2}" for i in range(20)], faces[40:])
    batches = []
    each = sqlstore.Tx.each

    def counted(self, sql, params=(), *, batch=10_000):
        batches.append(sql)
        return each(self, sql, params, batch=7)

    monkeypatch.setattr(sqlstore.Tx, "each", counted)
    search, owners = index.face_search()
    assert batches and isinstance(owners, Owners) and len(owners) == 60
    assert np.array_equal(search.vectors(), faces.astype(np.float32))
    assert owners[0] == ("cohort-a", "a-0") and owners[39] == ("cohort-a", "a-19") and owners[59] == ("cohort-b", "b-9")
    assert owners._names == ["cohort-a", "cohort-b"]


def test_decide_faces_takes_more_than_one_pair_for_a_person_of_several_photographs():
    owners = [("cohort-a", "P-1"), ("cohort-a", "P-1"), ("cohort-a", "q"), ("cohort-c", "z")]
    one_pair = [(0, 0, 0.3)]  # drop person "x" (two photographs) within the threshold of one of P-1's by one pair
    both = [(0, 0, 0.3), (1, 1, 0.35)]
    people = ["x", "x", "y"]
    kw = dict(lineage="cohort-b", dataset="cohort-b", threshold=0.4, policy="route")
    assert decide_faces(one_pair, people, owners, **kw).matched == {}
    routed = decide_faces(both, people, owners, **kw)
    assert routed.dataset == "cohort-a" and routed.routed_from == "cohort-b" and routed.aliases == {"x": "p-1"}
    assert routed.matched == {"cohort-a": 1} and routed.searched == 2 and "1 of the 2 people" in routed.detail()
    # One photograph against one registered: one pair is all the evidence there can be.
    assert decide_faces([(2, 2, 0.3)], people, owners, **kw).aliases == {"y": "q"}
    assert decide_faces(both, people, owners, **{**kw, "known": {"x"}}).matched == {}  # found by the lookup already
    with pytest.raises(CrossDatasetRefusal, match="'cohort-a' \\(1 people\\).*'cohort-c' \\(1 people\\)"):
        decide_faces([*both, (2, 3, 0.2)], people, owners, **kw)  # two other lineages: refused under route too
    with pytest.raises(CrossDatasetRefusal, match="of the lineage 'cohort-b'"):
        decide_faces(both, people, owners, **{**kw, "held": 3})  # the drop's lineage holds some of its people
    # In the drop's own lineage a match under another id is that registered person, whatever the policy.
    own = decide_faces(both, people, owners, **{**kw, "lineage": "cohort-a", "policy": "refuse"})
    assert own.dataset == "cohort-a" and own.routed_from is None and own.aliases == {"x": "p-1"}


@pytest.mark.slow
@pytest.mark.london
@pytest.mark.xdist_group("london-dlib")  # London embedded once per worker (helpers.london_descriptors)
@pytest.mark.parametrize("policy", ["refuse", "route"])
def test_other_photographs_of_released_people_under_new_ids_and_another_name_are_found_by_face(project, policy):
    """Issue 27's must-show: cohort-a released the neutral photographs of 50 London people; a drop of dataset
    cohort-b holds the smiling photographs of 10 of them under new ids, and both photographs of 52 people never
    released. The fingerprint and id lookup finds no one; the face search, at identity resolution's calibrated
    threshold, finds the 10 (recall 10/10) and none of the 52 strangers."""
    from helpers import load_london_aligned, london_descriptors

    from deid.anonymise.identity import resolve_people
    from deid.contracts import StagingLayout
    from deid.operations import person_search
    from deid.release.lineage_state import empty_state
    from deid.run_config import RunConfig
    from deid.settings import Settings

    pixels, people, _, expr = load_london_aligned()
    E, people, expr = london_descriptors(), np.array(people), np.array(expr)
    persons = sorted(set(people.tolist()))
    cohort, returning, strangers = set(persons[:50]), set(persons[:10]), set(persons[50:])
    config = RunConfig.resolve(Settings(cross_dataset=policy))

    def run_rows(dataset: str, rows: list[int], prefix: str, release_id: str):
        """A face run's person-index steps on these rows: the claim, identity resolution, the face search."""
        ids = [f"{prefix}-{people[i]}" for i in rows]
        fps = [hashlib.sha256(pixels[i].tobytes()).hexdigest() for i in rows]
        routing = person_search.claim_records(config, dataset, ids, fps)
        identity = resolve_people(ids, embeddings=E[rows])  # as the partition stage resolves a drop of <= 2000 faces
        layout = StagingLayout.for_run(config.data_path, release_id)
        layout.root.mkdir(parents=True)
        found = person_search.search_people(
            config, routing, empty_state(routing.dataset), listed=pa.array(ids), identity=identity,
            record_ids=pa.array([f"r{i:05d}" for i in range(len(rows))]), rows=np.arange(len(rows)),
            descriptors=E[rows], metadata=pa.table({"subject_id": ids, "source_sha256": fps}), quarantined=(),
            layout=layout)
        return routing, identity, ids, fps, found

    a_rows = [i for i in range(len(people)) if people[i] in cohort and expr[i] == "neutral"]
    routing_a, _, _, _, (aliases, state, check, note, faces) = run_rows("cohort-a", a_rows, "participant", "rel-a")
    assert routing_a.dataset == "cohort-a" and not aliases and check.value == 0 and not note
    # Released: its faces registered with it (person_search.register_person_faces, as _Run.commit does).
    assert person_search.register_person_faces(config, "cohort-a", faces) == len(a_rows) == 50

    b_rows = [i for i in range(len(people)) if people[i] in strangers or people[i] in returning and expr[i] != "neutral"]
    assert len(b_rows) == 114
    expected = {f"b-{p}": f"participant-{p}" for p in sorted(returning)}
    index = person_search.person_index(config)
    if policy == "refuse":
        with pytest.raises(CrossDatasetRefusal) as err:
            run_rows("cohort-b", b_rows, "b", "rel-b")
        msg = str(err.value)
        assert msg.startswith("the drop of dataset 'cohort-b' holds people whose faces match people registered under "
                              "dataset 'cohort-a' (10 people)"), msg
        assert "10 of the 62 people searched" in msg and "dataset: cohort-a" in msg
        ids_b = [f"b-{people[i]}" for i in b_rows]
        fps_b = [hashlib.sha256(pixels[i].tobytes()).hexdigest() for i in b_rows]
        assert index.lookup(ids_b, fps_b).records == {}  # the refused drop's claim was withdrawn: it claims nothing
        # Under its registered name the drop is cohort-a's next release, the 10 planned as their registered people.
        routing, _, _, _, (aliases, state, check, note, _) = run_rows("cohort-a", b_rows, "b", "rel-b2")
        assert state.dataset == "cohort-a" and routing.dataset == "cohort-a"
    else:
        routing, _, ids_b, fps_b, (aliases, state, check, note, faces) = run_rows("cohort-b", b_rows, "b", "rel-b")
        assert routing.dataset == "cohort-b" and routing.held == 0  # the lookup found no photograph or id
        assert state.dataset == "cohort-a" and "'cohort-a'" in note and "DEID_CROSS_DATASET=route" in note
        # The claim moved with the drop: its photographs are registered under cohort-a, the 10 under their ids.
        assert set(index.lookup(ids_b, fps_b).records) == {"cohort-a"}
        assert person_search.register_person_faces(config, "cohort-a", faces) == 114
    # The recall: the 10 returning people found, each as their registered person; no stranger matched.
    assert aliases == expected
    assert check.name == "person_index" and check.passed and (check.value, check.n) == (10, 62)
    assert "face search: 10 of the 62 people" in check.detail


def test_face_search_says_which_people_it_did_not_search_by_face(project):
    """Face search sees only the faces identity resolution embedded (at most DEID_IDENTITY_EMBED_MAX): the check
    says how many of the drop's people were looked up by fingerprint and id only, and says nothing of the kind
    when every person was embedded."""
    from helpers import load_london_aligned, london_descriptors

    from deid.anonymise.identity import resolve_people
    from deid.contracts import StagingLayout
    from deid.operations import person_search
    from deid.run_config import RunConfig
    from deid.settings import Settings

    pixels, people, _, expr = load_london_aligned()
    E, people, expr = london_descriptors(), np.array(people), np.array(expr)
    rows = [i for i in range(len(people)) if expr[i] == "neutral"][:50]
    ids = [f"p-{people[i]}" for i in rows]
    fps = [hashlib.sha256(pixels[i].tobytes()).hexdigest() for i in rows]
    config = RunConfig.resolve(Settings())
    details = []
    for n, release_id in ((20, "rel-part"), (50, "rel-all")):
        routing = person_search.claim_records(config, f"cohort-{n}", ids, fps)
        identity = resolve_people(ids, embeddings=E[rows])
        layout = StagingLayout.for_run(config.data_path, release_id)
        layout.root.mkdir(parents=True)
        _, _, check, _, _ = person_search.search_people(
            config, routing, empty_state(routing.dataset), listed=pa.array(ids), identity=identity,
            record_ids=pa.array([f"r{i:05d}" for i in range(len(rows))]), rows=np.arange(n),
            descriptors=E[rows][:n], metadata=pa.table({"subject_id": ids, "source_sha256": fps}), quarantined=(),
            layout=layout)
        assert check.passed and check.n == n
        details.append(check.detail)
        person_search.person_index(config).withdraw(routing)  # the next drop holds the same people: not a refusal here
    assert "30 of the drop's 50 people had no face embedded" in details[0], details[0]
    assert "identity resolution embedded 20 faces" in details[0]
    assert "no face embedded" not in details[1], details[1]
