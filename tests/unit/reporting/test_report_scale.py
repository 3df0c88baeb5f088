"""Issue 13: a report listing every released file is validated and converted in linear, cheap time."""
from __future__ import annotations

import hashlib

import pytest

from deid.reporting import report as R


def _report(n: int) -> dict:
    arts = [{"path": f"images/{i:06d}.png", "sha256": hashlib.sha256(b"%d" % i).hexdigest(), "bytes": 100 + i}
            for i in range(n)]
    return {"artifacts": arts, "report_files": arts[:3]}


def test_file_lists_fast_check_never_accepts_what_the_schema_refuses():
    import jsonschema

    schema = R.load_schema()
    item = jsonschema.Draft202012Validator({**schema["properties"]["artifacts"]["items"], "$defs": schema["$defs"]})
    good = _report(50)["artifacts"]
    assert R._files_valid(good)
    bad_items = [{**good[0], "sha256": "ABC"}, {**good[0], "bytes": -1}, {**good[0], "bytes": True},
                 {**good[0], "bytes": 1.0}, {**good[0], "path": "../x.png"}, {**good[0], "path": "/x.png"},
                 {**good[0], "extra": 1}, {"path": "a", "sha256": good[0]["sha256"]}, {**good[0], "path": ""}]
    for bad in bad_items:
        # Never accepts what the schema refuses; may refuse what it accepts (1.0 as an integer): jsonschema decides then.
        assert not R._files_valid([*good, bad])
        assert not item.is_valid(bad) or bad["bytes"] == 1.0


@pytest.mark.parametrize("where", [0, 7, 49])
def test_a_bad_file_entry_is_reported_as_jsonschema_words_it(where):
    d = _report(50)
    d["artifacts"][where]["sha256"] = "XYZ"
    cut = R._one_file_each(d)
    assert cut["artifacts"] == d["artifacts"]  # not cut: the whole list goes to jsonschema
    problems = R.report_problems({**_valid_report(), "artifacts": d["artifacts"]})
    assert f"$.artifacts[{where}].sha256: 'XYZ' does not match '^[0-9a-f]{{64}}$'" in problems


def test_long_valid_lists_are_cut_to_one_item_for_jsonschema():
    d = _report(50)
    cut = R._one_file_each(d)
    assert cut["artifacts"] == d["artifacts"][:1] and cut["report_files"] == d["report_files"][:1]
    rep = {**_valid_report(), "artifacts": d["artifacts"]}
    assert R.report_problems(rep) == []
    assert R.report_problems({**rep, "artifacts": []}) != []  # a released report lists its files


def test_to_dict_converts_file_lists_like_the_generic_walk():
    import dataclasses

    r = R.Report.from_dict({**_valid_report(), **_report(20)})
    d = r.to_dict()
    assert d["artifacts"] == R.jsonable(dataclasses.asdict(r))["artifacts"]
    assert d["report_files"] == R.jsonable([dataclasses.asdict(a) for a in r.report_files])
    assert list(d) == [f.name for f in dataclasses.fields(r) if f.name in d]
    assert "report_files" not in dataclasses.replace(r, report_files=None).to_dict()


def _valid_report() -> dict:
    """A released report the schema accepts (test_report's builder), as a dict."""
    from deid.release.signing import ensure_signing_key  # noqa: PLC0415
    from unit.reporting.test_report import make_report  # noqa: PLC0415

    import tempfile  # noqa: PLC0415

    key = ensure_signing_key(configured=None, keys_dir=__import__("pathlib").Path(tempfile.mkdtemp()) / "keys")
    return make_report(key).to_dict()
