"""The formats' floor: the login node imports every format without torch, and reads a checkpoint
directory's layout without loading it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_format_imports_without_torch_or_the_stages():
    mods = sorted(f"hpc.formats.{p.stem}" for p in (ROOT / "hpc" / "formats").glob("*.py") if p.stem != "__init__")
    assert len(mods) >= 5
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(sorted(k for k in sys.modules if k == 'torch' or k.startswith(('hpc.', 'safetensors'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    loaded = json.loads(out.strip().replace("'", '"'))
    assert "torch" not in loaded and not any(m.startswith("safetensors") for m in loaded), loaded
    assert {m.split(".")[1] for m in loaded} <= {"formats", "errors", "fsio", "hub"}, loaded


def test_the_latest_whole_checkpoint_is_found_and_a_torn_one_skipped(tmp_path):
    from hpc.formats.checkpoint_layout import REQUIRED, latest_checkpoint, step_dir

    said: list[str] = []
    assert latest_checkpoint(tmp_path, said.append) is None
    for step in (4, 8):
        d = tmp_path / step_dir(step)
        d.mkdir()
        for name in REQUIRED:
            (d / name).write_text("{}" if name.endswith(".json") else "")
    # empty .safetensors files are not whole: neither checkpoint is, and each is named
    assert latest_checkpoint(tmp_path, said.append) is None and len(said) == 2
    for d in (tmp_path / step_dir(4), tmp_path / step_dir(8)):
        for name in REQUIRED:
            if name.endswith(".safetensors"):  # an empty safetensors file: an 8-byte header of {}
                (d / name).write_bytes((2).to_bytes(8, "little") + b"{}")
    said.clear()
    assert latest_checkpoint(tmp_path, said.append) == tmp_path / step_dir(8) and not said
    (tmp_path / step_dir(8) / "state.json").write_text("{torn")
    assert latest_checkpoint(tmp_path, said.append) == tmp_path / step_dir(4)
    assert said and step_dir(8) in said[0] and "falling back to " + step_dir(4) in said[0]
