"""`python -m app.cli`: the same as the `canary` command."""

from app.cli import main

main()
