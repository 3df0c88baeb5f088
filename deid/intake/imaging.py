"""Image decoding by content: sniff the format, refuse decompression bombs from the header, decode to grey.

Every failure on a single file is a :class:`~deid.errors.RecordError` with a stable code, so that the
caller can quarantine the record and carry on with the rest of the drop.
"""
from __future__ import annotations

import io
import logging
import struct
import zlib

import cv2
import numpy as np

from deid.errors import ConfigError, RecordError

logger = logging.getLogger(__name__)

__all__ = ["sniff_format", "header_size", "decoded_bytes", "max_decoded_bytes", "upright_size", "decode_gray", "decode_gray_reduced", "decode_color_reduced", "exif_orientation", "is_colour",
           "COLOUR_TOLERANCE", "COLOUR_MIN_FRACTION"]

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers carry the size; C4 (DHT), C8 (JPG) and CC (DAC) share the range but do not.
_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_REDUCED_FLAGS = {
    1: cv2.IMREAD_GRAYSCALE,
    2: cv2.IMREAD_REDUCED_GRAYSCALE_2,
    4: cv2.IMREAD_REDUCED_GRAYSCALE_4,
    8: cv2.IMREAD_REDUCED_GRAYSCALE_8,
}
_REDUCED_COLOR_FLAGS = {
    1: cv2.IMREAD_COLOR,
    2: cv2.IMREAD_REDUCED_COLOR_2,
    4: cv2.IMREAD_REDUCED_COLOR_4,
    8: cv2.IMREAD_REDUCED_COLOR_8,
}

_opencv_quiet = False


def _quiet_opencv() -> None:
    # libjpeg/libpng warnings on corrupt files go to stderr through OpenCV's logger; every such file
    # is reported as a RecordError instead, so the log lines are only noise (in every Dask worker).
    global _opencv_quiet
    if _opencv_quiet:
        return
    try:
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)
    except AttributeError:  # pragma: no cover - older bindings
        cv2.setLogLevel(0)
    _opencv_quiet = True


def sniff_format(data: bytes) -> str | None:
    """Name of the image format from the leading bytes ('jpeg', 'png', 'pnm', 'gif', 'bmp', 'tiff') or None."""
    head = bytes(data[:18])
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith(_PNG_MAGIC):
        return "png"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return "tiff"
    if head.startswith(b"BM") and len(head) >= 18:
        # "BM" alone is too weak a signature: also require a known DIB header size.
        dib = struct.unpack_from("<I", head, 14)[0]
        if dib in (12, 16, 40, 52, 56, 64, 108, 124):
            return "bmp"
        return None
    if len(head) >= 3 and head[0:1] == b"P" and head[1:2] in b"123456" and head[2:3] in b" \t\r\n#":
        return "pnm"
    return None


