"""Helpers shared by the tests; conftest.py holds only fixtures."""
