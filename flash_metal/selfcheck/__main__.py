"""python -m flash_metal.selfcheck (the package's docstring says what it does)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