def _jpeg_sof(data: bytes) -> int | None:
    """Offset of the JPEG's start-of-frame segment (its size, precision and channels), or None."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # stand-alone markers
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # EOI / SOS before any SOF: no frame header
            return None
        length = (data[i + 2] << 8) | data[i + 3]
        if length < 2:
            return None
        if marker in _SOF_MARKERS:
            return i if i + 9 <= n else None
        i += 2 + length
    return None


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = _jpeg_sof(data)
    if i is None:
        return None
    height, width = struct.unpack_from(">HH", data, i + 5)
    return (width, height)


def _pnm_size(data: bytes) -> tuple[int, int] | None:
    tokens: list[int] = []
    i, n = 2, min(len(data), 4096)
    while len(tokens) < 2 and i < n:
        c = data[i : i + 1]
        if c == b"#":
            while i < n and data[i : i + 1] not in (b"\n", b"\r"):
                i += 1
        elif c.isspace():
            i += 1
        elif c.isdigit():
            j = i
            while j < n and data[j : j + 1].isdigit():
                j += 1
            tokens.append(int(data[i:j]))
            i = j
        else:
            return None
    return (tokens[0], tokens[1]) if len(tokens) == 2 else None


def _tiff_ifd0(data: bytes, base: int = 0) -> dict[int, int] | None:
    """Integer tags of the first IFD of a TIFF structure starting at ``base`` (also EXIF blocks)."""
    if len(data) < base + 8:
        return None
    order = data[base : base + 2]
    if order == b"II":
        e = "<"
    elif order == b"MM":
        e = ">"
    else:
        return None
    (offset,) = struct.unpack_from(e + "I", data, base + 4)
    pos = base + offset
    if pos + 2 > len(data):
        return None
    (count,) = struct.unpack_from(e + "H", data, pos)
    tags: dict[int, int] = {}
    for k in range(min(count, 512)):
        entry = pos + 2 + 12 * k
        if entry + 12 > len(data):
            break
        tag, typ, cnt = struct.unpack_from(e + "HHI", data, entry)
        if cnt != 1:
            continue
        if typ == 3:  # SHORT, left-justified in the value field
            tags[tag] = struct.unpack_from(e + "H", data, entry + 8)[0]
        elif typ == 4:  # LONG
            tags[tag] = struct.unpack_from(e + "I", data, entry + 8)[0]
    return tags


def header_size(data: bytes, *, fmt: str | None = None) -> tuple[int, int] | None:
    """(width, height) read from the image header without decoding, or None if it cannot be read.

    ``fmt``: :func:`sniff_format` of ``data`` when the caller has it already.
    """
    data = bytes(data[:65536]) if not isinstance(data, bytes) else data
    fmt = fmt or sniff_format(data)
    try:
        if fmt == "jpeg":
            return _jpeg_size(data)
        if fmt == "png":
            if data[12:16] != b"IHDR":
                return None
            return struct.unpack_from(">II", data, 16)
        if fmt == "gif":
            return struct.unpack_from("<HH", data, 6)
        if fmt == "bmp":
            (dib,) = struct.unpack_from("<I", data, 14)
            if dib == 12:
                return struct.unpack_from("<HH", data, 18)
            w, h = struct.unpack_from("<ii", data, 18)
            return (abs(w), abs(h))  # negative height = top-down rows
        if fmt == "pnm":
            return _pnm_size(data)
        if fmt == "tiff":
            tags = _tiff_ifd0(data)
            if tags is None or 256 not in tags or 257 not in tags:
                return None
            return (tags[256], tags[257])
    except struct.error:
        return None
    return None


# Decoded-buffer budget per pixel of max_pixels: an 8-bit RGB image at the pixel limit fits exactly;
# a 16-bit RGBA one (8 bytes per pixel) is held to 3/8 of the pixel limit.
BYTES_PER_PIXEL_BUDGET = 3


def max_decoded_bytes(max_pixels: int) -> int:
    """The most bytes a decoded image may take: ``BYTES_PER_PIXEL_BUDGET * max_pixels``."""
    return BYTES_PER_PIXEL_BUDGET * int(max_pixels)


def _tiff_samples(data: bytes) -> tuple[int, int] | None:
    """(samples per pixel, bytes per sample) of a TIFF's first IFD (BitsPerSample may be an array)."""
    if len(data) < 8 or data[:2] not in (b"II", b"MM"):
        return None
    e = "<" if data[:2] == b"II" else ">"
    (pos,) = struct.unpack_from(e + "I", data, 4)
    (count,) = struct.unpack_from(e + "H", data, pos)
    samples, bits = 1, 8
    for k in range(min(count, 512)):
        entry = pos + 2 + 12 * k
        tag, typ, cnt = struct.unpack_from(e + "HHI", data, entry)
        if tag == 277 and typ == 3:
            samples = struct.unpack_from(e + "H", data, entry + 8)[0]
        elif tag == 258 and typ == 3:
            where = entry + 8 if cnt <= 2 else struct.unpack_from(e + "I", data, entry + 8)[0]
            bits = max(struct.unpack_from(e + "H", data, where + 2 * i)[0] for i in range(min(cnt, 8)))
    return max(samples, 1), max(1, -(-bits // 8))


def decoded_bytes(data: bytes, *, fmt: str | None = None, size: tuple[int, int] | None = None) -> int | None:
    """Bytes of the decoded buffer, width x height x channels x bytes per sample, from the header only.

    A bit depth or channel count the header does not give is taken at its worst case for the
    format (OpenCV decodes palettes and GIF to 3-4 channels). None when the size is unreadable.
    ``fmt`` and ``size``: :func:`sniff_format` and :func:`header_size` of ``data`` when the caller
    has them already (the ingest reads each header once).
    """
    fmt = fmt or sniff_format(data)
    size = size or header_size(data, fmt=fmt)
    if size is None:
        return None
    w, h = size
    channels, per_sample = 4, 1
    try:
        if fmt == "png":
            depth, color = data[24], data[25]
            channels = {0: 1, 2: 3, 3: 4, 4: 4, 6: 4}.get(color, 4)  # grey+alpha is decoded as BGRA
            per_sample = 2 if depth == 16 else 1
        elif fmt == "jpeg":
            i = _jpeg_sof(data)
            if i is not None and i + 10 <= len(data):
                precision, channels = data[i + 4], data[i + 9]
                per_sample = 2 if precision > 8 else 1
        elif fmt == "pnm":
            channels = 3 if data[1:2] in b"36" else 1
            tokens = data[2:64].split()
            maxval = int(tokens[2]) if data[1:2] not in b"14" and len(tokens) >= 3 and tokens[2].isdigit() else 255
            per_sample = 2 if maxval > 255 else 1
        elif fmt == "bmp":
            (dib,) = struct.unpack_from("<I", data, 14)
            bpp = struct.unpack_from("<H", data, 24 if dib == 12 else 28)[0]
            channels = 4 if bpp == 32 else 3
        elif fmt == "tiff":
            channels, per_sample = _tiff_samples(data) or (4, 8)
    except (struct.error, IndexError, ValueError):
        channels, per_sample = 4, 8  # unreadable depth: assume the worst
    return int(w) * int(h) * max(int(channels), 1) * per_sample


def _exif_block(data: bytes, fmt: str) -> tuple[bytes, int] | None:
    """(buffer, offset) of the TIFF-structured EXIF block of a JPEG/PNG, or the TIFF file itself."""
    if fmt == "tiff":
        return data, 0
    if fmt == "jpeg":
        i, n = 2, len(data)
        while i + 4 <= n and data[i] == 0xFF:
            marker = data[i + 1]
            if marker == 0xDA:
                return None
            (length,) = struct.unpack_from(">H", data, i + 2)
            if marker == 0xE1 and data[i + 4 : i + 10] == b"Exif\x00\x00":
                return data, i + 10
            i += 2 + length
        return None
    if fmt == "png":
        i = 8
        while i + 8 <= len(data):
            length, ctype = struct.unpack_from(">I4s", data, i)
            if ctype == b"eXIf":
                return data, i + 8
            if ctype in (b"IDAT", b"IEND"):
                return None
            i += 12 + length
    return None


def exif_orientation(data: bytes) -> int:
    """EXIF orientation (1-8) of a JPEG, PNG (eXIf) or TIFF; 1 when absent or unreadable."""
    fmt = sniff_format(data)
    if fmt is None:
        return 1
    try:
        block = _exif_block(data, fmt)
        if block is None:
            return 1
        tags = _tiff_ifd0(*block)
    except struct.error:
        return 1
    value = (tags or {}).get(274, 1)
    return value if 1 <= value <= 8 else 1


def upright_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of the decoded image once turned upright per EXIF (header only), or None."""
    size = header_size(data)
    if size is None:
        return None
    # Orientations 5-8 include a transpose: width and height swap.
    return (size[1], size[0]) if exif_orientation(data) >= 5 else size


def _apply_orientation(img: np.ndarray, orientation: int) -> np.ndarray:
    # Same mapping as OpenCV's ApplyExifOrientation, so every format is turned upright the same way.
    if orientation == 2:
        return cv2.flip(img, 1)
    if orientation == 3:
        return cv2.rotate(img, cv2.ROTATE_180)
    if orientation == 4:
        return cv2.flip(img, 0)
    if orientation == 5:
        return cv2.transpose(img)
    if orientation == 6:
        return cv2.rotate(img, cv2.ROTATE_90_CLOCKWISE)
    if orientation == 7:
        return cv2.rotate(cv2.transpose(img), cv2.ROTATE_180)
    if orientation == 8:
        return cv2.rotate(img, cv2.ROTATE_90_COUNTERCLOCKWISE)
    return img


def _jpeg_truncated(data: bytes) -> bool:
    # Entropy-coded data escapes 0xFF as FF00, so an FFD9 after the first SOS can only be the EOI.
    # Looking only after SOS skips the EOI of an embedded EXIF thumbnail.
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return True
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):
            i += 2
            continue
        if marker == 0xD9:
            return True  # EOI before any scan: no image data
        if marker == 0xDA:
            # The EOI is normally in the last bytes: look there first, the whole scan only if not.
            if data.rfind(b"\xff\xd9", max(i + 2, n - 256)) != -1:
                return False
            return data.find(b"\xff\xd9", i + 2) == -1
        (length,) = struct.unpack_from(">H", data, i + 2)
        i += 2 + length
    return True


# Elements converted at a time: the temporaries of a conversion stay ~8 MB whatever the image's size,
# so decoding holds the decoded buffer and the output only (a 6000x6000 16-bit RGBA PNG: 288 MB decoded;
# whole-image uint32/float32 temporaries took 1.45 GB, 5x the decoded-byte budget; issue 28).
_CHUNK = 1 << 20


def _u16_to_u8(img: np.ndarray) -> np.ndarray:
    """A uint16 array scaled to uint8 (``(v * 255 + 32767) // 65535``) in its own buffer, a chunk at a time.

    Element ``i``'s byte goes to byte ``i`` of the buffer, which held element ``i // 2``: already
    read (each chunk is copied out before its bytes are written), so no second buffer is needed.
    The result is a view of the decoded buffer (freed with it).
    """
    flat = np.ascontiguousarray(img).reshape(-1)
    out = flat.view(np.uint8)[: flat.size]
    for a in range(0, flat.size, _CHUNK):
        t = flat[a:a + _CHUNK].astype(np.uint32)
        t *= 255
        t += 32767
        t //= 65535
        out[a:a + len(t)] = t
    return out.reshape(img.shape)


def _to_uint8(img: np.ndarray) -> np.ndarray:
    """A decoded image as uint8; a 16-bit one is converted inside its own buffer (the decoder's, not shared)."""
    if img.dtype == np.uint8:
        return img
    if img.dtype == np.uint16:
        return _u16_to_u8(img)
    if img.dtype == np.int8:
        return (img.astype(np.int16) + 128).astype(np.uint8)
    if img.dtype == np.int16:
        return ((img.astype(np.int32) + 32768) * 255 // 65535).astype(np.uint8)
    if np.issubdtype(img.dtype, np.floating):
        f = np.nan_to_num(img.astype(np.float64), nan=0.0, posinf=1.0, neginf=0.0)
        # Float images are conventionally in [0, 1]; anything larger is taken as already 0-255.
        scale = 255.0 if f.max(initial=0.0) <= 1.0 else 1.0
        return np.clip(np.rint(f * scale), 0, 255).astype(np.uint8)
    return np.clip(img, 0, 255).astype(np.uint8)


def _over_white(colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """``colour`` composited over white by ``alpha`` (uint8 both; alpha 2-D), rounded to uint8."""
    a = alpha.astype(np.float32) / 255.0
    if colour.ndim == 3:
        a = a[:, :, None]
    out = colour.astype(np.float32) * a + 255.0 * (1.0 - a)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def _row_chunks(img: np.ndarray) -> range:
    """Row starts of blocks of about :data:`_CHUNK` elements."""
    per_row = max(1, int(np.prod(img.shape[1:])))
    return range(0, img.shape[0], max(1, _CHUNK // per_row))


def _gray_block(block: np.ndarray) -> np.ndarray:
    """Rows of a uint8 image with 2 (grey, alpha) or 4 (B, G, R, alpha) channels to grey composited over white."""
    gray = block[:, :, 0] if block.shape[2] == 2 else cv2.cvtColor(block[:, :, :3], cv2.COLOR_BGR2GRAY)
    return _over_white(gray, block[:, :, 1 if block.shape[2] == 2 else 3])


def _bgr_block(block: np.ndarray) -> np.ndarray:
    """Rows of a uint8 image with 2 or 4 channels (as :func:`_gray_block`) to BGR composited over white."""
    colour = cv2.cvtColor(block[:, :, 0], cv2.COLOR_GRAY2BGR) if block.shape[2] == 2 else block[:, :, :3]
    return _over_white(colour, block[:, :, 1 if block.shape[2] == 2 else 3])


def _to_gray(img: np.ndarray) -> np.ndarray:
    """Any decoded array (grey, grey+alpha, BGR, BGRA; 8/16-bit/float) to 2-D uint8, alpha over white."""
    img = _to_uint8(img)
    if img.ndim == 2:
        return img
    channels = img.shape[2]
    if channels == 1:
        return img[:, :, 0]
    if channels == 3:
        return cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
    out = np.empty(img.shape[:2], np.uint8)
    step = _row_chunks(img).step
    for r in _row_chunks(img):  # a block of rows at a time: float32 temporaries of the block only
        out[r:r + step] = _gray_block(img[r:r + step])
    return out


def _to_bgr(img: np.ndarray) -> np.ndarray:
    """Any decoded array to (h, w, 3) uint8 BGR: grey replicated, alpha composited over white (as :func:`_to_gray`)."""
    img = _to_uint8(img)
    if img.ndim == 2:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2BGR)
    channels = img.shape[2]
    if channels == 1:
        return cv2.cvtColor(img[:, :, 0], cv2.COLOR_GRAY2BGR)
    if channels == 3:
        return img
    out = np.empty((*img.shape[:2], 3), np.uint8)
    step = _row_chunks(img).step
    for r in _row_chunks(img):
        out[r:r + step] = _bgr_block(img[r:r + step])
    return out


def _streams_png(data: bytes) -> bool:
    """Is this a PNG that :func:`_decode_png_rows` decodes (16 bits per sample, or grey/colour with alpha)?

    OpenCV's PNG decoder holds twice the decoded buffer (measured: peak 2.0x of :func:`decoded_bytes`,
    bench/bench_png_decode_memory.py); Pillow's decodes row by row into an 8-bit image. Other PNGs (8-bit
    grey, colour, palette) stay on OpenCV, byte for byte as before.
    """
    return sniff_format(data) == "png" and len(data) > 25 and (data[24] == 16 or data[25] in (4, 6))


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_8bit_strips(data: bytes, w: int, h: int, channels: int, rows: int):
    """(first row, (n, w, channels) uint8 block in the PNG's channel order) of a non-interlaced 8-bit PNG.

    The IDAT stream is inflated a strip at a time (``max_length``: never more than a strip of filtered
    rows in memory); each strip is unfiltered by Pillow as a small PNG whose first row is the previous
    strip's last row, unfiltered (filter type 0), so every filter's reference to the row above is
    exact. Memory: a strip, whatever the image's size.
    """
    from PIL import Image  # noqa: PLC0415

    row_bytes = 1 + w * channels
    ctype = {2: 4, 4: 6}[channels]
    prev = bytes(w * channels)  # the row above the first: zeros, as the PNG filters define it
    inflate = zlib.decompressobj()
    pending = bytearray()
    done = 0
    pos = 8
    while done < h:
        if len(pending) < min(rows, h - done) * row_bytes:
            if inflate.unconsumed_tail:
                pending += inflate.decompress(inflate.unconsumed_tail, rows * row_bytes)
                continue
            if pos + 8 > len(data):
                raise RecordError("corrupt_image", f"the png data ends after {done} of {h} rows")
            length, kind = struct.unpack_from(">I4s", data, pos)
            body = data[pos + 8:pos + 8 + length]
            crc = data[pos + 8 + length:pos + 12 + length]
            pos += 12 + length
            if kind == b"IDAT" and (len(crc) < 4 or struct.unpack(">I", crc)[0] != zlib.crc32(kind + body)):
                raise RecordError("corrupt_image", f"the png data is corrupt: an IDAT chunk fails its CRC after "
                                                   f"{done} of {h} rows")
            if kind == b"IDAT":
                pending += inflate.decompress(body, rows * row_bytes)
            elif kind == b"IEND":
                pos = len(data)
            continue
        n = min(rows, h - done)
        raw = b"\x00" + prev + bytes(pending[:n * row_bytes])
        del pending[:n * row_bytes]
        ihdr = struct.pack(">IIBBBBB", w, n + 1, 8, ctype, 0, 0, 0)
        sub = _PNG_MAGIC + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(raw, 0)) + _png_chunk(b"IEND", b"")
        with Image.open(io.BytesIO(sub), formats=["PNG"]) as im:
            block = np.asarray(im)[1:]
        prev = block[-1].tobytes()
        yield done, block
        done += n


def _decode_png_rows(data: bytes, *, colour: bool) -> np.ndarray:
    """A 16-bit or alpha PNG to 2-D grey (``colour=False``) or (h, w, 3) BGR uint8, alpha over white.

    An 8-bit PNG with alpha (non-interlaced) is decoded a strip of rows at a time
    (:func:`_png_8bit_strips`): the peak is the output and a strip, and the result is OpenCV's, byte for
    byte. Otherwise Pillow's decoder unfilters the PNG a row at a time into an image of 8 bits per
    sample: 16-bit samples keep their high byte (Pillow's ``;16B`` unpackers; OpenCV's path rounded
    ``v * 255 / 65535``: at most one level apart), 16-bit grey is decoded straight to 8-bit ``L`` (Pillow
    would keep ``I;16``). The output is filled a block of rows at a time (:func:`_gray_block`,
    :func:`_bgr_block`), so the peak is Pillow's image plus the output: a 6000x6000 16-bit RGBA PNG
    decodes within 0.63x (grey) and 0.88x (BGR) of its 288 MB decoded-byte budget, was 2.0x
    (bench/bench_png_decode_memory.py).
    """
    import warnings  # noqa: PLC0415

    from PIL import Image  # noqa: PLC0415 - only for these PNGs

    w, h = struct.unpack_from(">II", data, 16)
    depth, ctype, interlace = data[24], data[25], data[28]
    try:
        if depth == 8 and ctype in (4, 6) and interlace == 0:
            channels = 2 if ctype == 4 else 4
            out = np.empty((h, w, 3) if colour else (h, w), np.uint8)
            for r, block in _png_8bit_strips(data, w, h, channels, max(1, _CHUNK // 4 // (w * channels))):
                _fill_block(out, r, block, colour)
            return out
        with warnings.catch_warnings():
            # The size was checked against max_pixels and the decoded-byte budget (_check) before this.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=["PNG"])
            if im.mode == "I;16" and len(im.tile) == 1 and im.tile[0].args == "I;16B":
                im.tile = [im.tile[0]._replace(args="L;16B")]  # 16-bit grey decoded to 8-bit L
                im._mode = "L"
            im.load()
    except Image.DecompressionBombError as exc:
        raise RecordError("image_too_large", f"the png is above Pillow's decompression limit: {exc}") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error) as exc:
        raise RecordError("corrupt_image", f"Pillow could not decode the png data: {str(exc).strip()[:200]}") from None
    try:
        if im.mode not in ("L", "LA", "RGB", "RGBA"):
            im = im.convert("RGBA" if "A" in im.mode else "RGB")  # unusual modes: whole-image, still 8-bit
        channels = len(im.getbands())
        out = np.empty((h, w, 3) if colour else (h, w), np.uint8)
        step = max(1, _CHUNK // 4 // (w * channels))  # a quarter of _CHUNK: its float32 temporaries ~3 MB
        for r in range(0, h, step):
            _fill_block(out, r, np.asarray(im.crop((0, r, w, min(h, r + step)))), colour)
        return out
    finally:
        im.close()


def _fill_block(out: np.ndarray, r: int, block: np.ndarray, colour: bool) -> None:
    """Rows ``r..`` of ``out`` (grey or BGR) from a uint8 block in PNG/Pillow channel order (L, LA, RGB, RGBA)."""
    n = block.shape[0]
    if block.ndim == 2:  # L
        out[r:r + n] = cv2.cvtColor(block, cv2.COLOR_GRAY2BGR) if colour else block
        return
    channels = block.shape[2]
    if channels >= 3:  # RGB(A) to OpenCV's BGR(A) order, this block only
        block = np.ascontiguousarray(block[:, :, [2, 1, 0, 3][:channels]])
    if channels == 3:
        out[r:r + n] = block if colour else cv2.cvtColor(block, cv2.COLOR_BGR2GRAY)
    else:
        out[r:r + n] = _bgr_block(block) if colour else _gray_block(block)


def _check(data: bytes, max_pixels: int) -> tuple[str, tuple[int, int]]:
    if not isinstance(max_pixels, (int, np.integer)) or isinstance(max_pixels, bool) or max_pixels < 1:
        raise ConfigError(f"max_pixels={max_pixels!r} must be an integer >= 1; pass the pixel limit per image")
    if len(data) == 0:
        raise RecordError("empty_file", "the file has zero bytes")
    fmt = sniff_format(data)
    if fmt is None:
        raise RecordError(
            "unsupported_format",
            f"the content starts with {bytes(data[:8])!r}, which is none of JPEG, PNG, PNM, GIF, BMP, TIFF",
        )
    size = header_size(data)
    if size is None:
        raise RecordError("corrupt_image", f"the {fmt} header is unreadable: the image size could not be read")
    w, h = size
    if w <= 0 or h <= 0:
        raise RecordError("corrupt_image", f"the {fmt} header declares an empty image ({w}x{h})")
    if w * h > max_pixels:
        raise RecordError(
            "image_too_large",
            f"the {fmt} header declares {w}x{h} = {w * h} pixels, above max_pixels={max_pixels}",
        )
    need, limit = decoded_bytes(data), max_decoded_bytes(max_pixels)
    if need is not None and need > limit:
        raise RecordError(
            "image_too_large",
            f"decoding the {fmt} needs {need} bytes (width x height x channels x bytes per sample), "
            f"above {limit} (3 bytes per pixel of max_pixels={max_pixels})",
        )
    if fmt == "jpeg" and _jpeg_truncated(data):
        raise RecordError("corrupt_image", "the JPEG is truncated: no end-of-image marker after the scan data")
    if fmt == "png" and b"IEND" not in data[-64:]:
        raise RecordError("corrupt_image", "the PNG is truncated: no IEND chunk at the end")
    return fmt, size


def _imdecode(data: bytes, flags: int, fmt: str) -> np.ndarray:
    _quiet_opencv()
    buf = np.frombuffer(data, dtype=np.uint8)
    try:
        img = cv2.imdecode(buf, flags)
    except cv2.error as exc:
        raise RecordError("corrupt_image", f"OpenCV could not decode the {fmt} data: {str(exc).strip()[:200]}") from None
    if img is None or img.size == 0:
        raise RecordError("corrupt_image", f"OpenCV could not decode the {fmt} data (truncated or corrupt)")
    return img


def decode_gray(data: bytes, *, max_pixels: int = 100_000_000) -> np.ndarray:
    """Decode image bytes to a 2-D uint8 grey array, upright per EXIF orientation.

    16-bit images are scaled to 8 bits and transparency is composited over white.
    Raises ``RecordError`` with code empty_file, unsupported_format, image_too_large or corrupt_image.
    """
    fmt, (w, h) = _check(data, max_pixels)
    if fmt == "jpeg":
        # JPEG has no alpha and (in practice) 8 bits; IMREAD_GRAYSCALE applies the EXIF orientation.
        img = _imdecode(data, cv2.IMREAD_GRAYSCALE, fmt)
    elif _streams_png(data):
        img = _apply_orientation(_decode_png_rows(data, colour=False), exif_orientation(data))
    else:
        # UNCHANGED keeps alpha and 16 bits but skips the orientation, which is applied below.
        img = _imdecode(data, cv2.IMREAD_UNCHANGED, fmt)
        img = _apply_orientation(_to_gray(img), exif_orientation(data))
    if img.shape[0] * img.shape[1] > max_pixels:
        raise RecordError("image_too_large", f"the decoded image is {img.shape[1]}x{img.shape[0]}, above max_pixels={max_pixels}")
    return np.ascontiguousarray(img)


def decode_gray_reduced(data: bytes, factor: int, *, max_pixels: int = 100_000_000) -> np.ndarray:
    """Grey image downscaled about ``factor`` times (1, 2, 4 or 8); JPEG is decoded directly at that scale.

    The size is ``ceil(full / factor)`` for JPEG, upright per EXIF orientation like :func:`decode_gray`
    (OpenCV applies it to reduced decodes too); other formats are decoded in full and area-resized to
    the same size. The decompression-bomb and truncation checks run on the header before decoding.
    """
    if factor not in _REDUCED_FLAGS:
        raise ConfigError(f"factor={factor!r} must be one of 1, 2, 4, 8; use 1 for the full image")
    fmt, (w, h) = _check(data, max_pixels)
    if fmt == "jpeg":
        return _imdecode(data, _REDUCED_FLAGS[factor], fmt)
    img = decode_gray(data, max_pixels=max_pixels)
    if factor == 1:
        return img
    hh, ww = img.shape
    size = (-(-ww // factor), -(-hh // factor))
    return cv2.resize(img, size, interpolation=cv2.INTER_AREA)


def decode_color_reduced(data: bytes, factor: int, *, max_pixels: int = 100_000_000) -> np.ndarray:
    """Colour (h, w, 3) uint8 BGR image downscaled ``factor`` times: the same size and orientation as
    :func:`decode_gray_reduced` gives for the same bytes, so one alignment transform fits both.

    Grey sources come back with three equal channels; alpha is composited over white.
    """
    if factor not in _REDUCED_COLOR_FLAGS:
        raise ConfigError(f"factor={factor!r} must be one of 1, 2, 4, 8; use 1 for the full image")
    fmt, _ = _check(data, max_pixels)
    if fmt == "jpeg":
        img = _to_bgr(_imdecode(data, _REDUCED_COLOR_FLAGS[factor], fmt))  # applies the EXIF orientation
    else:
        img = _decode_png_rows(data, colour=True) if _streams_png(data) else _to_bgr(_imdecode(data, cv2.IMREAD_UNCHANGED, fmt))
        img = _apply_orientation(img, exif_orientation(data))
        if img.shape[0] * img.shape[1] > max_pixels:
            raise RecordError("image_too_large", f"the decoded image is {img.shape[1]}x{img.shape[0]}, above max_pixels={max_pixels}")
        if factor > 1:
            hh, ww = img.shape[:2]
            img = cv2.resize(img, (-(-ww // factor), -(-hh // factor)), interpolation=cv2.INTER_AREA)
    return np.ascontiguousarray(img)


# A pixel is coloured when its channels differ by more than COLOUR_TOLERANCE grey levels (JPEG chroma
# noise of a grey photo saved as RGB stays within a few levels); an image is colour when more than
# COLOUR_MIN_FRACTION of its pixels are (a grey photo with a coloured logo or border is not).
COLOUR_TOLERANCE = 12
COLOUR_MIN_FRACTION = 0.05


def is_colour(data: bytes, *, max_pixels: int = 100_000_000) -> bool:
    """Is the image really colour (channels differ beyond :data:`COLOUR_TOLERANCE` on enough pixels)?

    Decoded at 1/8 scale (JPEG: libjpeg's DCT scaling, ~1 ms for a 1350 px photo): colour is a
    property of the whole image, not of its detail. Single-channel formats are grey.
    """
    bgr = decode_color_reduced(data, 8 if sniff_format(data) == "jpeg" else 1, max_pixels=max_pixels)
    if bgr.ndim != 3 or bgr.shape[2] < 3 or bgr.size == 0:
        return False
    c = bgr.astype(np.int16)
    spread = np.maximum(np.abs(c[..., 0] - c[..., 1]), np.maximum(np.abs(c[..., 1] - c[..., 2]),
                                                                  np.abs(c[..., 0] - c[..., 2])))
    return float(np.mean(spread > COLOUR_TOLERANCE)) > COLOUR_MIN_FRACTION
