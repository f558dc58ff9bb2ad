"""Thin ipywidgets front-ends: controls -> a pure ``dtlib`` function -> a ``dtlib.viz`` plot.

Every module in this package registers its builders with :func:`dtlib.widgets.base.register`;
``tests/test_widgets.py`` imports them all, builds each headlessly and changes a control.
"""

from dtlib.extras import require

require("course", "ipywidgets", "matplotlib", feature=__name__)
from dtlib.widgets.base import REGISTRY, Explorer, register

__all__ = ["Explorer", "REGISTRY", "register"]
