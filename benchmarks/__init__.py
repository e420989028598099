"""Measured comparisons (not part of the test suite; a smoke mode runs in CI)."""
