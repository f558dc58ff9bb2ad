"""Plotting functions: each takes data and returns a ``matplotlib.figure.Figure`` (no pyplot state).

Figures made with ``Figure()`` are not known to IPython until pyplot's inline backend is loaded,
so in a notebook this package registers a PNG formatter for them: a cell that ends with a figure
(or a widget that ``display``s one) shows the picture, exactly once.
"""

from dtlib.extras import require

require("course", "matplotlib", feature=__name__)
import io

from matplotlib.figure import Figure


def _figure_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", dpi=90)
    return buf.getvalue()


def _register_ipython_formatter() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.display_formatter.formatters["image/png"].for_type(Figure, _figure_png)


_register_ipython_formatter()
