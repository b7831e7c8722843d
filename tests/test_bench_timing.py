"""The benchmarks' timing window holds enough calls for a stable median, on the CPU (the timing
itself needs a GPU)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
from _timing import MIN_REPS, rep_window_ms  # noqa: E402


def test_short_calls_keep_the_window():
    assert rep_window_ms(0.05, 200) == 200
    assert rep_window_ms(0.0, 200) == 200


def test_long_calls_widen_it_to_the_minimum_count():
    # A 27 ms step fits 7 calls in 200 ms; the window grows to MIN_REPS of them.
    assert rep_window_ms(27.0, 200) == pytest.approx(MIN_REPS * 27.0)
    assert rep_window_ms(27.0, 200) / 27.0 >= MIN_REPS
    assert rep_window_ms(10.0, 200, min_reps=5) == 200
    assert rep_window_ms(100.0, 200, min_reps=5) == 500


@pytest.mark.parametrize("args", [(-1.0, 200), (1.0, 0), (1.0, 200, 0)])
def test_nonsense_is_refused(args):
    with pytest.raises(ValueError, match="estimate_ms"):
        rep_window_ms(*args)
