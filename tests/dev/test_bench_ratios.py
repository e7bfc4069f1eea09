"""`bench acceptance`'s ratio table: each ratio printed with its interval, and --seeds' bad input."""

from __future__ import annotations

import numpy as np
import pytest

from hpc.errors import UserError
from hpc.evaluate.ratios import prompt_table, ratio_interval
from hpc_dev import bench_ratios as br
from tests.evaluate.test_ratios import noisy, result


def test_the_table_prints_each_ratio_with_its_interval():
    rng = np.random.default_rng(5)
    results = {"a": [result("DSpark", "gsm8k", noisy(rng, 12, 2.4))], "b": [result("DFlash", "gsm8k", noisy(rng, 12, 2))]}
    taus, prompts = br.tau_table(results), prompt_table(results)
    intervals = {r: ratio_interval([prompts], "DSpark", r, 7) for r in br.ratios(taus)}
    line = next(ln for ln in br.format_table(taus, ["gsm8k"], intervals).splitlines() if ln.startswith("DSpark / DFlash"))
    assert "x (95% CI " in line and "bootstrap over 12 prompts" in line and ("meets" in line or "misses" in line)


@pytest.mark.parametrize("text", ["", "0,x", "1,1"])
def test_bad_seeds_are_one_line(text):
    with pytest.raises(UserError, match="--seeds"):
        br.parse_seeds(text)
