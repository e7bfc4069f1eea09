"""Regenerated rows on disk: numbered JSONL shards plus a manifest, both written atomically.

Shard k holds the results of input rows [k * shard_size, (k + 1) * shard_size) in input order
(skipped rows leave gaps), so shard contents never depend on request timing. The manifest
records each shard's input range and counts, and the settings the run used.

Resume: the complete shards are the prefix 0..K-1 whose files exist and whose manifest entries
cover a full input range (or, once a run reached the end of the data, the short last shard
too: `finished`); the run restarts at input row K * shard_size. Anything after that (a shard
written just before a kill but not yet in the manifest, or a short last shard from a run that
stopped at a row limit) is deleted and redone, so a killed run loses at most the shard in
progress and no row is ever written twice.

Trust: the directory is 0700 (regenerated replies are the verifier's outputs on the user's
data, and a group member who could write here could poison on-policy training), and the
manifest records each shard's sha256. A resume and every reader (`verify_shards`, before
training or calibration reads a row) check them: a shard changed since it was written, or a
data file the manifest does not list, is one line naming it, never trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpc.errors import UserError

# Temp names do not end in .jsonl: readers globbing *.jsonl never see a partial shard.
from hpc.fsio import remove_stale_temps, unsafe_ancestor, write_bytes, write_text

MANIFEST = "manifest.json"
SHARD_RE = re.compile(r"shard-(\d{5,})\.jsonl")


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.jsonl"


@dataclass
class ShardInfo:
    name: str
    start: int  # first input row (global index over all sources)
    end: int  # one past the last input row
    written: int
    skipped: dict[str, int] = field(default_factory=dict)
    sha256: str = ""  # of the file's bytes; "" only in manifests written before shards were hashed


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _check_shard(root: Path, info: ShardInfo) -> None:
    if not info.sha256:
        raise UserError(f"{root / info.name}: its manifest records no hash (regenerated before shards were "
                        "hashed), so nothing proves it is what the verifier wrote; delete "
                        f"{root} and run the regenerate stage again")
    if _sha256(root / info.name) != info.sha256:
        raise UserError(f"{root / info.name} changed after it was regenerated (sha256 differs from {MANIFEST}); "
                        f"refusing to train on it: delete {root} and run the regenerate stage again")


def private_dir(root: Path) -> None:
    """Create `root` 0700, or tighten an existing one of ours; refuse one another user could swap."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UserError(f"data.output_dir: {root} is not a directory of yours; use a data.output_dir you own")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(root, 0o700)
    if (why := unsafe_ancestor(root.parent)) is not None:
        raise UserError(f"data.output_dir: {why}; another user could swap the regenerated data; use a "
                        "data.output_dir of your own")


def verify_shards(root: str | Path) -> None:
    """Before anything reads the regenerated rows under `root`: each listed shard has the hash
    its manifest recorded, and no other data file sits beside them (a reader globs the folder)."""
    root = Path(root)
    manifest = json.loads((root / MANIFEST).read_text())
    listed = {e["name"] for e in manifest.get("shards", [])}
    for e in manifest.get("shards", []):
        _check_shard(root, ShardInfo(**e))
    extra = sorted(p.name for p in root.iterdir() if p.suffix in (".jsonl", ".parquet") and p.name not in listed)
    if extra:
        raise UserError(f"{root / extra[0]} is not one of the regenerated shards its {MANIFEST} lists; "
                        "refusing to train on it: remove it (the regenerate stage writes only listed shards)")


class ShardStore:
    def __init__(self, root: str | Path, shard_size: int, settings: dict):
        if shard_size < 1:
            raise UserError(f"shard size must be >= 1, got {shard_size}")
        self.root = Path(root)
        self.shard_size = shard_size
        self.settings = {**settings, "shard_size": shard_size}
        self.shards: list[ShardInfo] = []
        self.finished = False  # every input row is in a shard

    def open(self) -> int:
        """Check the settings, drop incomplete leftovers; return the input row to restart at."""
        private_dir(self.root)
        remove_stale_temps(self.root)  # a killed writer's; never a live writer's file in progress
        manifest = self.root / MANIFEST
        old = json.loads(manifest.read_text()) if manifest.exists() else None
        if old is None and any(self.root.glob("shard-*.jsonl")):
            # Without the manifest nothing says which shards are complete: refuse rather than delete.
            raise UserError(f"{self.root} holds shards but no {MANIFEST}; move them away or use another "
                            "data.output_dir")
        if old is not None and old.get("settings") != self.settings:
            changed = sorted(k for k in set(old["settings"]) | set(self.settings)
                             if old["settings"].get(k) != self.settings.get(k))
            raise UserError(f"{self.root} holds shards regenerated with other settings ({', '.join(changed)} "
                            "differ); resume with the same settings, or use another data.output_dir "
                            "(or delete that folder) to start over")
        entries = [ShardInfo(**e) for e in (old or {}).get("shards", [])]
        done: list[ShardInfo] = []
        for k, info in enumerate(entries):
            last_of_finished = bool(old and old.get("finished")) and k == len(entries) - 1
            full = info.end == info.start + self.shard_size or last_of_finished
            if not (full and info.start == k * self.shard_size and info.name == shard_name(k)
                    and (self.root / info.name).exists()):
                break
            _check_shard(self.root, info)  # a resume builds on it: it must be what was written
            done.append(info)
        self.finished = bool(old and old.get("finished")) and len(done) == len(entries)
        for path in self.root.glob("shard-*.jsonl"):
            m = SHARD_RE.fullmatch(path.name)
            if m and int(m.group(1)) >= len(done):
                path.unlink()
        self.shards = done
        self._write_manifest()
        return done[-1].end if done else 0

    def write(self, start: int, end: int, records: list[dict], skipped: dict[str, int]) -> ShardInfo:
        k = start // self.shard_size
        assert start == k * self.shard_size and k == len(self.shards), "shards are written in order"
        body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        info = ShardInfo(shard_name(k), start, end, len(records), dict(skipped), hashlib.sha256(body).hexdigest())
        write_bytes(self.root / info.name, body, mode=0o600)
        self.shards.append(info)
        self._write_manifest()
        return info

    def finish(self) -> None:
        """The data ended (no row limit cut it): a re-run has nothing left to do."""
        self.finished = True
        self._write_manifest()

    def _write_manifest(self) -> None:
        body = {"settings": self.settings, "finished": self.finished, "shards": [asdict(s) for s in self.shards]}
        write_text(self.root / MANIFEST, json.dumps(body, indent=1) + "\n", mode=0o600)


def read_shards(root: str | Path) -> list[dict]:
    """Every regenerated row, in shard order (tests and inspection)."""
    rows: list[dict] = []
    for path in sorted(Path(root).glob("shard-*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return rows
