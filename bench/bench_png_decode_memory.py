"""Peak memory of decoding large PNGs (issue 28): extra resident MB and its ratio to the decoded-byte budget.

Usage:
    .venv/bin/python bench/bench_png_decode_memory.py [--size 6000] [--out /tmp/png-bench]

Writes size x size PNGs (16-bit RGBA, the issue's case, plus 16-bit RGB, 16-bit grey, 8-bit RGBA and
8-bit RGB for comparison; smooth gradients, so the files are small like the issue's 280 KB one), then
decodes each with ``decode_gray`` and ``decode_color_reduced(factor=1)`` in a fresh process per
decode. That process reads the file, resets its peak RSS (``/proc/self/clear_refs``), decodes, and
reports VmHWM - VmRSS before: the decode's extra peak. The budget is
:func:`deid.intake.imaging.decoded_bytes` of the file (width x height x channels x bytes per
sample, what the decompression-bomb check admits). The issue's target: <= 1.2x for 16-bit and alpha.
Linux only (/proc).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

MB = 1e6
KINDS = {"rgba16": (4, np.uint16), "rgb16": (3, np.uint16), "gray16": (1, np.uint16), "rgba8": (4, np.uint8),
         "rgb8": (3, np.uint8)}


def make_png(path: Path, size: int, channels: int, dtype) -> None:
    import cv2

    top = np.iinfo(dtype).max
    ramp = (np.arange(size, dtype=np.float64) / max(size - 1, 1) * top).astype(dtype)
    img = np.empty((size, size, channels), dtype)
    for c in range(channels):  # each channel a gradient in its own direction; alpha half-transparent at one end
        img[:, :, c] = ramp[:, None] if c % 2 == 0 else ramp[None, :]
    if channels == 4:
        img[:, :, 3] = np.maximum(ramp[None, :], top // 2)
    ok, buf = cv2.imencode(".png", img[:, :, 0] if channels == 1 else img, [cv2.IMWRITE_PNG_COMPRESSION, 1])
    assert ok
    path.write_bytes(buf.tobytes())


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(path: Path, func: str) -> None:
    from deid.intake import imaging

    data = path.read_bytes()
    # Warm up the decoders on a small image of the same kind (library code, first-use allocations).
    small = path.with_name("warm-" + path.name)
    getattr(imaging, func)(small.read_bytes(), **({"factor": 1} if func == "decode_color_reduced" else {}))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    out = getattr(imaging, func)(data, **({"factor": 1} if func == "decode_color_reduced" else {}))
    peak = _status("VmHWM")
    print(json.dumps({"extra": peak - before, "budget": imaging.decoded_bytes(data), "out": out.nbytes,
                      "shape": list(out.shape)}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=6000)
    ap.add_argument("--out", type=Path, default=Path("/tmp/deid-png-bench"))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--child", nargs=2, metavar=("PNG", "FUNC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1])
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{'image':8} {'decode':22} {'file KB':>8} {'budget MB':>10} {'output MB':>10} {'peak extra MB':>14} {'ratio':>6}")
    for kind in args.kinds.split(","):
        channels, dtype = KINDS[kind]
        png = args.out / f"{kind}-{args.size}.png"
        if not png.exists():
            make_png(png, args.size, channels, dtype)
        make_png(args.out / f"warm-{png.name}", 64, channels, dtype)
        for func in ("decode_gray", "decode_color_reduced"):
            res = subprocess.run([sys.executable, __file__, "--child", str(png), func], capture_output=True, text=True,
                                 check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{kind:8} {func:22} {png.stat().st_size / 1e3:8.0f} {r['budget'] / MB:10.0f} {r['out'] / MB:10.0f} "
                  f"{r['extra'] / MB:14.0f} {r['extra'] / r['budget']:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
