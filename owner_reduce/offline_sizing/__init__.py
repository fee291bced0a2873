"""Offline sizing: DeepSpeed's own ZeRO partitioning on a fake process group, for models (GPT presets) too large
to train here, feeding the pure arithmetic in ``planning.sizing``. Used by ``scripts/size_the_win.py``.
"""
