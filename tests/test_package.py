"""The package surface: light import, one error root, exported names, layout of folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvxfer
from kvxfer import errors

HEAVY = ("nixl", "torch", "zmq", "pyverbs", "vllm", "nixl_rbln")


def test_import_kvxfer_is_light() -> None:
    code = (
        "import sys, kvxfer, kvxfer.core.layout, kvxfer.core.descriptors, kvxfer.core.compat, "
        "kvxfer.core.wire, "
        "kvxfer.core.handshake, kvxfer.types, kvxfer.agent, kvxfer.cli; "
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"import kvxfer pulled in {out.stdout.strip()}"


def test_every_public_name_resolves() -> None:
    for name in kvxfer.__all__:
        assert getattr(kvxfer, name) is not None, name
    with pytest.raises(AttributeError):
        kvxfer.NoSuchThing  # noqa: B018


def test_one_error_root() -> None:
    classes = [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)]
    assert all(issubclass(c, errors.KvxferError) for c in classes)
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.HandshakeTimeout, TimeoutError)
    assert issubclass(errors.PeerError, ConnectionError)
    assert issubclass(errors.MissingDependency, ImportError)
    err = errors.ConfigError("kv_role", "x", "must be one of a, b")
    assert "kv_role" in str(err) and "'x'" in str(err) and "must be" in str(err)


def test_backends_and_adapters_join_the_namespace() -> None:
    import kvxfer.adapters
    import kvxfer.backends

    assert kvxfer.backends.__name__ == "kvxfer.backends"
    assert kvxfer.adapters.__name__ == "kvxfer.adapters"
    assert "backends" not in sys.modules, "the top-level folder was imported as a second copy"


def test_registry_finds_builtin_backends() -> None:
    from kvxfer.registry import available_backends, get_backend

    names = available_backends()
    for name in ("ucx", "host_bounce", "nixl_rbln", "fake"):
        assert name in names
    assert get_backend("ucx").name == "ucx"
    with pytest.raises(errors.BackendNotFound) as info:
        get_backend("no-such-backend")
    assert "ucx" in str(info.value)


def test_missing_dependency_names_the_extra() -> None:
    err = errors.missing_dependency("nixl", "nixl")
    assert "pip install 'kvxfer[nixl]'" in str(err)
    assert isinstance(err, ImportError)


def test_cli_help_lists_every_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "--help"], capture_output=True, text=True, check=True
    )
    for cmd in ("demo", "bench", "probe", "doctor", "proxy"):
        assert cmd in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "nope"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown command" in bad.stderr


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--from-json", "{saved}"]])
def test_cli_stops_quietly_when_its_reader_went_away(argv: list[str], tmp_path: Path) -> None:
    # `kvxfer bench --from-json run.jsonl | head`: the reader closed before the command
    # wrote. (A saved run's report: a bench that measures would take seconds to write.)
    saved = tmp_path / "run.jsonl"
    saved.write_text('{"kind": "run", "date": "2026-01-01 00:00 UTC", "cpus": 2}\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvxfer.cli", *(a.format(saved=saved) for a in argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err


def test_registry_duplicates_and_missing_modules() -> None:
    from kvxfer.backend import BACKEND_API_VERSION
    from kvxfer.registry import get_backend, register_backend
    from kvxfer.testing.fake_backend import FakeBackend

    with pytest.raises(errors.DuplicateBackend):
        register_backend("ucx", FakeBackend)
    register_backend("needs-missing-dep", "kvxfer_no_such_module:Backend", clobber=True)
    with pytest.raises(errors.MissingDependency) as info:
        get_backend("needs-missing-dep")
    assert "pip install" in str(info.value)
    register_backend("not-a-backend", "kvxfer.errors:KvxferError", clobber=True)
    with pytest.raises(errors.BackendError, match="not a kvxfer Backend"):
        get_backend("not-a-backend")

    class OldApi(FakeBackend):
        api_version = BACKEND_API_VERSION + 1

    register_backend("old-api", OldApi, clobber=True)
    with pytest.raises(errors.BackendError, match="API version"):
        get_backend("old-api")


@pytest.mark.proc  # a whole mypy --strict run
def test_mypy_strict_user_code_sees_every_public_name(tmp_path: Path) -> None:
    """`from kvxfer import X` type-checks under mypy --strict for every X in __all__
    (no "does not explicitly export" for the lazily loaded names). Only the user's file
    and kvxfer/__init__.py are analysed (the re-export rule is decided there), which
    keeps this to seconds."""
    pytest.importorskip("mypy")
    names = sorted(kvxfer.__all__)
    snippet = tmp_path / "user.py"
    snippet.write_text(
        "from kvxfer import (\n"
        + "".join(f"    {n},\n" for n in names)
        + ")\n\n"
        + "USED: list[object] = [\n"
        + "".join(f"    {n},\n" for n in names)
        + "]\n"
    )
    init = Path(kvxfer.__file__).resolve()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--follow-imports=skip",
            str(snippet),
            str(init),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(init.parent.parent)},
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Success" in run.stdout
