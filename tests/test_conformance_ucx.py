"""The ucx backend passes the conformance suite against a peer in another process."""

from kvxfer.testing.conformance import BackendConformance, BackendSpec


class TestUcx(BackendConformance):
    spec = BackendSpec(name="ucx")
