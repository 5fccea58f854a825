"""`python -m benchmarks.model ...`: the Metal performance model's command (cli.py)."""
import sys

from .cli import main

sys.exit(main())
