"""``python -m dtlib.grading``: assign, check or grade (see :mod:`dtlib.grading.pipeline`)."""
import sys

from dtlib.grading.pipeline import main

sys.exit(main())
