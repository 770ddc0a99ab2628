"""User-facing errors: one class whose message is printed as a single line by the CLI (no traceback)."""


class FastspecError(Exception):
    """A problem the user can fix (bad flag, bad model directory, missing package...).

    The message must be one line that names the problem; the CLI prints `error: <message>` and exits 2.
    """
