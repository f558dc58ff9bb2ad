"""The course's grading: the otter-grader pipeline (:mod:`~dtlib.grading.pipeline`), batch grading
of a folder (:mod:`~dtlib.grading.batch`), what a learner reads after a check
(:mod:`~dtlib.grading.feedback`) and the checks behind each graded exercise
(:mod:`dtlib.grading.checks`, one module per exercise slug).

Library code never imports from here; the exercises' test cells do.
"""

from dtlib.extras import require

require("course", "otter", "torch", feature=__name__)
from dtlib.grading.pipeline import assign, check, generate, grade, main, masters, masters_dir, normalise

__all__ = ["masters", "masters_dir", "assign", "generate", "check", "grade", "normalise", "main"]
