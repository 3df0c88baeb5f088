"""The comparison study's figures: re-identification and utility against strength, the privacy-utility map, examples.

The shapes of Gross et al. (2005) Fig. 6 (re-identification against strength, with the 1/k curve)
and Fig. 8 (utility per label), the privacy-utility map of Gross et al. (2009) Fig. 12, and a grid
of released faces (never originals), drawn from the study's rows (:func:`deid.study.run_study`).

References
----------
R. Gross, E. Airoldi, B. Malin, L. Sweeney. Integrating utility into face de-identification. PET
2005, LNCS 3856, 227-242. R. Gross, L. Sweeney, J. Cohn, F. de la Torre, S. Baker. Face
de-identification. In Protecting Privacy in Video Surveillance, Springer, 2009, 129-146.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from deid.study import StudyResult, privacy_x, summary


def _plt():
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


_FAMILIES = ("k", "sigma", "block")


def _label_axes(ax, title: str, xlabel: str, ylabel: str, *, legend: float | None = None) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=legend)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
_STYLES = {"naive": "-", "reverse": "--", "parrot": ":"}


def plot_reidentification(rows: list[dict], out_dir: Path) -> list[Path]:
    """Re-identification per attacker and mode against strength, one figure per strength family
    (Gross et al. 2005 Fig. 6): rate with its Bonferroni-adjusted one-sided interval as bars, the
    1/k line, and for identical-copy releases the exact max person share (black squares)."""
    plt = _plt()
    priv = [r for r in rows if r["kind"] == "privacy"]
    verdicts = [r for r in rows if r["kind"] == "verdict"]
    attackers = list(dict.fromkeys(r["attacker"] for r in priv))
    modes = list(dict.fromkeys(r["mode"] for r in priv))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ks = sorted({r["k"] for r in verdicts})
    paths = []
    for fam in _FAMILIES:
        methods = list(dict.fromkeys(r["method"] for r in priv if r["strength_name"] == fam))
        if not methods:
            continue
        cols = min(4, len(methods))
        nrows = -(-len(methods) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.4 * cols, 3.8 * nrows + 0.9), squeeze=False)
        for ax in axes.ravel()[len(methods):]:
            ax.set_visible(False)
        for ax, method in zip(axes.ravel(), methods):
            mine = [r for r in priv if r["method"] == method]
            xs = sorted({r["strength"] for r in mine})
            span = (max(xs) - min(xs)) or 1.0
            for i, att in enumerate(attackers):
                for j, mode in enumerate(modes):
                    pts = sorted((r["strength"], r["rate"], r["lower"], r["upper"]) for r in mine
                                 if r["attacker"] == att and r["mode"] == mode)
                    if not pts:
                        continue
                    off = span * 0.004 * (i * len(modes) + j - len(attackers) * len(modes) / 2)
                    x = np.array([p[0] for p in pts], dtype=float) + off
                    y = np.array([p[1] for p in pts])
                    err = np.array([[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]).clip(0)
                    ax.errorbar(x, y, yerr=err, fmt=_STYLES.get(mode, "-"), marker="o", ms=2.5, lw=1, elinewidth=0.6,
                                capsize=1.5, color=colours[i % len(colours)], label=f"{att} / {mode}")
            exact = sorted((r["strength"], r["max_person_share"]) for r in verdicts
                           if r["method"] == method and r["exact_bound"] and r["max_person_share"] is not None)
            if exact:
                ax.plot(*zip(*exact), "ks", ms=5, label="exact max person share")
            if fam == "k":
                grid = np.linspace(min(xs), max(xs), 100)
                ax.plot(grid, 1.0 / grid, "k-", lw=2, alpha=0.5, label="1/k")
            else:
                for k in ks:
                    ax.axhline(1.0 / k, color="grey", lw=0.8, ls="-.")
                    ax.text(max(xs), 1.0 / k, f" 1/{k:g}", va="center", fontsize=7, color="grey")
            ax.set_title(method)
            ax.set_xlabel(fam)
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("re-identification rate (rank 1, people)")
        handles, names = [], []
        for ax in axes.ravel():
            for h, n in zip(*ax.get_legend_handles_labels()):
                if n not in names:
                    handles.append(h)
                    names.append(n)
        conf = next((r["confidence"] for r in priv), 0.95)
        m = next((r["bonferroni"] for r in priv), 1)
        fig.suptitle(f"re-identification vs {fam}: bars = one-sided {conf:.0%} Clopper-Pearson, "
                     f"Bonferroni over {m} attacker x mode pairs", fontsize=9)
        ncol = min(len(modes) + 1, 6)
        fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=6.5)
        fig.tight_layout(rect=(0, 0.05 + 0.022 * (len(names) // ncol + 1), 1, 0.97))
        paths.append(out_dir / f"reidentification_{fam}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def plot_utility(rows: list[dict], out_dir: Path) -> list[Path]:
    """Utility per label and strength family: the gate's cross-fitted accuracy drop with its
    bounds and the tolerance (Gross et al. 2005 Fig. 8 in the gate's protocol), and the older
    protocols' accuracies as evidence."""
    plt = _plt()
    util = [r for r in rows if r["kind"] == "utility"]
    labels = list(dict.fromkeys(r["label"] for r in util))
    fams = [f for f in _FAMILIES if any(r["strength_name"] == f for r in util)]
    if not labels or not fams:
        return []
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    methods = list(dict.fromkeys(r["method"] for r in util))
    paths = []
    fig, axes = plt.subplots(len(labels), len(fams), figsize=(5 * len(fams), 3.8 * len(labels)), squeeze=False)
    for i, label in enumerate(labels):
        for j, fam in enumerate(fams):
            ax = axes[i][j]
            cf = [r for r in util if r["label"] == label and r["strength_name"] == fam and r["protocol"] == "cross-fit"
                  and r["delta"] is not None]
            for mi, method in enumerate(methods):
                pts = sorted((r["strength"], r["delta"], r["lower"], r["upper"]) for r in cf if r["method"] == method)
                if not pts:
                    continue
                x = np.array([p[0] for p in pts], dtype=float) * (1 + 0.015 * (mi - len(methods) / 2))
                y = np.array([p[1] for p in pts])
                err = np.array([[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]).clip(0)
                ax.errorbar(x, y, yerr=err, marker="o", ms=3, lw=1, capsize=2, color=colours[mi % len(colours)],
                            label=method)
            tol = next((r["threshold"] for r in cf if r["threshold"] is not None), None)
            if tol is not None:
                ax.axhline(float(tol), color="r", ls="--", lw=1, label=f"tolerance {float(tol):g}")
            ax.axhline(0, color="k", lw=0.6)
            _label_axes(ax, f"{label}: cross-fit accuracy drop ({fam})", fam, "accuracy(originals) - accuracy(release)",
                        legend=6)
    paths.append(_save(fig, out_dir / "utility.png"))

    old = [r for r in util if r["protocol"] != "cross-fit" and r["accuracy"] is not None]
    protocols = list(dict.fromkeys(r["protocol"] for r in old))
    if old:
        styles = dict(zip(protocols, ("-", "--", ":", "-.")))
        fig, axes = plt.subplots(len(labels), len(fams), figsize=(5 * len(fams), 3.6 * len(labels)), squeeze=False)
        for i, label in enumerate(labels):
            for j, fam in enumerate(fams):
                ax = axes[i][j]
                for mi, method in enumerate(methods):
                    for p in protocols:
                        curve = sorted((r["strength"], r["accuracy"]) for r in old if r["method"] == method
                                       and r["label"] == label and r["protocol"] == p and r["strength_name"] == fam)
                        if curve:
                            ax.plot(*zip(*curve), styles.get(p, "-"), marker="o", ms=3,
                                    color=colours[mi % len(colours)], label=f"{method} / {p}")
                ax.set_ylim(0.3, 1.02)
                _label_axes(ax, f"{label}: older protocols ({fam})", fam, "accuracy", legend=5)
        paths.append(_save(fig, out_dir / "utility_protocols.png"))
    return paths


def plot_privacy_utility(rows: list[dict], out_dir: Path) -> Path | None:
    """The privacy-utility map (Gross et al. 2009, Fig. 12), one panel per label.

    x: the exact max person share for identical-copy releases, else the largest upper bound
    of the attacks; y: accuracy on held-out people's originals of the classifier trained on
    the release (the gate's cross-fit). One marker per method x strength (filled: the gate
    passed; open: it failed), 1/k lines, and the accuracy when trained on originals.
    """
    plt = _plt()
    points = [s for s in summary(rows) if s["verdict"] in ("pass", "fail")]
    labels = list(dict.fromkeys(lab for s in points for lab in s["utility"]))
    if not points or not labels:
        return None
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osD^v<>PXh*"
    methods = list(dict.fromkeys(s["method"] for s in points))
    ks = sorted({s["k"] for s in points if s["k"] is not None})
    fig, axes = plt.subplots(1, len(labels), figsize=(6.2 * len(labels), 5.2), squeeze=False)
    for ax, label in zip(axes[0], labels):
        for mi, method in enumerate(methods):
            for s in points:
                u = s["utility"].get(label)
                x = privacy_x(s)
                if s["method"] != method or u is None or u["accuracy"] is None or x is None:
                    continue
                c = colours[mi % len(colours)]
                ax.scatter([x], [u["accuracy"]], marker=markers[mi % len(markers)], s=40,
                           facecolors=c if s["verdict"] == "pass" else "none", edgecolors=c)
                ax.annotate(f"{s['strength']:g}", (x, u["accuracy"]), fontsize=6, xytext=(3, 2),
                            textcoords="offset points")
            ax.scatter([], [], marker=markers[mi % len(markers)], color=colours[mi % len(colours)], label=method)
        for k in ks:
            ax.axvline(1.0 / k, color="grey", lw=0.8, ls="-.")
            ax.text(1.0 / k, 0.01, f" 1/{k}", fontsize=7, color="grey", transform=ax.get_xaxis_transform())
        ref = [s["utility"][label]["original_accuracy"] for s in points
               if label in s["utility"] and s["utility"][label]["original_accuracy"] is not None]
        if ref:
            ax.axhline(float(np.mean(ref)), color="k", lw=1.2, alpha=0.6, label="trained on originals")
        ax.set_xlim(0, 1.02)
        ax.set_xlabel("privacy: exact max person share, else max upper bound of re-identification")
        ax.set_ylabel(f"{label} accuracy (trained on release, tested on held-out originals)", fontsize=8)
        ax.set_title(f"{label}: filled = gate passed, open = failed; numbers = strength", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    return _save(fig, out_dir / "privacy_utility.png")


TILE_GAP = 2
LABEL_WIDTH = 150


def example_grid(result: StudyResult) -> tuple[np.ndarray, dict[tuple[str, str, float, int], tuple[int, int]]]:
    """One mosaic of released faces: a row per method, its strengths side by side, the example
    records within each strength. Only de-identified faces are drawn.

    Returns
    -------
    mosaic : ndarray (uint8, grey)
    positions : dict
        ``(method, strength_name, strength, j) -> (top, left)`` of the tile of example record j.
    """
    import cv2  # noqa: PLC0415

    h, w = result.shape
    keys = list(result.examples)
    methods = list(dict.fromkeys(m for m, _, _ in keys))
    per_method = {m: [key for key in keys if key[0] == m] for m in methods}
    n_ex = len(result.example_records)
    width_strength = n_ex * (w + TILE_GAP) + 3 * TILE_GAP
    cols = max((len(v) for v in per_method.values()), default=0)
    header = 16
    row_h = header + h + TILE_GAP
    mosaic = np.full((max(1, len(methods)) * row_h + TILE_GAP, LABEL_WIDTH + cols * width_strength), 255, np.uint8)
    positions = {}
    for r, method in enumerate(methods):
        top = r * row_h + TILE_GAP
        cv2.putText(mosaic, method, (4, top + header + h // 2), cv2.FONT_HERSHEY_SIMPLEX, 0.42, 0, 1, cv2.LINE_AA)
        for c, key in enumerate(per_method[method]):
            left0 = LABEL_WIDTH + c * width_strength
            cv2.putText(mosaic, f"{key[1]}={key[2]:g}", (left0, top + 11), cv2.FONT_HERSHEY_SIMPLEX, 0.38, 0, 1,
                        cv2.LINE_AA)
            for j, face in enumerate(result.examples[key]):
                left = left0 + j * (w + TILE_GAP)
                mosaic[top + header:top + header + h, left:left + w] = face.reshape(h, w)
                positions[(key[0], key[1], key[2], j)] = (top + header, left)
    return mosaic, positions


def write_examples(result: StudyResult, out_dir: Path) -> Path | None:
    """``examples.png``: :func:`example_grid` as a lossless PNG (no metadata)."""
    import cv2  # noqa: PLC0415

    if not result.examples:
        return None
    mosaic, _ = example_grid(result)
    path = out_dir / "examples.png"
    if not cv2.imwrite(str(path), mosaic):
        raise OSError(f"could not write {path}")
    return path


def plot_study(result: StudyResult, out_dir: str | Path) -> list[Path]:
    """Every plot of the study as PNG files in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = plot_reidentification(result.rows, out) + plot_utility(result.rows, out)
    paths += [p for p in (plot_privacy_utility(result.rows, out), write_examples(result, out)) if p is not None]
    return paths


