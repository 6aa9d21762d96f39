"""Run each call of a region on the backend a plan chose for the call's batch bucket.

`BucketDispatch(name, batch_of, choices)` stands in for one region's backend (models.region_backends:
installed with `set_region_backend`, the same call and results as the backends it holds). `choices` lists
(largest batch, label, backend) per bucket in increasing order; a call goes to the first bucket that holds
its batch, and a call above the largest bucket to the largest bucket's backend (the plan's choice for its
heaviest load), counted apart so that a report can say how often that happened. Imports: stdlib only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

__all__ = ["BucketDispatch"]


class BucketDispatch:
    def __init__(self, name: str, batch_of: Callable[..., int], choices: Sequence[tuple[int, str, Callable]]) -> None:
        if not choices:
            raise ValueError(f"region {name}: a dispatch needs at least one bucket")
        batches = [batch for batch, _, _ in choices]
        if batches != sorted(set(batches)) or batches[0] < 1:
            raise ValueError(f"region {name}: buckets must be positive and increasing, got {batches}")
        self.name = name
        self.batch_of = batch_of
        self.choices = tuple(choices)
        self.calls: Counter[tuple[int, str]] = Counter()  # (bucket, label) -> calls it took
        self.num_above_largest = 0

    def choice(self, batch: int) -> tuple[int, str, Callable]:
        for choice in self.choices:
            if batch <= choice[0]:
                return choice
        return self.choices[-1]

    def __call__(self, *args, **kwargs):
        batch = self.batch_of(*args, **kwargs)
        bucket, label, backend = self.choice(batch)
        if batch > bucket:
            self.num_above_largest += 1
        self.calls[(bucket, label)] += 1
        return backend(*args, **kwargs)
