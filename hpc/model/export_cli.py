"""`dspark export CHECKPOINT OUT` and `dspark export --shapes-only CONFIG`."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from hpc.errors import UserError
from hpc.model.model_checks import resolve
from hpc.tables import text_table


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.2f} TB"


def shapes_only(config: str, overrides: list[str]) -> int:
    from hpc.model.export import shapes_only_inventory  # safetensors, torch: loaded only on this path

    cfg = resolve(config, overrides, check_tracking=False)
    rows = shapes_only_inventory(cfg.draft)
    total = sum(r[3] for r in rows)
    # Plain print: `| head` ends it with exit 0 (a rich Console turns the broken pipe into exit 1).
    print(f"{cfg.name}: exported tensors (built on the meta device, nothing allocated)")
    print("\n".join(text_table(["tensor", "shape", "dtype", "size"], [
        [name, "x".join(map(str, shape)), str(dtype).removeprefix("torch."), _human(nbytes)]
        for name, shape, dtype, nbytes in rows], right={3})))
    print(f"{len(rows)} tensors, {_human(total)} ({total / 2**30:.2f} GiB), "
          f"{sum(math.prod(r[1]) for r in rows) / 1e9:.3f} B elements")
    return 0


def export(checkpoint: str, out: str, n: int | None) -> int:
    # safetensors, torch: loaded only on this path
    from hpc.model.export import check_export_target, export_draft, load_draft, read_export_config

    src = Path(checkpoint)
    o, s, here = Path(out).resolve(), src.resolve(), Path.cwd().resolve()
    # Before any check that reads OUT or any copy: OUT is replaced whole, through a temp copy beside it.
    if o == s:
        raise UserError(f"OUT is the checkpoint itself ({src}); export into a new directory")
    if s in o.parents or o in s.parents:
        raise UserError(f"OUT {out} and the checkpoint {src} overlap (one holds the other); export into a "
                        "directory outside the checkpoint")
    if o == here or o in here.parents:
        raise UserError(f"OUT {out} is the current directory or holds it, and OUT is replaced whole; cd out of it, "
                        "or export into a new directory")
    check_export_target(Path(out))
    config = read_export_config(src)
    model = load_draft(src)  # export_draft refuses an --n outside what the draft proposes
    verifier = config.get("speculators_config", {}).get("verifier", {})
    export_draft(model, out, verifier.get("name_or_path"), verifier.get("architectures", []), n)
    print(f"exported {src} -> {out} ({'dflash' if model.args.is_dflash else 'dspark'}, bf16)")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.shapes_only:
        return shapes_only(args.source, args.rest)
    if len(args.rest) != 1:
        raise UserError("usage: dspark export CHECKPOINT OUT  (or --shapes-only CONFIG [KEY=VALUE ...])")
    return export(args.source, args.rest[0], args.n)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a draft in the format vLLM serves (config.json + model.safetensors)")
    p.add_argument("source", help="checkpoint directory, or a config with --shapes-only")
    p.add_argument("rest", nargs="*", help="OUT directory (or KEY=VALUE overrides with --shapes-only)")
    p.add_argument("--shapes-only", action="store_true", help="print the tensor inventory of a config; allocate nothing")
    p.add_argument("--n", type=int, default=None, help="speculative tokens to advertise (default: all the draft proposes)")
    p.set_defaults(func=run)
