"""Numbers at a size people read: ``1.2 M`` parameters, ``180.7 KiB``, ``3.1 ms`` (never ``0.00 B``)."""


def count(n: float) -> str:
    """``n`` with a K, M or B suffix (parameters, tokens)."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:g}"


def size(nbytes: float) -> str:
    """``nbytes`` in B, KiB, MiB or GiB, whichever reads best."""
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes:,.0f} B"


def seconds(t: float) -> str:
    """``t`` seconds in s, ms or µs, whichever reads best."""
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(t) >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t * 1e9:.3g} ns" if t else "0 s"
