"""Decoding by content, header sizes, EXIF orientation and the quarantine codes of deid.intake.imaging."""
from __future__ import annotations

import struct
import zlib

import cv2
import numpy as np
import pytest

from deid.errors import ConfigError, RecordError
from deid.intake.imaging import (
    decode_gray,
    decode_gray_reduced,
    exif_orientation,
    header_size,
    sniff_format,
    upright_size,
)

H, W = 40, 56


def _gray() -> np.ndarray:
    rng = np.random.default_rng(7)
    yy, xx = np.mgrid[0:H, 0:W]
    img = (xx * 4 + yy * 2).astype(np.uint8)
    img[:8, :8] = 250  # bright top-left corner, to see rotations
    img[-8:, -8:] = 5
    return img + rng.integers(0, 3, size=img.shape, dtype=np.uint8)


def _bgr(g: np.ndarray) -> np.ndarray:
    return cv2.merge([g, g, g])


def _enc(ext: str, img: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(ext, img)
    assert ok, ext
    return buf.tobytes()


def _code(data: bytes, **kw) -> str:
    with pytest.raises(RecordError) as info:
        decode_gray(data, **kw)
    return info.value.code


LOSSLESS = [
    (".png", "png", lambda g: g),
    (".pgm", "pnm", lambda g: g),
    (".ppm", "pnm", _bgr),
    (".bmp", "bmp", lambda g: g),
    (".tiff", "tiff", lambda g: g),
    (".png", "png", _bgr),
]


@pytest.mark.parametrize("ext,fmt,make", LOSSLESS)
def test_lossless_formats_decode_exactly(ext, fmt, make):
    g = _gray()
    data = _enc(ext, make(g))
    assert sniff_format(data) == fmt
    assert header_size(data) == (W, H)
    out = decode_gray(data)
    assert out.dtype == np.uint8 and out.shape == (H, W)
    # Grey stored as BGR converts back within rounding.
    assert np.abs(out.astype(int) - g.astype(int)).max() <= 1


def test_jpeg_decodes_close_to_source_and_by_content(tmp_path):
    g = _gray()
    data = _enc(".jpg", g)
    # A wrong extension on disk does not matter: only the bytes are looked at.
    p = tmp_path / "face.png"
    p.write_bytes(data)
    raw = p.read_bytes()
    assert sniff_format(raw) == "jpeg"
    assert header_size(raw) == (W, H)
    out = decode_gray(raw)
    assert out.shape == (H, W)
    assert np.abs(out.astype(float) - g.astype(float)).mean() < 4.0


def test_gif_decodes():
    g = _gray()
    data = _enc(".gif", _bgr(g))  # OpenCV's GIF encoder needs 3 channels
    assert sniff_format(data) == "gif"
    assert header_size(data) == (W, H)
    out = decode_gray(data)
    assert out.shape == (H, W)
    # OpenCV quantises to a dithered palette: compare structure, not exact values.
    assert np.corrcoef(out.ravel(), g.ravel())[0, 1] > 0.95
    assert out[:6, :6].mean() > 200 and out[-6:, -6:].mean() < 40


@pytest.mark.parametrize("ext", [".png", ".tiff"])
def test_16_bit_scaled_to_8_bit(ext):
    g = _gray()
    data = _enc(ext, g.astype(np.uint16) * 257)
    out = decode_gray(data)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, g)


