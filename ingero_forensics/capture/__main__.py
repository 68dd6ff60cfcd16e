"""python -m ingero_forensics.capture: the same as ingero-capture."""
from .cli import main

main()
