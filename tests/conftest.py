"""Hypothesis profiles of the property and fuzz tests (docs/architecture.md "Correctness"), and the
fixtures several test files share.

``default``: derandomized, so a run of the default tier draws the same examples on every machine and CI
is reproducible; few examples. ``heavy``: random seeds and twenty times the examples, for the tests
marked ``heavy`` (``python -m pytest -q -m heavy``) or for every hypothesis test when
``HYPOTHESIS_PROFILE=heavy`` is set. A test worth more or less than the profile's unit of examples
takes ``examples(share)``.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, settings
from torch.testing._internal.distributed.fake_pg import FakeStore

DEFAULT_EXAMPLES = 20
HEAVY_EXAMPLES = 20 * DEFAULT_EXAMPLES

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("default", derandomize=True, max_examples=DEFAULT_EXAMPLES, **_COMMON)
settings.register_profile("heavy", derandomize=False, max_examples=HEAVY_EXAMPLES, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def examples(share: float, profile: str | None = None) -> settings:
    """Settings for a test that runs ``share`` of ``profile``'s examples (at least one); ``profile`` defaults
    to the loaded one, ``"heavy"`` is what the heavy variant of a test names."""
    base = settings.get_profile(profile) if profile else settings()
    return settings(base, max_examples=max(1, round(base.max_examples * share)))


@pytest.fixture(scope="module")
def two_fake_ranks() -> Iterator[None]:
    """A 2-rank process group whose collectives do nothing: enough to build a plan's meshes in one process."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()
