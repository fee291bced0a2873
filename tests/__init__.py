"""The test suite as a package: each folder holds one kind of test (``tests/README.md``), and every test imports the
code it shares by name from ``tests.support``, with the repository root on the path (pyproject's ``pythonpath``)."""
