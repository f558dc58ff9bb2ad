"""The course's grading: the otter-grader pipeline (:mod:`~dtlib.grading.pipeline`) and the checks
behind each graded exercise (:mod:`dtlib.grading.checks`, one module per exercise slug).

Library code never imports from here; the exercises' test cells do.
"""
from dtlib.grading.pipeline import assign, check, generate, grade, main, masters, normalise

__all__ = ["masters", "assign", "generate", "check", "grade", "normalise", "main"]
