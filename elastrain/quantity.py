"""Quantities as Kubernetes writes them ("500m", "2", "16Gi", "1.5"), exact.

Shared by the Kubernetes rendering (CPU and memory requests) and the
coordinator's memory budget (`--memory-per-member 16Gi`); imports nothing of
elastrain.
"""

from __future__ import annotations

import re
from fractions import Fraction

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(m|k|Ki|Mi|Gi|Ti|Pi|M|G|T|P)?$")
_SUFFIX = {
    None: Fraction(1),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
}


def parse_quantity(q: str) -> Fraction:
    """A Kubernetes resource quantity ("500m", "2", "16Gi", "1.5") as an exact number.

    Only the plain decimal forms with the usual suffixes; raises ValueError otherwise.
    """
    m = _QUANTITY.match(q.strip())
    if not m:
        raise ValueError(
            f"{q!r} is not a Kubernetes quantity; use e.g. '500m' or '2' (CPU), '4Gi' (memory)"
        )
    return Fraction(m.group(1)) * _SUFFIX[m.group(2)]


def format_quantity(x: Fraction, binary: bool) -> str:
    """The shortest exact quantity string for x ("3", "2500m", "18Gi", "1536Mi")."""
    if binary:
        for suf in ("Pi", "Ti", "Gi", "Mi", "Ki"):
            v = x / _SUFFIX[suf]
            if v.denominator == 1 and v >= 1:
                return f"{v.numerator}{suf}"
    if x.denominator == 1:
        return str(x.numerator)
    v = x * 1000
    if v.denominator == 1:
        return f"{v.numerator}m"
    return str(float(x))
