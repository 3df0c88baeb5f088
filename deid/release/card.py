"""The dataset card (``README.md``) of a release: what a consumer reads first, with a YAML header.

The card follows the Hugging Face dataset card convention (a ``---`` YAML metadata block, then
Markdown): licence, size category and tags the hub indexes, a ``deid`` block with the figures
machine-readable, and a body saying what the data is, how to load it, the method, k, the
guarantee, what the gate measured (with intervals and sample sizes) and how to verify the
signature, with the release alone (its ``ATTESTATION.json``: :mod:`deid.release.attestation`) and
without deid. It is built from the report dict *before* that report is signed, and written into
the staged release before the release is hashed, so the attestation and the signed report list the
card's sha256 too: a card altered after release fails ``deid verify``.

The card carries only what the report already says publicly about the release (counts, rates,
label names); never a partition's label values, a subject id or a source path.
"""
from __future__ import annotations

import html
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deid.evaluation.membership import SCOPE
from deid.release.catalogue import KeyFigures, key_figures
from deid.release.attestation import ATTESTATION_NAME, ATTESTATION_SIG_NAME, NO_DEID_CHECK, PYTHON_SIGNATURE_CHECK
from deid.release.manifest import MANIFEST_NAME
from deid.release.publish import VIDEO_FPS, VIDEOS
from deid.intake.drop import DEFAULT_LICENSE
from deid.errors import ConfigError, DataError
from deid.urls import strip_urls

CARD_NAME = "README.md"
# Hugging Face's size_categories buckets.
_SIZES = ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
          (10_000_000, "1M<n<10M"))


_CSV_NOTE = ("CSV cells starting with `=`, `+`, `-`, `@`, TAB or CR are prefixed with `'` so that no "
             "spreadsheet runs them as formulas; `release.parquet` keeps the exact values.")


