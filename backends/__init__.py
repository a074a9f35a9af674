"""Built-in kvxfer backends, imported as ``kvxfer.backends``.

Backends are found through the ``kvxfer.backends`` entry-point group (see
:mod:`kvxfer.registry`); each module here imports its heavy dependency lazily.
"""
