"""The Hugging Face hub libraries' offline switch, as our code reads it.

`datasets` and `huggingface_hub` read HF_HUB_OFFLINE once, at import: a variable set later (by a
launcher, a test, a site's module file) is not seen, and a hub id on an offline node then costs
~25 s of network retries per file before its error. Whoever loads from the hub asks here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_TRUE = {"1", "ON", "YES", "TRUE"}


def offline_requested() -> bool:
    return any(os.environ.get(v, "").upper() in _TRUE
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


@contextmanager
def hub_offline(on: bool) -> Iterator[None]:
    """Make the hub libraries honour offline mode requested after they were imported."""
    if not on:
        yield
        return
    import datasets.config as dcfg  # datasets: loaded only on this path
    import huggingface_hub.constants as hcfg  # huggingface_hub: loaded only on this path

    saved = (dcfg.HF_HUB_OFFLINE, hcfg.HF_HUB_OFFLINE)
    dcfg.HF_HUB_OFFLINE = hcfg.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        dcfg.HF_HUB_OFFLINE, hcfg.HF_HUB_OFFLINE = saved