@dataclass(frozen=True)
class DatasetCard:
    """What the card states about one release (see :meth:`from_report`)."""

    release_id: str
    name: str
    k: int
    method: str
    guarantee: str
    created_at: str
    labels: tuple[str, ...]
    records: int
    clusters: int | None
    width: int | None
    height: int | None
    figures: KeyFigures
    warnings: tuple[str, ...]
    license: str | None
    color: bool = False
    kind: str = "images"  # "features": a release of feature vectors (deid.operations.features)
    dim: int | None = None  # the vectors' dimension (feature releases)
    videos: int = 0  # videos/<random id>.avi, one per image sequence
    frames: int = 0  # released faces that are frames of a video
    exact_bound: bool = True  # every cluster's members got the identical image (the gate found it in the data)
    # drop.yaml's license_name, license_link (the Hub's fields for license: other) and the source's citation.
    license_name: str | None = None
    license_link: str | None = None
    citation: str | None = None
    membership: dict | None = None  # the report's privacy.membership (deid.evaluation.membership)

    @classmethod
    def from_report(cls, report: dict[str, Any]) -> DatasetCard:
        """The card of the release a (not yet signed) ``released`` report describes.

        Raises
        ------
        ConfigError
            When the report's verdict is not ``released``: a rejected run has no release to describe.
        """
        if report.get("verdict") != "released":
            raise ConfigError(f"report verdict={report.get('verdict')!r}; only a released run gets a dataset card")
        cfg = report.get("configuration") or {}
        size = cfg.get("canonical_size") or [None, None]
        fig = key_figures(report)
        return cls(
            release_id=str(report["release_id"]), name=str(report["dataset"]["name"]), k=int(report["k"]),
            method=str(report["method"]), guarantee=str(report.get("guarantee") or "no formal guarantee"),
            created_at=str(report.get("created_at") or ""), labels=tuple(cfg.get("labels") or ()),
            records=int(report["dataset"]["records_released"]),
            clusters=(cfg.get("clusters") or {}).get("count"), width=size[0], height=size[1], figures=fig,
            warnings=tuple(report.get("warnings") or ()), license=cfg.get("license"), color=bool(cfg.get("color")),
            kind=str(cfg.get("kind") or "images"), dim=cfg.get("feature_dim"),
            videos=sum(1 for a in report.get("artifacts") or () if str(a.get("path", "")).startswith(f"{VIDEOS}/")),
            frames=int((cfg.get("method_inputs") or {}).get("frames") or 0),
            exact_bound=bool((report.get("privacy") or {}).get("exact_bound", True)),
            license_name=cfg.get("license_name"), license_link=cfg.get("license_link"), citation=cfg.get("citation"),
            membership=(report.get("privacy") or {}).get("membership"))

    def header(self) -> dict[str, Any]:
        """The YAML metadata block (Hugging Face keys, plus ``deid`` with the figures)."""
        fig = self.figures
        size = next((s for limit, s in _SIZES if self.records < limit), "n>10M")
        features = self.kind == "features"
        return {
            "pretty_name": f"{self.name} (de-identified, k={self.k})",
            **self._license_fields(),
            "task_categories": ([] if not self.labels else ["tabular-classification"] if features
                                else ["image-classification"]),
            "size_categories": [size],
            "tags": ["k-anonymity", "feature-vectors" if features else "face-de-identification", self.method, "deid"],
            "deid": {
                "release_id": self.release_id, "created_at": self.created_at, "k": self.k, "method": self.method,
                "guarantee": self.guarantee, "records": self.records, "clusters": self.clusters,
                "labels": list(self.labels),
                **({"kind": "features", "feature_dim": self.dim} if features else
                   {"image_size": [self.width, self.height], "color": self.color}),
                **({"videos": self.videos, "video_frames": self.frames} if self.videos else {}),
                "reidentification_bound": fig.bound, "max_reidentification_rate": fig.max_rate,
                "worst_attack": {"name": fig.worst_attack, "rate": fig.worst_rate, "lower": fig.worst_lower,
                                 "upper": fig.worst_upper, "probes": fig.worst_probes},
                "min_distinct_people_per_cluster": fig.min_people,
                "utility": [{"label": u.label, "original_accuracy": u.original_accuracy,
                             "release_accuracy": u.deidentified_accuracy, "delta_lower": u.delta_lower,
                             "delta_upper": u.delta_upper, "test_images": u.n_test, "decision": u.status}
                            for u in fig.utility],
                "report": f"reports/{self.release_id}/report.json",
            },
        }

    def _license_fields(self) -> dict[str, str]:
        """``license`` and, as the Hugging Face Hub expects for ``license: other``, ``license_name`` and
        ``license_link`` (when no licence was set: ``unspecified`` and this card, whose Licence section says so)."""
        license = self.license or DEFAULT_LICENSE
        out = {"license": license}
        if self.license_name or license == "other":
            out["license_name"] = self.license_name or "unspecified"
        if self.license_link or license == "other":
            out["license_link"] = self.license_link or CARD_NAME
        return out

    def render(self) -> str:
        """The card's text: ``---`` YAML header ``---`` then Markdown."""
        if self.kind == "features":
            return self._render(self._feature_intro())
        return self._render(self._image_intro())

    def _feature_intro(self) -> list[str]:
        """Title, description, guarantee, contents and loading of a feature release."""
        name = _md(self.name)
        labels = ", ".join(f"`{_md(x)}`" for x in self.labels) or "none"
        clusters = self.clusters if self.clusters is not None else "its"
        return [
            f"# {name}, de-identified (k = {self.k}, {self.method})",
            "",
            f"A de-identified release of the feature-vector dataset **{name}**, made and checked by deid on "
            f"{_md(self.created_at)} (release `{self.release_id}`). It holds {self.records} feature vectors of "
            f"{self.dim} values, in {clusters} clusters. Every vector is replaced by a vector computed from its "
            f"cluster of at least {self.k} people ({self.method}); no released vector is one person's record.",
            "",
            "## Guarantee",
            "",
            f"{_md(self.guarantee)}. Every released cluster holds at least {self.k} records of at least "
            f"{self.k} distinct people and no person makes up more than 1/{self.k} of a cluster's records, so an "
            f"attacker who matches a released vector against the people's original vectors re-identifies it with "
            f"probability at most 1/{self.k} = {1 / self.k:.3f}. The release carries no subject id, source id or "
            "source row; its rows are in random order with fresh random ids.",
            "",
            "## Contents",
            "",
            f"- `release.parquet`: one row per record: `record_id` (a fresh random id), `cluster_id` (a random id of "
            f"the record's cluster), the utility labels ({labels}) and `features`, the de-identified vector "
            f"(`fixed_size_list<float32>[{self.dim}]`).",
            "- `metadata.csv`: the same rows without the vectors.",
            "- `README.md`: this card.",
            f"- `{MANIFEST_NAME}`: the sha256 of the release's image files, one line each (a feature release has "
            "none: it is empty).",
            "",
            _CSV_NOTE,
            "",
            "## Loading",
            "",
            "```python",
            "import numpy as np",
            "import pandas as pd",
            "",
            'df = pd.read_parquet("path/to/this/directory/release.parquet")',
            'X = np.stack(df["features"].to_numpy())  # (records, features)',
            "",
            "from datasets import load_dataset",
            "",
            'ds = load_dataset("parquet", data_files="path/to/this/directory/release.parquet", split="train")',
            "```",
        ]

    def _image_intro(self) -> list[str]:
        """Title, description, guarantee, contents and loading of a face release."""
        name = _md(self.name)
        labels = ", ".join(f"`{_md(x)}`" for x in self.labels) or "none"
        size = f"{self.width} x {self.height} pixels" if self.width and self.height else "a fixed size"
        return [
            f"# {name}, de-identified (k = {self.k}, {self.method})",
            "",
            f"A de-identified release of the face dataset **{name}**, made and checked by deid on "
            f"{_md(self.created_at)} (release `{self.release_id}`). It holds {self.records} "
            f"{'colour' if self.color else 'grey-scale'} faces of "
            f"{size}, aligned on the eyes, in {self.clusters if self.clusters is not None else 'its'} clusters. "
            f"Every face is replaced by a face computed from its cluster of at least {self.k} people "
            f"({self.method}"
            + ("; the mean of the cluster's faces per colour channel" if self.color else "")
            + "); no released face is a photograph of one person."
            + (" The privacy figures below were measured on the grey version of these faces." if self.color else ""),
            "",
            "## Guarantee",
            "",
            f"{_md(self.guarantee)}. "
            + ("In this release, though, every cluster's faces are one identical image (the gate checked it). "
               if self.exact_bound and self.guarantee.startswith("no formal guarantee") else "")
            + f"Every released cluster holds at least {self.k} images of at least "
            f"{self.k} distinct people and no person makes up more than 1/{self.k} of a cluster's images, "
            + (f"so an attacker who matches a released face against photographs of the people re-identifies it "
               f"with probability at most 1/{self.k} = {1 / self.k:.3f}. "
               if self.exact_bound else
               f"but the faces of a cluster are not identical copies, so that structure bounds nothing by itself: "
               f"the evidence is the attacks below, each of whose upper confidence bounds was at most 1/{self.k} "
               f"= {1 / self.k:.3f} for this release to be published. ")
            + "The release carries no subject id, source path, source bytes or image metadata (EXIF); its rows "
            "are in random order with fresh random ids.",
            "",
            "## Contents",
            "",
            "- `images/*.png`: the faces (PNG written from pixels).",
            *([f"- `videos/*.avi`: {self.videos} videos, one per image sequence of the source ({self.frames} frames "
               f"in all; Motion-JPEG in AVI, {'colour' if self.color else 'grey'}, at the source recording's frame rate (the "
               f"rate a video file was decoded at; {VIDEO_FPS:g} frames per second for a sequence of image files), "
               "no audio, "
               "each frame padded to even sides by "
               "repeating its last column or row). Every frame is also an image under `images/`; the encoder's "
               "text tags are blanked."] if self.videos else []),
            "- `metadata.csv`: one row per image: `file_name` (the image, relative to this directory), "
            "`record_id` (a fresh random id), `cluster_id` (a random id of the face's cluster)"
            + (", `sequence_id` (the random id of its video, named `videos/<sequence_id>.avi`; empty for a still "
               "image) and `frame` (its position in the video, from 0)" if self.videos else "")
            + f" and the utility labels ({labels}).",
            "- `release.parquet` and `release.csv`: the same table with the image path in the column `image`.",
            "- `README.md`: this card.",
            f"- `{MANIFEST_NAME}`: the sha256 of every image, one `<sha256>  <path>` line each, sorted by path "
            f"(`sha256sum -c {MANIFEST_NAME}` in this directory checks them); the signed report lists its sha256.",
            "",
            _CSV_NOTE,
            "",
            "## Loading",
            "",
            "```python",
            "from datasets import load_dataset",
            "",
            'ds = load_dataset("imagefolder", data_dir="path/to/this/directory", split="train")',
            "",
            "import pandas as pd",
            "",
            'df = pd.read_parquet("path/to/this/directory/release.parquet")',
            *(["", "# one recording's frames in order, as images and as its video",
               'frames = df[df.sequence_id == "<sequence_id>"].sort_values("frame")',
               "import cv2",
               'cap = cv2.VideoCapture("path/to/this/directory/videos/<sequence_id>.avi")',
               "ok, first = cap.read()  # frame 0; cap.get(cv2.CAP_PROP_FPS) is its rate"] if self.videos else []),
            "```",
        ]

    def _render(self, intro: list[str]) -> str:
        lines = [*intro, *self._gate_figures()]
        lines += ["", "## What k-Same protects and what it does not", "",
                  f"- Protected: {SCOPE['protects']}", f"- Not protected: {SCOPE['does_not_protect']}"]
        if self.warnings:
            lines += ["", "Not decided by the data (the gate released, and says so):", ""]
            lines += [f"- {_md(w)}" for w in self.warnings]
        lines += _verifying_section()
        lines += self._licence_lines()
        if self.citation:
            lines += ["", "This release is derived from the source dataset: every face (or record) is replaced by one "
                      "computed from its cluster, as described above. Credit the source wherever this release or "
                      "results derived from it are shown.", "", "## Citation", "", "Cite the source dataset as:", "",
                      _md(self.citation)]
        body = "\n".join(lines) + "\n"
        header = self.header()
        # No address anywhere in the card (steward text is inert), except the header's license_link: the one
        # field the Hub reads a link from, set explicitly by the steward and checked when drop.yaml was read.
        token = f"license-link-{uuid.uuid4().hex}"
        link = header.get("license_link")
        if link is not None:
            header["license_link"] = token
        head = yaml.safe_dump(header, sort_keys=False, allow_unicode=True, width=1000)
        card = strip_urls(f"---\n{head}---\n\n{body}")
        if link is not None:
            card = card.replace(token, yaml.safe_dump(link, width=1000).removesuffix("\n...\n").strip(), 1)
        return card

    def _gate_figures(self) -> list[str]:
        """The card's section of the gate's figures: privacy, membership and the utility table."""
        fig = self.figures
        lines = [
            "",
            "## What the gate measured before release",
            "",
            "| figure | value |",
            "| --- | --- |",
            f"| k (minimum people per cluster) | {self.k} |",
            f"| bound on the re-identification rate (1/k) | {_f(fig.bound)} |",
            f"| highest measured re-identification rate | {_f(fig.max_rate)} |",
        ]
        if fig.worst_attack is not None:
            lines.append(f"| attack with the highest upper bound | {_md(fig.worst_attack)}: {_f(fig.worst_rate)}, "
                         f"confidence interval [{_f(fig.worst_lower)}, {_f(fig.worst_upper)}], {fig.worst_probes} probes |")
        lines.append(f"| fewest distinct people in a cluster | {fig.min_people if fig.min_people is not None else '-'} |")
        m = self.membership or {}
        if m.get("status") == "measured":
            lines.append(f"| membership AUC, not bounded by k (members vs non-members; 0.5 = a coin) | "
                         f"{_f(m['auc'])}, confidence interval [{_f(m['auc_interval'][0])}, "
                         f"{_f(m['auc_interval'][1])}], {m['members']} members and {m['non_members']} non-members |")
        if fig.utility:
            what, unit = ("records", "records") if self.kind == "features" else ("faces", "images")
            lines += ["", f"Utility: a classifier of each label trained on the original {what} and tested on held-out "
                      "originals, against one trained on the release (accuracy difference: originals minus "
                      "release, with its confidence interval).", "",
                      f"| label | originals | release | difference interval | test {unit} | decision |",
                      "| --- | --- | --- | --- | --- | --- |"]
            lines += [f"| {_md(u.label)} | {_f(u.original_accuracy)} | {_f(u.deidentified_accuracy)} | "
                      f"[{_f(u.delta_lower)}, {_f(u.delta_upper)}] | {u.n_test if u.n_test is not None else '-'} | "
                      f"{_md(u.status or '-')} |" for u in fig.utility]
        return lines

    def _licence_lines(self) -> list[str]:
        """The licence section: the steward's licence, or the default and where to ask."""
        lines = ["", "## Licence", ""]
        if self.license:
            lines.append(f"`{_md(self.license)}`"
                         + (f" ({_md(self.license_name)})" if self.license_name else "")
                         + ", as set by the data steward (`license:` in the drop's drop.yaml)"
                         + (": the terms are at `license_link` in this card's header." if self.license_link else "."))
        else:
            lines.append(f"`{DEFAULT_LICENSE}`: the data steward set no licence (`license:` in drop.yaml); ask the "
                         "steward for the terms of use before using or sharing this data.")
        return lines


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _md(text: Any) -> str:
    """Steward-supplied text as inert Markdown: no HTML, no table breaks, no code spans, no links."""
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("`", "'").replace("[", "\\[")


