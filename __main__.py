"""`python -m skilltrain`: the same as the `skilltrain` command."""
from .daemon.cli import main

main()
