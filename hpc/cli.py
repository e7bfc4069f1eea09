"""The `dspark` command line.

Each subcommand lives next to the stage it drives and exposes ``register(subparsers)``;
modules are imported lazily so `dspark validate` on a login node does not import torch.
The CPU proving ground's tools (`demo`, `devcluster`, `toy-target`, the dev benchmarks) are
`dspark-dev`, a separate development distribution, which reuses `run` below with its own table.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hpc.errors import UserError

# (command, "module[:function]" adding its subparser (default function: register), one-line
# help); a module is imported only when its command runs, so the top-level help never pays for
# torch or mlflow imports.
COMMANDS: list[tuple[str, str, str]] = [
    ("validate", "hpc.launch.validate_cli", "check a config on the login node before submitting"),
    ("regenerate", "hpc.data.regenerate_cli", "regenerate the data's assistant turns with the target (on-policy data)"),
    ("calibration-set", "hpc.data.calibration_set",
     "benchmark rows no evaluation reads, to calibrate the draft's confidence on (data.calibration_sources)"),
    ("train", "hpc.train.train_cli", "online training on this machine: verifier, streamer and DDP trainers"),
    ("export", "hpc.model.export_cli", "write a draft checkpoint in the format vLLM serves"),
    ("evaluate", "hpc.evaluate.evaluate_cli", "benchmark a draft at n=3/n=7 against the no-speculation baseline"),
    ("tracking", "hpc.track.serve_cli", "run the MLflow tracking server (with auth) that the cluster's jobs log to"),
    ("compare", "hpc.evaluate.compare_cli", "the comparison table of drafts and retrains, from MLflow"),
    ("submit", "hpc.launch.submit", "submit the whole pipeline to Slurm: regenerate, train array, evals at each n, report"),
    ("status", "hpc.launch.status:register_status", "state, progress and MLflow links of a submitted pipeline"),
    ("cancel", "hpc.launch.status:register_cancel", "cancel every job of a submitted pipeline"),
    ("schedule", "hpc.launch.schedule:register_schedule",
     "scheduled retraining: scrontab entry (or a self-resubmitting job) that retrains on new data"),
    ("retrain-tick", "hpc.launch.schedule:register_tick",
     "one scheduled retraining check: submit the pipeline if the data changed or the served draft drifted"),
    ("watch", "hpc.launch.schedule:register_watch",
     "one tick of the serving watch: live acceptance on serve.endpoints against the champion's"),
    ("stage", "hpc.launch.stage_cli", "run one pipeline stage inside a Slurm job (what sbatch/ scripts call)"),
    ("bench", "hpc.bench", "benchmarks that print figures (ratios against a peer run)"),
    ("plan", "hpc.launch.plan_cli",
     "capacity plan: verifier supply vs trainer demand, trainer nodes per verifier node, memory per GPU"),
]


DESCRIPTION = "Train DSpark speculative-decoding drafts on Slurm and prove what they are worth."


def build_parser(argv: list[str], prog: str = "dspark", description: str = DESCRIPTION,
                 commands: list[tuple[str, str, str]] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, module, help_text in commands:
        if wanted == name:
            path, _, func = module.partition(":")
            getattr(importlib.import_module(path), func or "register")(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


_CONTROL = {chr(c) for c in (*range(0x20), 0x7F)} - {"\t", "\n"}


def _unreadable(word: str) -> str | None:
    """Why a command-line word cannot be a path, a name or a value of ours, or None: bytes that are
    not UTF-8 (Python hands them over as lone surrogates) or control characters (a NUL ends a path
    at the system call; an escape sequence rewrites the terminal that prints it back)."""
    if any("\udc80" <= ch <= "\udcff" for ch in word):
        return "has bytes that are not UTF-8"
    if bad := next((ch for ch in word if ch in _CONTROL), None):
        return f"has a control character ({bad!r})"
    return None


def _given_twice(overrides: list[str]) -> str | None:
    """The first KEY that two of a user's KEY=VALUE words set (`sweep.train.lr` and `sweep={train.lr: ..}`
    are told apart by their text only: the loader merges what differs)."""
    seen: set[str] = set()
    for word in overrides:
        key = str(word).split("=", 1)[0].strip()
        if key in seen:
            return key
        seen.add(key)
    return None


def main(argv: list[str] | None = None) -> int:
    return run(argv)


def run(argv: list[str] | None, prog: str = "dspark", description: str = DESCRIPTION,
        commands: list[tuple[str, str, str]] = COMMANDS) -> int:
    """Parse `argv` against `commands` and run the chosen one; a UserError is one line per
    line of its message, exit code its own."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv, prog, description, commands)
    for i, word in enumerate(argv, 1):
        if why := _unreadable(word):  # the word itself is never echoed: it may be a secret
            parser.error(f"word {i} of the command line {why}; retype it (a file name or value as plain text)")
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "rest") and not any(a.startswith("-") for a in extra):
        args.rest, extra = [*args.rest, *extra], []  # `dspark export CKPT --n 3 OUT`: OUT came after a flag
    # `dspark submit CFG --dry-run train.lr=1e-4`: argparse stops filling a positional list at
    # the first flag, so KEY=VALUE words after flags arrive here; they are overrides all the same.
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if (extra and not hasattr(args, "overrides")) or any(a.startswith("-") for a in stray):
        parser.parse_args(argv)  # argparse's own one-line usage error, exit 2
    if stray:  # a word for an override without its value: say so, as for one before the flags
        parser.error(f"override `{stray[0]}`: expected KEY=VALUE, e.g. train.lr=1e-4")
    if extra:
        args.overrides = list(args.overrides) + extra
    # Not for `stage`: the sbatch scripts append their own (train.output_dir=...) after the user's.
    if argv[:1] != ["stage"] and (twice := _given_twice(getattr(args, "overrides", None) or [])):
        parser.error(f"override `{twice}` is given twice; keep one (the last would win without a word)")
    try:
        return int(args.func(args) or 0)
    except UserError as err:
        from hpc.config.secrets import scrub  # only when an error is printed: omegaconf stays out of startup

        for line in scrub(str(err)).splitlines() or [type(err).__name__]:
            print(f"error: {line}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dspark ... | head`: the reader left, which is not an error
        sys.stderr.close()
        return 0
    except OSError as err:  # after BrokenPipeError, which is one
        if err.filename is None:
            raise
        # A path the user named (a flag, a config's key) that the filesystem refuses: too long, not
        # a directory, not ours to read. Theirs to fix, so one line, as for any bad input.
        from hpc.config.secrets import scrub  # only when an error is printed

        name = str(err.filename)
        shown = name if len(name) <= 120 else f"{name[:60]}...({len(name)} characters)"
        print(f"error: {scrub(shown)}: {err.strerror or err}; check the path you gave", file=sys.stderr)
        return 2
    except Exception:
        from hpc.config.secrets import scrubbed_traceback  # only for a bug: omegaconf stays out of startup

        print(scrubbed_traceback(), end="", file=sys.stderr)  # a bug's traceback, for whoever debugs it
        return 1
