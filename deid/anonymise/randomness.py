"""A release's random state: secret unless fixed, and what the gate's parrot attacker is assumed to know.

The one policy the release flow, the gate and ``deid study`` share. Random methods (the sets of
selective-mean, the donors of attribute-preserving k-Same, the eigenface subsample above
``max_fit_samples``) draw from the release's seed. The attacker knows the method and its
parameters (Kerckhoffs' principle), not the seed: each release draws its seed from the OS,
the steward keeps it only in the private linkage record (:mod:`deid.release.linkage`, sealed
with the linkage key), and the parrot attacker re-runs the method with a fresh independent seed.
``DEID_SEED`` (tests, reproductions) fixes the seed: it is then not secret, the report says so,
and the parrot uses that same seed.

References
----------
E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images. IEEE TKDE
17(2):232-243, 2005 (the parrot attacker). A. Kerckhoffs. La cryptographie militaire. 1883.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

# Bits of an OS-drawn seed: every random_state the methods pass on (NumPy's legacy RandomState,
# scikit-learn) takes integers below 2**32.
SEED_BITS = 31


@dataclass(frozen=True)
class ReleaseSeed:
    """The seed a release's method draws from, and whether it is secret.

    Attributes
    ----------
    value : int
        The seed (never logged: ``repr=False``; never written to a release or a report).
    fixed : bool
        True: set by ``DEID_SEED`` (or ``deid study --seed``), not secret.
    """

    value: int = field(repr=False)
    fixed: bool = False

    @classmethod
    def draw(cls, fixed: int | None = None) -> ReleaseSeed:
        """The seed of one release: ``fixed`` if given (not secret), else drawn from the OS (``secrets``)."""
        if fixed is not None:
            return cls(int(fixed), True)
        return cls(secrets.randbits(SEED_BITS), False)

    def for_parrot(self) -> int:
        """The seed the parrot attacker re-runs the method with.

        The attacker knows the method and its parameters, not a secret seed: a fresh seed drawn
        from the OS, independent of the release's. A fixed seed is assumed known: the same one.
        """
        return self.value if self.fixed else secrets.randbits(SEED_BITS)

    @property
    def statement(self) -> str:
        """What the report says about the release's randomness (never the seed's value)."""
        if self.fixed:
            return ("seed fixed: not secret (DEID_SEED is set, for tests and reproductions); the parrot attacker "
                    "re-ran the method with that same seed")
        return ("secret: drawn from the OS for this release and kept only in the steward's private linkage record; "
                "the parrot attacker knows the method and its parameters, not the seed, and re-ran the method with "
                "an independent seed")

    def to_report(self) -> dict[str, object]:
        """The report's ``configuration.randomness``: whether the seed was fixed and what that means."""
        return {"seed_fixed": self.fixed, "statement": self.statement}

    def to_linkage(self) -> dict[str, object]:
        """What the private linkage record keeps: the value, so the steward can reproduce the release."""
        return {"value": self.value, "fixed": self.fixed}
