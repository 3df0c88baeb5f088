"""Evaluation and the gate: re-identification attacks, recognisers, utility, leaks, data validation, study."""
