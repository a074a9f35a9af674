"""How long a writer's connection may stall (``BackendOptions.stall_limit_s``).

A push producer's backend opens with its ``transfer_timeout_s`` as the stall limit,
which NIXL's UCX backend gets as ``UCX_TCP_USER_TIMEOUT`` while the agent is created:
a WRITE cut by a dead link then ends, its bytes with it, instead of waiting for TCP to
give up or resume (tests/test_link_down_proc.py, ``push-cut-by-producer``, shows it
between two hosts). Other agents keep the transport's default, and an operator's own
value wins.
"""

from __future__ import annotations

import os

import pytest

from kvxfer.agent import AgentConfig
from kvxfer.backends import _nixl
from kvxfer.core.compat import Fingerprint
from kvxfer.errors import ConfigError
from kvxfer.registry import get_backend
from kvxfer.types import Direction, Role

VAR = "UCX_TCP_USER_TIMEOUT"


def _config(role: Role, direction: Direction, **kw: object) -> AgentConfig:
    fp = Fingerprint(
        model="m",
        dtype="bfloat16",
        kv_cache_dtype="bfloat16",
        attention_backend="t",
        direction=direction,
    )
    return AgentConfig(engine_id="e", fingerprint=fp, role=role, direction=direction, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("role", "direction", "limit"),
    [
        (Role.PRODUCER, Direction.PUSH, 12.5),
        (Role.BOTH, Direction.PUSH, 12.5),
        (Role.CONSUMER, Direction.PUSH, None),
        (Role.PRODUCER, Direction.PULL, None),
        (Role.BOTH, Direction.PULL, None),
    ],
)
def test_only_a_writer_opens_its_backend_with_its_deadline_as_the_stall_limit(
    role: Role, direction: Direction, limit: float | None
) -> None:
    config = _config(
        role,
        direction,
        transfer_timeout_s=12.5,
        rails=("mlx5_0:1",),
        stripe_width=0,
        backend_extra={"transport": "ucx"},
    )
    options = config.backend_options("agent-1")
    assert config.stall_limit_s == options.stall_limit_s == limit
    assert (options.agent_name, options.rails, options.stripe_width) == (
        "agent-1",
        ("mlx5_0:1",),
        0,
    )
    assert options.extra == {"transport": "ucx"}


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A copy of the environment without the variable (nothing leaks to other tests)."""
    env = {k: v for k, v in os.environ.items() if k != VAR}
    monkeypatch.setattr(os, "environ", env)
    return env


def test_the_limit_is_set_while_the_agent_is_created_and_removed_after(
    environ: dict[str, str],
) -> None:
    with _nixl.stall_limit(12.5):
        assert environ[VAR] == "12500ms"  # what UCX reads when it creates the transport
    assert VAR not in environ  # the process's next agent (a consumer, say) keeps its own
    with pytest.raises(RuntimeError), _nixl.stall_limit(0.0001):
        assert environ[VAR] == "1ms"  # never 0, which UCX would read as "no limit"
        raise RuntimeError("the agent could not start")
    assert VAR not in environ


@pytest.mark.parametrize("own", ["5s", "12.5", "12500ms", "3000000us", " 10S "])
def test_no_limit_and_an_operators_shorter_value_leave_the_environment_alone(
    environ: dict[str, str], own: str
) -> None:
    with _nixl.stall_limit(None):
        assert VAR not in environ
    environ[VAR] = own
    with _nixl.stall_limit(12.5):
        assert environ[VAR] == own
    assert environ[VAR] == own


@pytest.mark.parametrize("own", ["90s", "12501ms", "inf", "auto", "2m", "0", "-1s", "nan", ""])
def test_an_operators_value_longer_than_the_limit_or_unreadable_is_refused_by_name(
    environ: dict[str, str], own: str
) -> None:
    # The producer announces its limit and its consumers wait that long after it died;
    # a socket that lives longer could deliver after they stopped waiting.
    environ[VAR] = own
    with pytest.raises(ConfigError) as err, _nixl.stall_limit(12.5):
        pass
    assert err.value.key == VAR and err.value.value == own
    assert "at most its transfer_timeout_s (12.5 s" in err.value.rule
    with _nixl.stall_limit(None):  # a consumer's backend takes any value
        assert environ[VAR] == own


@pytest.mark.proc  # imports NIXL and starts its UCX agent
@pytest.mark.parametrize("own", ["90s", "5s"], ids=["longer", "shorter"])
def test_a_ucx_push_producer_with_a_longer_operator_value_does_not_start(
    monkeypatch: pytest.MonkeyPatch, own: str
) -> None:
    """What an operator sees at start (the agent's backend is opened here). The real
    environment, which UCX reads too (restored after)."""
    monkeypatch.setenv(VAR, own)
    options = _config(Role.PRODUCER, Direction.PUSH, transfer_timeout_s=30.0).backend_options(
        f"stall-{own}"
    )
    backend_class = get_backend("ucx")
    if own == "90s":
        with pytest.raises(ConfigError, match=r"UCX_TCP_USER_TIMEOUT='90s': a push producer's"):
            backend_class(options)
    else:
        backend_class(options).close()
