"""The global mesh from the `mesh` config group."""

import jax
import pytest

from jaxrl.sharding import make_mesh, resolve_axis_sizes


def test_rest_axis_takes_remaining_devices():
    assert resolve_axis_sizes({"dp": 1, "fsdp": -1, "tp": 2, "sp": 1}, 8) == {
        "dp": 1,
        "fsdp": 4,
        "tp": 2,
        "sp": 1,
    }


@pytest.mark.parametrize(
    "sizes, match",
    [
        ({"dp": 2, "fsdp": 2, "tp": 1, "sp": 1}, "spans 4 devices but 8"),
        ({"dp": -1, "fsdp": -1, "tp": 1, "sp": 1}, "only one mesh axis"),
        ({"dp": 1, "fsdp": -1, "tp": 3, "sp": 1}, "cannot be split"),
        ({"dp": 0, "fsdp": -1, "tp": 1, "sp": 1}, "dp=0"),
    ],
)
def test_bad_sizes(sizes, match):
    with pytest.raises(ValueError, match=match):
        resolve_axis_sizes(sizes, 8)


def test_make_mesh_on_eight_fake_devices():
    assert jax.device_count() == 8
    mesh = make_mesh({"dp": 1, "fsdp": -1, "tp": 2, "sp": 1})
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 4, "tp": 2, "sp": 1}
    assert mesh.axis_names == ("dp", "fsdp", "tp", "sp")
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
