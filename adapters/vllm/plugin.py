"""The ``vllm.general_plugins`` entry point: registers kvxfer's connector names.

vLLM calls :func:`register` once per process (API server, engine core, workers),
and may call it again; ``KVConnectorFactory.register_connector`` raises on a name it
already knows, so registration checks first and treats "already registered" as
success. Nothing here may raise: vLLM calls plugin functions without a guard, and an
exception would abort the server's start-up. Registration is lazy on vLLM's side
too: the connector module is imported only when a config names one of the classes.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from kvxfer.adapters.vllm import timeline

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAMES", "attach_to_vllm_logging", "register"]

#: The connector names vLLM can be given, mapped to the module defining them.
#: ``RblnNixlConnector`` is the pull connector under its historical name.
CONNECTOR_MODULE = "kvxfer.adapters.vllm.connector"
CONNECTOR_NAMES: tuple[str, ...] = (
    "RblnNixlPullConnector",
    "RblnNixlPushConnector",
    "RblnNixlConnector",
)

log = logging.getLogger("kvxfer.adapters.vllm")


def _factory() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory


def _known(factory: Any, name: str) -> bool:
    registry = getattr(factory, "_registry", None)
    return isinstance(registry, dict) and name in registry


def attach_to_vllm_logging() -> None:
    """Send kvxfer's log records through vLLM's handlers (same format and stream).

    vLLM configures only its own ``vllm`` logger; without this, kvxfer's INFO lines
    (``RBLN NIXL (D2D): registered``, ``remote descriptor(s) for engine``, ...) would
    go nowhere in a ``vllm serve`` process. Idempotent; a no-op when the operator
    already gave the ``kvxfer`` logger handlers.
    """
    ours = logging.getLogger("kvxfer")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm")
    if not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def register() -> list[str]:
    """Register the connector names with vLLM's factory; idempotent, never raises.

    Returns:
        The names this call added (empty when all were already registered or vLLM's
        factory could not be imported).
    """
    with contextlib.suppress(Exception):  # logging must never cost the server its start
        attach_to_vllm_logging()
        timeline.enable_from_env()
    try:
        factory = _factory()
    except Exception as exc:  # vLLM missing or changed: log, leave vLLM running
        log.warning("kvxfer: vLLM's KVConnectorFactory is unavailable (%s); not registering", exc)
        return []
    added: list[str] = []
    for name in CONNECTOR_NAMES:
        if _known(factory, name):
            continue
        try:
            factory.register_connector(name, CONNECTOR_MODULE, name)
        except ValueError:
            # Registered meanwhile (another copy of this plugin, or a user's own
            # registration under the same name): theirs stays, which is fine.
            continue
        except Exception as exc:
            log.warning("kvxfer: could not register connector %s: %s", name, exc)
            continue
        added.append(name)
    if added:
        log.debug("kvxfer: registered vLLM connectors %s", ", ".join(added))
    return added
