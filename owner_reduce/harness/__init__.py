"""The harness: a rank launcher with a hard deadline, toy models, toy training and deliberate faults.

Why apart: tests, the demo, benchmarks and the acceptance script use it; the product never imports it
(``tests/test_layering.py`` fails if a product module does).
"""
