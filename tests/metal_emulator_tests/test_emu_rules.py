"""The compile-only MSL rules check."""

import os

import pytest
from conftest import kernel_path

from metal_emulator import MslRuleError, check_msl_rules

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_good_kernel_passes():
    check_msl_rules([kernel_path("rules/good.metal")])


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("device_to_thread", "address space"),
        ("threadgroup_to_plain", "address space"),
        ("write_constant", "read-only"),
        ("no_address_space", "needs an address space"),
        ("no_attribute", "needs an attribute"),
    ],
)
def test_violation_is_caught(name, fragment):
    with pytest.raises(MslRuleError) as e:
        check_msl_rules([kernel_path(f"rules/{name}.metal")])
    assert any(fragment in v.replace("_", " ") for v in e.value.violations), e.value.violations


def test_own_proof_kernels_follow_the_rules():
    for name in ("basic", "collectives", "matrix", "rounding", "threadgroup", "bugs"):
        check_msl_rules([kernel_path(f"{name}.metal")])


def test_shipped_shaders_follow_the_rules():
    shaders = os.path.join(REPO, "shaders")
    metal = sorted(f for f in os.listdir(shaders) if f.endswith(".metal")) if os.path.isdir(shaders) else []
    if not metal:
        pytest.skip("no shaders/*.metal yet")
    for name in metal:
        check_msl_rules([os.path.join(shaders, name)])
