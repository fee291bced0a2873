"""The harness: a rank launcher with a hard deadline, toy models, toy training and deliberate faults.

Why apart from the package (a top-level folder, not in the wheel): tests, the demo, benchmarks and the acceptance
script use it; the product never imports it (``tests/repo/test_layering.py`` fails if a product module does). It imports
the product as any user does, by ``owner_reduce.``; pytest finds it through pyproject's ``pythonpath``, the scripts
by putting the checkout's root on ``sys.path``, and the ranks it starts inherit their parent's ``sys.path``.
"""
