"""Issue 29 item 9: licence and attribution from drop.yaml (and `deid import london`) to the dataset card."""
from __future__ import annotations

import pytest
from integration.test_consumer import _report
from integration.intake.test_london_import import _fake_london

from deid.errors import DropError
from deid.intake.drop import read_drop
from deid.intake.london import CITATION, import_london
from deid.release.card import DatasetCard, split_card


def _card(configuration: dict) -> tuple[dict, str]:
    report = _report("rel-0123456789abcdef", 12)
    report["configuration"].update(configuration)
    return split_card(DatasetCard.from_report(report).render())


def test_london_import_states_its_licence_and_citation(tmp_path):
    drop = read_drop(import_london(_fake_london(tmp_path / "src"), tmp_path / "drop"))
    assert drop.license == "cc-by-4.0"
    assert drop.attribution == {"citation": CITATION}
    assert CITATION.startswith("DeBruine, L., & Jones, B. (2017). Face Research Lab London Set (Version 5).")
    header, body = _card({"license": drop.license, **drop.attribution})
    assert header["license"] == "cc-by-4.0" and "license_name" not in header and "license_link" not in header
    citation = body[body.index("## Citation"):]
    assert "Face Research Lab London Set (Version 5)" in citation and "doi:10.6084/m9.figshare.5047666.v5" in citation
    assert "Credit the source" in body


def test_other_licence_carries_the_hub_fields(tmp_path):
    (tmp_path / "manifest.csv").write_text("image,subject_id\n")
    (tmp_path / "drop.yaml").write_text("license: other\nlicense_name: lab-terms-1.0\n"
                                        "license_link: https://example.org/terms\ncitation: Lab (2026). Faces.\n")
    drop = read_drop(tmp_path)
    assert drop.attribution == {"license_name": "lab-terms-1.0", "license_link": "https://example.org/terms",
                                "citation": "Lab (2026). Faces."}
    header, body = _card({"license": drop.license, **drop.attribution})
    assert (header["license"], header["license_name"], header["license_link"]) == (
        "other", "lab-terms-1.0", "https://example.org/terms")
    assert "https://" not in body  # the link is the header's field only; the body stays address-free
    # No licence set: `other` still has the fields the Hub expects, pointing at the card's Licence section.
    header, body = _card({"license": None})
    assert (header["license"], header["license_name"], header["license_link"]) == ("other", "unspecified",
                                                                                 "README.md")
    assert "set no licence" in body and "## Citation" not in body


@pytest.mark.parametrize("field, bad", [("license_name", "'a b'"), ("license_link", "'see the lab site'"),
                                        ("citation", "[a, b]")])
def test_bad_attribution_names_the_field(tmp_path, field, bad):
    (tmp_path / "manifest.csv").write_text("image,subject_id\n")
    (tmp_path / "drop.yaml").write_text(f"{field}: {bad}\n")
    with pytest.raises(DropError, match=f"'{field}' must be"):
        read_drop(tmp_path)
