"""The fake backend passes the conformance suite, with and without device-to-device."""

from kvxfer.testing.conformance import BackendConformance, BackendSpec


class TestFakeDeviceToDevice(BackendConformance):
    spec = BackendSpec(name="fake", in_process=True)


class TestFakeHostOnly(BackendConformance):
    spec = BackendSpec(name="fake", in_process=True, extra={"device_to_device": "false"})
