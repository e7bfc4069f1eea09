import math

import pytest

from hpc.train.lr_schedule import lr_factor


def test_warmup_then_cosine_to_min():
    assert lr_factor(0, 4, 104) == pytest.approx(0.25)
    assert lr_factor(3, 4, 104) == pytest.approx(1.0)
    assert lr_factor(4, 4, 104) == pytest.approx(1.0)
    assert lr_factor(54, 4, 104) == pytest.approx(0.5)  # halfway through the decay
    assert lr_factor(104, 4, 104, min_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(29, 4, 104) == pytest.approx(0.5 * (1 + math.cos(math.pi * 25 / 100)))


def test_linear_and_constant():
    assert lr_factor(54, 4, 104, "linear") == pytest.approx(0.5)
    assert lr_factor(99, 4, 104, "constant") == 1.0
