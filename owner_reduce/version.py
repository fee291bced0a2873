"""The package's version (pyproject.toml says the same), in a module of its own: the runtime names it in the settings
line, and importing the package's root for it would close an import cycle (the root imports the wiring, which imports
the runtime), which ``tests/repo/test_layering.py`` refuses."""

__version__ = "0.1.0"
