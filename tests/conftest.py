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
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
