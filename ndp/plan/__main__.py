"""``python -m ndp.plan``: the ``ndp-plan`` CLI."""
import sys

from .cli import main

sys.exit(main())
