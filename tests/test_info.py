"""`Allocator.info()`: the facts the driver gives about each device, on either backend (the same path for both:
the driver answers, the bindings do not branch on the backend's name)."""

from __future__ import annotations

from cumem_rs import Allocator

MiB = 1 << 20


def test_info_reports_every_device_of_the_driver(alloc: Allocator) -> None:
    info = alloc.info()
    assert info["backend"] == alloc.backend
    assert len(info["devices"]) == alloc.device_count()
    for i, d in enumerate(info["devices"]):
        assert d["device"] == i
        assert d["granularity"] == alloc.granularity(i)
        assert 0 <= d["free"] <= d["total"]
        assert isinstance(d["name"], str) and d["name"]
        assert isinstance(d["rdma_with_vmm"], bool)
    if alloc.backend == "cuda":
        assert info["driver_version"] >= 12000
    else:
        assert "driver_version" not in info


def test_simulated_info_answers_with_the_configuration() -> None:
    a = Allocator.simulated(devices=3, capacity=32 * MiB, granularity=4 * MiB)
    try:
        a.malloc(4 * MiB, device=1)
        info = a.info()
        assert [d["name"] for d in info["devices"]] == ["simulated device"] * 3
        assert [d["total"] for d in info["devices"]] == [32 * MiB] * 3
        assert [d["free"] for d in info["devices"]] == [32 * MiB, 28 * MiB, 32 * MiB]
        assert [d["granularity"] for d in info["devices"]] == [4 * MiB] * 3
        assert not any(d["rdma_with_vmm"] for d in info["devices"])
    finally:
        a.close()
