"""Timing helper shared by the benchmarks."""

import statistics
import time


def median_seconds(function, repeats):
    """Median wall time of `repeats` calls, after one warm-up (and compilation) call."""
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
