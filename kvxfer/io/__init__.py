"""The I/O edges below the Agent: the side channel's sockets (:mod:`kvxfer.io.control`),
the RDMA rails a host shows (:mod:`kvxfer.io.rails`), the link monitor and the
single-thread writer (:mod:`kvxfer.io.serial`).

They import the pure core and nothing of the Agent; zmq loads in ``control`` only.
"""
