"""DeepSpeed wiring: reading the optimizer's tables, install/activation, the surface check, the compile pass,
the graph ops and the CPU-only fixes.

Why apart: this is the only layer that touches DeepSpeed's private DeepCompile surface, which moves between
releases; keeping it here leaves the runtime and the planning free of it.
"""
