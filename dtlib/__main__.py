"""``python -m dtlib ...`` is the ``dtlib`` command; under torchrun: ``torchrun ... -m dtlib train ...``."""
import sys

from dtlib.cli import main

sys.exit(main())
