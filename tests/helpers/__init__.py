"""Shared test helpers: data builders, command-line helpers, the audit hook and the server harness.

Test modules import from here (``from helpers.data import ...``), never from one another or from conftest.
"""
