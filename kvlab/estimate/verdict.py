"""The one rule every predicted-against-measured report applies: the error is the measured
figure's distance from the predicted one, in percent of the prediction, and a figure misses
when that distance is more than its tolerance (a share of the prediction)."""

from __future__ import annotations

import math


def error_percent(predicted: float | None, measured: float) -> float:
    """(measured - predicted) / predicted x 100; NaN without a prediction."""
    return (measured - predicted) / predicted * 100 if predicted else math.nan


def misses(predicted: float | None, measured: float, tolerance: float) -> bool:
    """Whether `measured` is further from `predicted` than `tolerance` x predicted."""
    return bool(predicted) and abs(measured - predicted) > tolerance * predicted
