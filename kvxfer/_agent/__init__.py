"""The Agent's parts (internal): the facade :class:`kvxfer.agent.Agent` builds each one
in its constructor and hands it what it needs.

The parts side by side (none imports another; ``pyproject.toml``'s layer contract):
``pull`` (a consumer's pulls), ``push_receive`` (a consumer's push receptions),
``push_write`` (a producer's push writes), ``holds`` (a producer's holds) and
``registrar`` (registering memory). Across TP sizes: ``tp_pull``,
``tp_push_receive``, ``tp_push_write``, over ``tp_producers`` (another TP size's
producer group). Below them the runtime that posts and settles (``runtime``,
``settle``, ``guard_read``, ``progress``), the side channel's server and client
(``side_channel``), peers, leases, receptions and this agent's own identity (``local``).
"""
