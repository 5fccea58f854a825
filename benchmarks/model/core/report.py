"""Formatting shared by the model's reports: every prediction is printed as
its band, 'point (low-high)' in milliseconds, and its bound is the largest
term of the time model (timing.py).
"""
from . import timing as T


def fmt_ms(x):
    return f"{x * 1e3:.4g}"


def band_ms(records, gpu, s, dtype, causal):
    """'point (low-high)' in ms: every prediction is printed as its band (timing.predict_band)."""
    low, point, high = T.predict_band(records, gpu, s, dtype, causal)
    return f"{fmt_ms(point)} ({fmt_ms(low)}-{fmt_ms(high)})"


def bound(terms):
    return max(terms, key=terms.get)
