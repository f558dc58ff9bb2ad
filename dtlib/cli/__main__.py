"""``python -m dtlib.cli ...`` is the ``dtlib`` command."""
import sys

from dtlib.cli import main

sys.exit(main())
