"""Head pose (yaw) of a face from dlib's 5-point landmarks, for the pose quarantine of the align stage.

Roll is removed by the eye alignment; pitch does not ghost averages the way yaw does. Yaw is read
from how far the base of the nose stands off the eyes' midpoint along the eye line, under weak
perspective with a rigid anthropometric face model (Gee & Cipolla, 1994, "Determining the gaze of
faces in images"): a nose base ``NOSE_DEPTH_RATIO`` inter-ocular distances in front of the eye
centres appears shifted by ``NOSE_DEPTH_RATIO * tan(yaw)`` projected inter-ocular distances.
"""
from __future__ import annotations

import math

import numpy as np

from deid.alignment.eyes import EyePair, HaarEyeDetector, five_points

__all__ = ["NOSE_DEPTH_RATIO", "estimate_yaw", "yaw_from_points"]

# Depth of the nose base (subnasale) in front of the eye centres, in inter-ocular distances: about
# 3 cm for 6.3 cm between the pupils (Gee & Cipolla's model, ratio nose depth / eye-mouth 0.6 with
# eye-mouth ~1.1 IOD, less the nose tip's overhang). Approximate: the estimate is a pose *spread*, not
# a calibrated angle; synthetic drops draw their faces with the same ratio (deid.intake.synth_face._NOSE_DEPTH).
NOSE_DEPTH_RATIO = 0.5


def yaw_from_points(points: np.ndarray) -> float:
    """Yaw in degrees from dlib's 5 points ((5, 2): right-eye corners, left-eye corners, nose base).

    Positive: the nose points towards the image's right. NaN when the eye corners coincide.
    """
    p = np.asarray(points, dtype=np.float64)
    left, right, nose = p[2:4].mean(axis=0), p[0:2].mean(axis=0), p[4]
    axis = right - left
    iod = float(np.hypot(*axis))
    if not iod > 0:
        return float("nan")
    offset = float(np.dot(nose - (left + right) / 2, axis / iod)) / iod
    return math.degrees(math.atan(offset / NOSE_DEPTH_RATIO))


def estimate_yaw(gray: np.ndarray, eyes: EyePair) -> float:
    """Yaw in degrees of the face whose pupils are ``eyes`` in ``gray`` (see :func:`yaw_from_points`).

    The landmarks are predicted in the box dlib's HOG detector would give that face
    (:attr:`HaarEyeDetector.HOG_BOX_FROM_EYES`, placed on the pupils): the regression trees were
    trained on such boxes. About 0.6 ms per face on one core.
    """
    e = eyes.ordered()
    d = e.distance
    mx, my = (e.left[0] + e.right[0]) / 2, (e.left[1] + e.right[1]) / 2
    ox, oy, bw, bh = HaarEyeDetector.HOG_BOX_FROM_EYES
    return yaw_from_points(five_points(gray, (mx + ox * d, my + oy * d, bw * d, bh * d)))
