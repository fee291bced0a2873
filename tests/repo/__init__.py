"""Checks of the repository itself: the package's layering, the documents, the error classes and the golden records a
restructure must leave unchanged."""
