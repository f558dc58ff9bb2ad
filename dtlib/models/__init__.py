"""Models of the course: their descriptions (:mod:`~dtlib.analytic.config`, presets) and small
PyTorch models to run on a laptop (:class:`TinyGPT`, :class:`MnistCNN`)."""

from dtlib.extras import require

require("course", "torch", feature=__name__)
from dtlib.models.cnn import MnistCNN
from dtlib.analytic.config import TransformerConfig, num_parameters
from dtlib.models.gpt import TinyGPT, tiny_gpt_config
from dtlib.analytic.presets import PRESETS, get_preset

__all__ = ["MnistCNN", "TinyGPT", "tiny_gpt_config", "TransformerConfig", "num_parameters",
           "PRESETS", "get_preset"]
