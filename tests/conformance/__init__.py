"""Upstream suites run against shmbuf's drop-ins (``sb3_suite.py``); nothing of theirs is kept here."""
