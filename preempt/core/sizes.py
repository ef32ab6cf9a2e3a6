"""Byte sizes as users write them on the command line ("4GB", "256MB", "512MiB").

Owns: parsing and formatting sizes. Torch-free, so the config can validate sizes without
importing the host pool.
"""

from __future__ import annotations

import re

import numpy as np

_DECIMAL_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
}
_BINARY_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in a size such as "4GB", "256MB", "512MiB", "1.5GiB", "1024" or an int.

    GB/MB/KB (and bare G/M/K) are decimal (1000^n), GiB/MiB/KiB binary (1024^n), as the flags
    `--preemption-host-mem 4GB` read to a user. Case-insensitive; spaces allowed. A fractional
    result must still be a whole number of bytes ("1.5KiB" yes, "1.5B" no).
    """
    if isinstance(text, bool):  # bool is an int subclass; True bytes is a bug, not a size
        raise ValueError(f"invalid size {text!r}: expected a number of bytes or a string like '4GB'")
    if isinstance(text, (int, np.integer)):
        if text < 0:
            raise ValueError(f"invalid size {text!r}: must be >= 0")
        return int(text)
    if not isinstance(text, str):
        raise ValueError(f"invalid size {text!r}: expected a number of bytes or a string like '4GB'")
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    multiplier = _DECIMAL_UNITS.get(unit) or _BINARY_UNITS.get(unit)
    if match is None or multiplier is None:
        raise ValueError(
            f"invalid size {text!r}: expected a number with an optional unit "
            "B, KB, MB, GB, TB (x1000) or KiB, MiB, GiB, TiB (x1024), e.g. '4GB' or '512MiB'"
        )
    number = match.group(1)
    if "." not in number:
        return int(number) * multiplier
    # Exact decimal arithmetic: float("1.1") * 10**9 is not a whole number of bytes.
    whole, frac = number.split(".")
    numerator = int(whole or "0") * 10 ** len(frac) + int(frac or "0")
    nbytes, remainder = divmod(numerator * multiplier, 10 ** len(frac))
    if remainder:
        raise ValueError(f"invalid size {text!r}: not a whole number of bytes")
    return nbytes


def format_size(nbytes: int, *, binary: bool = False) -> str:
    """Human size: decimal units by default ("4.0 GB", "256 MB"), as users write the flags."""
    if binary:
        base, units = 1024, ["B", "KiB", "MiB", "GiB", "TiB"]
    else:
        base, units = 1000, ["B", "KB", "MB", "GB", "TB"]
    value = float(nbytes)
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            break
        value /= base
    if unit == "B":
        return f"{int(nbytes)} B"
    return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.1f} {unit}"
