"""Calibration keys of an [[imu]] that the estimator applies to every reading."""

from __future__ import annotations

import numpy as np
import pytest

from estimator_service.errors import ConfigError
from estimator_service.rig import load_rig_text
from estimator_service.paths import config_dir

RIG = """
[rig]
name = "shaft"
mechanism = "shaft.yaml"
[[imu]]
name = "shaft"
body = "shaft"
{keys}
"""


def _rig(keys: str):
    return load_rig_text(RIG.format(keys=keys), (config_dir() / "mechanisms" / "shaft.yaml").read_text(), "r.toml")


def test_the_gyro_reading_is_unbiased_then_unscaled():
    rig = _rig("gyr_bias_cal = [0.1, 0.0, -0.2]\ngyr_scale_cal = [1.0, 1.05, 0.5]")
    gyro = rig.virtual_sensors(rig.model)[0]
    y = gyro.measure({"gyr": [1.1, 2.1, 1.8], "t": 0.0, "seq": 0})
    assert y == pytest.approx([1.0, 2.0, 4.0], abs=1e-12)
    plain = _rig("").virtual_sensors(_rig("").model)[0]
    assert np.array_equal(plain.measure({"gyr": [1.1, 2.1, 1.8]}), [1.1, 2.1, 1.8])  # the default changes nothing


@pytest.mark.parametrize("value", ["[1.0, 0.0, 1.0]", "[1.0, -1.0, 1.0]", "[1.0, 1.0]", "2.0"])
def test_a_scale_that_is_not_three_positive_numbers_is_an_error(value):
    with pytest.raises(ConfigError) as exc:
        _rig(f"gyr_scale_cal = {value}")
    assert str(exc.value).startswith("r.toml: imu[0].gyr_scale_cal: expected")
