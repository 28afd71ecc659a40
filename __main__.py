"""`python -m skilltrain`: the same as the `skilltrain` command."""
from .daemon.commands.cli import main

main()
