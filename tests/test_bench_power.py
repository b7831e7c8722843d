"""The benchmarks' NVML sampler finds torch's GPU in NVML by UUID or PCI bus id, never by
index (CUDA_VISIBLE_DEVICES renumbers CUDA's devices, not NVML's), checked with a fake NVML."""

import pathlib
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
from _timing import nvml_handle  # noqa: E402


class FakeNvml:
    """Two GPUs; index lookups would return the wrong one, so they raise."""

    def __init__(self, uuid_works=True):
        self.gpus = [dict(uuid="GPU-aaaa-0000", bus="00000000:1a:00.0"),
                     dict(uuid="GPU-bbbb-1111", bus="00000000:3d:00.0")]
        self.uuid_works = uuid_works

    def nvmlDeviceGetHandleByIndex(self, index):
        raise AssertionError("looked up by index")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if self.uuid_works:
            for i, gpu in enumerate(self.gpus):
                if gpu["uuid"] == uuid:
                    return ("handle", i)
        raise RuntimeError("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        for i, gpu in enumerate(self.gpus):
            if gpu["bus"] == bus_id:
                return ("handle", i)
        raise RuntimeError("NVML_ERROR_NOT_FOUND")


def _props(uuid="bbbb-1111", bus=0x3D, **kw):
    # torch's device 0 in a job with CUDA_VISIBLE_DEVICES=1 is NVML's device 1.
    return SimpleNamespace(name="NVIDIA H100", uuid=uuid, pci_bus_id=bus, pci_domain_id=0,
                           pci_device_id=0, **kw)


def test_found_by_uuid_whatever_the_cuda_index():
    assert nvml_handle(FakeNvml(), _props()) == ("handle", 1)
    assert nvml_handle(FakeNvml(), _props(uuid="GPU-aaaa-0000")) == ("handle", 0)


def test_falls_back_to_the_pci_bus_id():
    assert nvml_handle(FakeNvml(uuid_works=False), _props()) == ("handle", 1)
    assert nvml_handle(FakeNvml(), _props(uuid="")) == ("handle", 1)
    assert nvml_handle(FakeNvml(), _props(uuid="", bus=0x1A)) == ("handle", 0)


def test_no_match_raises_instead_of_sampling_another_gpu():
    with pytest.raises(LookupError, match=r"UUID GPU-cccc .*PCI bus id 00000000:99:00\.0"):
        nvml_handle(FakeNvml(), _props(uuid="cccc", bus=0x99))
    with pytest.raises(LookupError, match="nothing"):
        nvml_handle(FakeNvml(), SimpleNamespace(name="GPU"))
