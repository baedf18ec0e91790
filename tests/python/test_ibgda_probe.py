"""moelink.ibgda_status(): the run-time probe for IBGDA. It claims the path usable only with an
mlx5 device and the plugin, and otherwise names the first thing missing."""

import os

import pytest

import moelink


def test_status_is_consistent_and_says_why():
    st = moelink.ibgda_status()
    assert st["usable"] is bool(st["mlx5_devices"] and st["plugin"])
    assert isinstance(st["reason"], str) and st["reason"]
    assert set(st["mlx5_devices"]) <= set(st["devices"])
    if not st["verbs_library"]:
        assert "not installed" in st["reason"]
    elif not st["devices"]:
        assert "no RDMA devices" in st["reason"]
    elif not st["mlx5_devices"]:
        assert "no mlx5 device" in st["reason"]
    elif not st["plugin"]:
        assert "plugin does not load" in st["reason"]
    else:
        assert "uses IBGDA" in st["reason"]


def test_devices_are_the_kernels():
    """Every device libibverbs lists is one the kernel exposes under /sys/class/infiniband
    (libibverbs leaves out devices without a user-space provider, so not the other way)."""
    st = moelink.ibgda_status()
    if not st["verbs_library"]:
        pytest.skip("rdma-core's libibverbs is not installed")
    sysfs = "/sys/class/infiniband"
    on_sysfs = set(os.listdir(sysfs)) if os.path.isdir(sysfs) else set()
    assert set(st["devices"]) <= on_sysfs, (st["devices"], sorted(on_sysfs))
