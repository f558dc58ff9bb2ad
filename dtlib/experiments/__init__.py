"""Experiments the lessons run on real ranks (timings, training runs, measurements).

Pure functions: they return data; ``dtlib.viz`` draws it and ``dtlib.widgets`` wires controls.
"""

from dtlib.extras import require

require("course", "torch", feature=__name__)
