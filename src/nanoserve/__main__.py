"""`python -m nanoserve` runs the command line."""
from nanoserve.cli import main

main()
