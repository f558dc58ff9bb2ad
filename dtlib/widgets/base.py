"""The one widget pattern of the course: an :class:`Explorer`.

An Explorer holds named controls, a *pure* ``compute(**values)`` function from ``dtlib`` and a
``plot(result) -> Figure`` function from ``dtlib.viz``. Changing a control recomputes and redraws;
nothing else lives in the widget, so everything it shows is also testable without a browser.
"""
from __future__ import annotations

import base64
from typing import Any, Callable

import ipywidgets as W
from IPython.display import Image, display
from matplotlib.figure import Figure

from dtlib.viz import _figure_png

REGISTRY: dict[str, Callable[[], "Explorer"]] = {}


def register(name: str) -> Callable[[Callable[[], "Explorer"]], Callable[[], "Explorer"]]:
    """Decorator: record a zero-argument widget builder under ``name`` (used by the widget tests)."""
    def deco(builder: Callable[[], "Explorer"]) -> Callable[[], "Explorer"]:
        if name in REGISTRY and REGISTRY[name] is not builder:
            raise ValueError(f"widget name {name!r} is registered twice")
        REGISTRY[name] = builder
        return builder
    return deco


class Explorer:
    """Controls -> ``compute`` -> ``plot``, redrawn on every change.

    Attributes after each update: ``result`` (what ``compute`` returned), ``figure`` (what ``plot``
    returned, or None), ``error`` (the message of the ``ValueError`` an impossible setting raised,
    shown instead of a figure, or None), ``updates`` (how many times it has been computed).
    """

    def __init__(self, controls: dict[str, W.ValueWidget], compute: Callable[..., Any],
                 plot: Callable[[Any], Figure] | None = None, title: str = "",
                 columns: int = 3):
        self.controls = controls
        self.compute = compute
        self.plot = plot
        self.result: Any = None
        self.figure: Figure | None = None
        self.error: str | None = None
        self.updates = 0
        self.out = W.Output()
        items = list(controls.values())
        for control in items:  # the whole description, never cut to "PowerSG..."
            control.style.description_width = "initial"
        rows = [W.HBox(items[i:i + columns]) for i in range(0, len(items), columns)]
        header = [W.HTML(f"<b>{title}</b>")] if title else []
        self.widget = W.VBox(header + rows + [self.out])
        for control in items:
            control.observe(lambda _change: self.update(), names="value")
        self.update()

    def values(self) -> dict[str, Any]:
        return {name: c.value for name, c in self.controls.items()}

    def update(self) -> None:
        try:
            self.result = self.compute(**self.values())
            self.figure = self.plot(self.result) if self.plot else None
            self.error = None
        except ValueError as exc:  # an impossible setting (dtlib says why): keep the widget alive
            self.result, self.figure, self.error = None, None, str(exc)
        self.updates += 1
        # One assignment of the outputs, so the old picture is replaced without a flicker; the
        # figure goes as PNG bytes, which every frontend (and a test without a kernel) shows.
        self.out.outputs = ()
        if self.error is not None:
            self.out.append_stdout(f"Not a valid setting: {self.error}\n")
        else:
            self.out.append_display_data(Image(_figure_png(self.figure)) if self.figure is not None
                                         else self.result)

    def _ipython_display_(self) -> None:
        # The widget's view, plus its current figure as a PNG in the same output: JupyterLab shows
        # the live controls, a static page (the course website, nbconvert) the default setting's
        # figure, as ipywidgets itself falls back to text/plain where no widget manager runs.
        bundle = self.widget._repr_mimebundle_()
        if self.error is None and self.figure is not None:
            bundle["image/png"] = base64.b64encode(_figure_png(self.figure)).decode("ascii")
        display(bundle, raw=True)
