"""Alignment: eye detection, warping to the canonical face, alignment accuracy and eigenface features."""
