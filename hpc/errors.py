"""User-facing errors: the CLI prints them as one line, without a traceback. Stdlib only."""

# EX_TEMPFAIL: a trainer that checkpointed on a stop signal exits with it, and the node's
# launcher reads it as "requeue me". Here because both sides need it and the launcher side
# runs on the login node, without torch.
EXIT_REQUEUE = 75
# A trainer whose own draft failed (its loss went NaN) rather than its stream: when several drafts
# share one verifier's stream (a sweep, the ablations), its launcher drops that draft alone.
EXIT_DRAFT_FAILED = 6


class UserError(Exception):
    """A problem the user can fix (bad config, missing file, unreachable service).

    ``exit_code`` 2 follows the argparse convention for bad input.
    """

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(UserError):
    """One or more config problems; each entry is one line naming key, value and fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class VerifierDown(RuntimeError):
    """The verifier itself is gone (process exited, or it stopped answering), as opposed to one
    sample failing on a live, healthy server. The stream ends; it is not a bad sample."""

    def __init__(self, message: str, hung: bool = False):
        super().__init__(message)
        self.hung = hung
