"""Anonymisation: k-Same clustering, label partitions, distinct people and the de-identification methods."""
