"""Benchmark helpers: every benchmark times its physical baseline in the same run.

``compare(name, subject, baseline, nbytes=..., rounds=...)`` times ``subject`` through
pytest-benchmark and ``baseline`` by hand, one baseline round before each subject round
(interleaved, so that drift on a shared machine hits both alike), records both medians and
their ratio in ``extra_info``, and the session ends with a table of every comparison. The
machine is shared and noisy: read medians and ratios, not single figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass
class Comparison:
    name: str
    subject_s: float
    baseline_s: float
    baseline_name: str
    nbytes: int | None
    unit: str

    @property
    def ratio(self) -> float:
        """Subject speed relative to the baseline (1.0 = as fast, above 1 = faster)."""
        return self.baseline_s / self.subject_s

    def row(self) -> str:
        if self.nbytes:
            figures = (
                f"{self.nbytes / self.subject_s / 1e9:8.2f} GB/s  vs "
                f"{self.nbytes / self.baseline_s / 1e9:8.2f} GB/s"
            )
        else:
            figures = f"{self.subject_s * 1e6:8.1f} us    vs {self.baseline_s * 1e6:8.1f} us   "
        return f"{self.name:<44} {figures}  ({self.baseline_name})  ratio {self.ratio:5.2f}"


_RESULTS: list[Comparison] = []
_EXTRA_LINES: list[str] = []
"""Rows that are not a single comparison (latency percentiles), for the summary."""


def _median_seconds(fn: Callable[[], Any], rounds: int, setup: Callable[[], Any] | None) -> float:
    times = []
    for _ in range(rounds):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@pytest.fixture
def compare(benchmark: Any) -> Callable[..., Comparison]:
    def run(
        name: str,
        subject: Callable[[], Any],
        baseline: Callable[[], Any],
        *,
        baseline_name: str,
        nbytes: int | None = None,
        rounds: int = 20,
        setup: Callable[[], Any] | None = None,
        warmup: int = 2,
    ) -> Comparison:
        for _ in range(warmup):
            if setup is not None:
                setup()
            subject()
            baseline()
        baseline_times: list[float] = []

        def pedantic_setup() -> None:
            baseline_times.append(_median_seconds(baseline, 1, None))
            if setup is not None:
                setup()

        benchmark.pedantic(subject, setup=pedantic_setup, rounds=rounds, iterations=1)
        baseline_s = statistics.median(baseline_times)
        subject_s = benchmark.stats.stats.median if benchmark.stats else float("nan")
        result = Comparison(name, subject_s, baseline_s, baseline_name, nbytes, "s")
        benchmark.extra_info.update(
            baseline=baseline_name,
            baseline_median_s=baseline_s,
            subject_median_s=subject_s,
            ratio=result.ratio,
        )
        if nbytes:
            benchmark.extra_info["subject_GBps"] = nbytes / subject_s / 1e9
            benchmark.extra_info["baseline_GBps"] = nbytes / baseline_s / 1e9
        _RESULTS.append(result)
        print("\n" + result.row())
        return result

    return run


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _RESULTS:
        return
    terminalreporter.section("kvbridge vs baseline (medians; ratio = baseline time / ours)")
    for result in _RESULTS:
        terminalreporter.write_line(result.row())
    for line in _EXTRA_LINES:
        terminalreporter.write_line(line)
