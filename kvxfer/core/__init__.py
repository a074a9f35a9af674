"""The pure core: layouts, block ids, the descriptor algebra, the compatibility hash,
the wire schema and the handshake's messages.

Nothing here imports zmq, torch, nixl, vllm or pyverbs, or anything of kvxfer above it
(the import contracts in ``pyproject.toml`` check both): every function is a value in,
a value out, and the properties in ``tests/`` test it hardest.
"""
