"""Pure planning: flags, the owner map, the flush plan, the probe line and the sizing arithmetic.

Why apart: these decide what every rank does and must agree across ranks by construction, so they are plain
Python over plain data, tested without processes. Nothing here imports torch.distributed, deepspeed or cupy
(``tests/repo/test_layering.py`` reads the imports to keep it so).
"""
