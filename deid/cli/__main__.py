"""``python -m deid.cli``: the ``deid`` command."""
import sys

from deid.cli import main

sys.exit(main())