def write_card(release_dir: str | os.PathLike, card: DatasetCard) -> Path:
    """Write ``README.md`` into a (staged) release directory; return its path."""
    path = Path(release_dir) / CARD_NAME
    if not path.parent.is_dir():
        raise ConfigError(f"release_dir={str(path.parent)!r} is not a directory; stage the release first")
    path.write_text(card.render(), encoding="utf-8")
    return path


def split_card(text: str) -> tuple[dict[str, Any], str]:
    """(YAML header, Markdown body) of a card; raises DataError when the header is missing or not a mapping."""
    if not text.startswith("---\n"):
        raise DataError("the card does not start with a '---' YAML header")
    end = text.find("\n---\n", 4)
    if end < 0:
        raise DataError("the card's YAML header has no closing '---'")
    header = yaml.safe_load(text[4:end])
    if not isinstance(header, dict):
        raise DataError(f"the card's YAML header is a {type(header).__name__}, not a mapping")
    return header, text[end + 5:]


def _verifying_section() -> list[str]:
    """The card's section on verifying the release: the attestation, ``deid verify`` and the checks without deid."""
    return [
        "",
        "## Verifying this release",
        "",
        f"`{ATTESTATION_NAME}` is the data steward's signed statement about this release (verdict, k, method, "
        "guarantee, the gate's checks and figures, the signer's key fingerprint) and lists the sha256 of every "
        f"file here, this card included (the images through `{MANIFEST_NAME}`, whose sha256 it lists); "
        f"`{ATTESTATION_SIG_NAME}` is its Ed25519 signature (64 raw bytes). Get the steward's public key from the "
        "steward (a key shipped with the data proves nothing), save it as `STEWARD.pub.pem`, and in this "
        "directory run:",
        "",
        "```",
        "deid verify . --public-key STEWARD.pub.pem",
        "```",
        "",
        "Exit code 0 means the attestation is signed by that key and every file matches; a changed, missing "
        "or extra file fails (exit 3 bad signature, 4 wrong key, 5 missing file, 6 hash mismatch, 7 extra "
        "file). Without `--public-key` only integrity is checked (exit 8). Without deid, the same checks but "
        "the one for extra files (each command exits non-zero on a failure):",
        "",
        "```",
        *NO_DEID_CHECK,
        "```",
        "",
        "Without `openssl` (3.0 or later), check the signature with Python's `cryptography` package instead:",
        "",
        "```",
        PYTHON_SIGNATURE_CHECK,
        "```",
    ]
