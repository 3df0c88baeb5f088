"""dlib's pretrained models, one instance per thread: the ResNet recogniser, the 5-point landmarks, the HOG detector.

The lowest layer that uses them (eye finding, :mod:`deid.alignment.eyes`) owns the loader; the
recogniser (:mod:`deid.evaluation.recognizer`), identity resolution and the workers' warm-up load
through it. The model files come from the pinned ``face-recognition-models`` package (never
downloaded at run time).

References
----------
D. E. King. Dlib-ml: A machine learning toolkit. JMLR 10:1755-1758, 2009.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from deid.errors import EnvironmentFailure

logger = logging.getLogger(__name__)

__all__ = ["dlib_model"]

# dlib models keep per-call state (the network stores each layer's output, the detectors scratch
# buffers), so one instance must not serve two threads at once (Dask workers run several): loaded
# lazily, once per thread (0.1-0.3 s each).
_models = threading.local()


def dlib_model(kind: str) -> Any:
    """dlib model of this thread: 'recognizer' (ResNet), 'shape5' (5-point landmarks) or 'hog' (face detector)."""
    cache: dict[str, Any] | None = getattr(_models, "cache", None)
    if cache is None:
        cache = _models.cache = {}
    model = cache.get(kind)
    if model is not None:
        return model
    try:
        import dlib  # noqa: PLC0415 - optional heavy import, only when a model is used
        import face_recognition_models as frm  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - both are pinned dependencies
        raise EnvironmentFailure(
            f"the dlib recogniser needs the pinned packages dlib-bin and face-recognition-models ({exc}); "
            "install the project's dependencies (pip install -e .)"
        ) from None
    if kind == "recognizer":
        model = dlib.face_recognition_model_v1(frm.face_recognition_model_location())
    elif kind == "shape5":
        model = dlib.shape_predictor(frm.pose_predictor_five_point_model_location())
    elif kind == "hog":
        model = dlib.get_frontal_face_detector()
    else:
        raise ValueError(f"unknown dlib model {kind!r}")
    cache[kind] = model
    logger.debug("loaded dlib model %s", kind)
    return model
