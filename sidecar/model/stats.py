"""Streaming count, mean and standard deviation (Welford), mergeable and serialisable."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Welford:
    """Running statistics over every value added; the std is the sample standard deviation
    (n − 1 in the denominator, as pandas' ``Series.std()``), the reference's formula.
    """

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, value: float) -> None:
        """Add one value (any unit; the caller keeps units consistent)."""
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)

    def merge(self, count: int, mean: float, m2: float) -> None:
        """Add the figures of another set of values (``count`` values of mean ``mean`` and
        sum of squared deviations ``m2``): Chan et al.'s parallel formula, as if each value
        had been added."""
        if count <= 0:
            return
        total = self.count + count
        delta = mean - self.mean
        self.mean += delta * count / total
        self.m2 += m2 + delta * delta * self.count * count / total
        self.count = total

    @property
    def std(self) -> float:
        """Sample standard deviation (ddof=1); 0.0 for fewer than two values."""
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 0.0

    def to_list(self) -> list[float]:
        """``[count, mean, m2]`` for the state file."""
        return [self.count, self.mean, self.m2]

    @classmethod
    def from_list(cls, values: list[float]) -> Welford:
        """Inverse of ``to_list``; ValueError when it is not three numbers."""
        count, mean, m2 = values
        return cls(int(count), float(mean), float(m2))