def test_alpha_composited_over_white():
    g = _gray()
    alpha = np.full((H, W), 255, np.uint8)
    alpha[:, : W // 2] = 0  # left half fully transparent
    alpha[:, W // 2 :] = 255
    bgra = cv2.merge([g, g, g, alpha])
    out = decode_gray(_enc(".png", bgra))
    assert (out[:, : W // 2] == 255).all()
    assert np.abs(out[:, W // 2 :].astype(int) - g[:, W // 2 :].astype(int)).max() <= 1


def test_half_transparent_blends_with_white():
    g = np.zeros((H, W), np.uint8)
    bgra = cv2.merge([g, g, g, np.full((H, W), 128, np.uint8)])
    out = decode_gray(_enc(".png", bgra))
    assert np.all(np.abs(out.astype(int) - 127) <= 1)


def _exif_app1(orientation: int) -> bytes:
    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1)
    tiff += struct.pack("<HHIHH", 274, 3, 1, orientation, 0) + struct.pack("<I", 0)
    payload = b"Exif\x00\x00" + tiff
    return b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload


def _png_exif(png: bytes, orientation: int) -> bytes:
    tiff = b"MM\x00*" + struct.pack(">I", 8) + struct.pack(">H", 1)
    tiff += struct.pack(">HHIHH", 274, 3, 1, orientation, 0) + struct.pack(">I", 0)
    chunk = struct.pack(">I", len(tiff)) + b"eXIf" + tiff + struct.pack(">I", zlib.crc32(b"eXIf" + tiff))
    ihdr_end = 8 + 8 + 13 + 4
    return png[:ihdr_end] + chunk + png[ihdr_end:]


def test_jpeg_exif_orientation_6_is_applied():
    g = _gray()
    plain = _enc(".jpg", g)
    data = plain[:2] + _exif_app1(6) + plain[2:]
    assert exif_orientation(data) == 6
    out = decode_gray(data)
    assert out.shape == (W, H)  # rotated 90 degrees
    # Orientation 6 = rotate 90 clockwise: the bright top-left corner goes to the top-right.
    assert out[:6, -6:].mean() > 200 and out[:6, :6].mean() < 150
    reduced = decode_gray_reduced(data, 2)
    assert reduced.shape == (W // 2, H // 2)
    # The reduced decode is turned upright too (OpenCV applies EXIF to IMREAD_REDUCED_* as well).
    ref = cv2.resize(out, (H // 2, W // 2), interpolation=cv2.INTER_AREA).astype(float)
    assert np.abs(reduced.astype(float) - ref).mean() < 4.0
    assert upright_size(data) == (H, W) and header_size(data) == (W, H)
    assert upright_size(plain) == (W, H) and upright_size(b"junk") is None


def test_png_exif_orientation_matches_jpeg_handling():
    g = _gray()
    data = _png_exif(_enc(".png", g), 6)
    assert exif_orientation(data) == 6
    out = decode_gray(data)
    np.testing.assert_array_equal(out, cv2.rotate(g, cv2.ROTATE_90_CLOCKWISE))


def test_zero_bytes_is_empty_file():
    assert _code(b"") == "empty_file"


def test_random_bytes_are_unsupported():
    rng = np.random.default_rng(0)
    data = b"\x00" + rng.integers(0, 256, size=500, dtype=np.uint8).tobytes()
    assert sniff_format(data) is None
    assert _code(data) == "unsupported_format"
    assert _code(b"BMxxxxxxxxxxxxxxxxxxxxx") == "unsupported_format"


def test_truncated_jpeg_is_corrupt():
    data = _enc(".jpg", cv2.resize(_gray(), (400, 300)))
    assert _code(data[: len(data) // 2]) == "corrupt_image"
    assert _code(data[:-2]) == "corrupt_image"  # only the EOI marker missing


def test_truncated_png_and_garbled_data_are_corrupt():
    png = _enc(".png", _gray())
    assert _code(png[: len(png) // 2]) == "corrupt_image"
    bmp = _enc(".bmp", _gray())
    assert _code(bmp[:60]) == "corrupt_image"
    assert _code(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"\x00" * 20) == "corrupt_image"  # no frame header


def test_header_declared_huge_image_is_refused_before_decoding():
    png = bytearray(_enc(".png", _gray()))
    struct.pack_into(">II", png, 16, 200_000, 200_000)  # 4e10 pixels; CRC now wrong, never decoded
    assert header_size(bytes(png)) == (200_000, 200_000)
    assert _code(bytes(png)) == "image_too_large"
    jpg = _enc(".jpg", _gray())
    assert _code(jpg, max_pixels=W * H - 1) == "image_too_large"
    assert decode_gray(jpg, max_pixels=W * H).shape == (H, W)


def test_header_sizes_of_other_formats():
    gif = bytearray(_enc(".gif", _bgr(_gray())))
    struct.pack_into("<HH", gif, 6, 60_000, 60_000)
    assert _code(bytes(gif)) == "image_too_large"
    assert header_size(b"P5\n# comment\n 640\t480\n255\n") == (640, 480)
    assert _code(b"P5\n30000 30000\n255\n" + b"\x00" * 10) == "image_too_large"


def test_reduced_decode_matches_full_scale():
    g = cv2.resize(_gray(), (400, 320))
    for ext in (".jpg", ".png"):
        data = _enc(ext, g)
        small = decode_gray_reduced(data, 4)
        assert small.shape == (80, 100)
        ref = cv2.resize(g, (100, 80), interpolation=cv2.INTER_AREA)
        assert np.abs(small.astype(float) - ref.astype(float)).mean() < 4.0
    with pytest.raises(ConfigError, match="factor=3"):
        decode_gray_reduced(data, 3)


def test_bad_max_pixels_is_config_error():
    with pytest.raises(ConfigError, match="max_pixels"):
        decode_gray(_enc(".png", _gray()), max_pixels=0)


def _old_path(data: bytes, *, colour: bool) -> np.ndarray:
    """The OpenCV decode every image took before issue 28 (still the path of 8-bit grey/colour PNGs)."""
    from deid.intake import imaging

    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    return imaging._to_bgr(img) if colour else imaging._to_gray(img)


def test_alpha_pngs_decode_a_strip_at_a_time_to_opencvs_bytes_and_16_bit_to_the_high_byte(monkeypatch):
    import io

    from PIL import Image

    from deid.intake import imaging
    from deid.intake.imaging import decode_color_reduced

    monkeypatch.setattr(imaging, "_CHUNK", 4096)  # strips of 3 RGBA rows (6 of LA): many strips, small images
    rng = np.random.default_rng(2)
    yy, xx = np.mgrid[0:150, 0:77]  # odd width, rows not a multiple of the strip
    rgba = np.dstack([(xx * 3 + yy) % 256, (yy * 2) % 256, rng.integers(0, 256, xx.shape), (xx + yy) % 256]
                     ).astype(np.uint8)
    pngs = {"opencv RGBA": cv2.imencode(".png", rgba)[1].tobytes()}
    for mode, arr in (("RGBA", rgba), ("LA", rgba[:, :, [0, 3]])):  # Pillow's adaptive filters (Paeth, ...)
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(arr), mode).save(buf, "PNG", optimize=True)
        pngs[f"pillow {mode}"] = buf.getvalue()
    for name, data in pngs.items():
        assert np.array_equal(decode_gray(data), _old_path(data, colour=False)), name
        assert np.array_equal(decode_color_reduced(data, 1), _old_path(data, colour=True)), name
    # 16-bit (RGBA, grey): Pillow keeps each sample's high byte; OpenCV's path rounded v * 255 / 65535.
    for shape in ((50, 70, 4), (50, 70)):
        img16 = rng.integers(0, 65536, size=shape, dtype=np.uint16)
        data = cv2.imencode(".png", img16)[1].tobytes()
        high = (img16 >> 8).astype(np.uint8)
        assert np.array_equal(decode_gray(data), _old_path(cv2.imencode(".png", high)[1].tobytes(), colour=False))
        # Within one level (two where colour and alpha both moved one: the composite over white).
        assert np.abs(decode_gray(data).astype(int) - _old_path(data, colour=False)).max() <= len(shape) - 1
    # A corrupt IDAT (its CRC) or a stream that ends early is corrupt_image, as libpng said.
    data = pngs["opencv RGBA"]
    for bad in (data[: len(data) // 2] + data[-12:], data[:-30] + data[-12:]):
        with pytest.raises(RecordError) as err:
            decode_gray(bad)
        assert err.value.code == "corrupt_image"


def test_a_16_bit_rgba_png_decodes_within_1_2x_its_decoded_bytes(tmp_path):
    """Issue 28: peak RSS of the decode, in a fresh process (bench/bench_png_decode_memory.py's measurement)."""
    import importlib.util
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "bench" / "bench_png_decode_memory.py"
    spec = importlib.util.spec_from_file_location("bench_png", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    png = tmp_path / "rgba16.png"
    bench.make_png(png, 2000, 4, np.uint16)  # 32 MB decoded: well above the interpreter's own noise
    bench.make_png(tmp_path / "warm-rgba16.png", 64, 4, np.uint16)
    res = subprocess.run([sys.executable, str(script), "--child", str(png), "decode_color_reduced"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["budget"] == 2000 * 2000 * 4 * 2 and r["shape"] == [2000, 2000, 3]
    assert r["extra"] <= 1.2 * r["budget"], f"peak +{r['extra'] / 1e6:.0f} MB for {r['budget'] / 1e6:.0f} MB decoded"
