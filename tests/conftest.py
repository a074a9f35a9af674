"""Shared pytest configuration: hypothesis profiles and common fixtures."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# `ci`: a fixed, reproducible example budget (hundreds per property, derandomized so a
# red CI reproduces locally); `dev`: quicker local runs.
settings.register_profile(
    "ci",
    max_examples=300,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=50, deadline=None)
# `properties` (make properties): 10x the ci budget, for a deeper search before a release.
settings.register_profile(
    "properties",
    parent=settings.get_profile("ci"),
    max_examples=3000,
)
# `mutation` (make mutation): every mutant reruns the properties; a small fixed budget
# keeps one run within minutes while still drawing every branch of the strategies.
settings.register_profile(
    "mutation",
    parent=settings.get_profile("ci"),
    max_examples=8,
    print_blob=False,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
