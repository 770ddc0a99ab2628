"""`python -m fastspec.cli ...` = `fastspec ...`."""

from fastspec.cli.main import app

app()
