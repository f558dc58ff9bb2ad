"""Behavioural checks behind the graded exercises (called from the otter tests).

Each ``check_*`` takes the learner's function, exercises it (on real ranks where it matters) and
raises ``AssertionError`` with a message that says what is wrong and how to fix it. The same
checks are run by pytest against correct and deliberately wrong implementations.
"""
