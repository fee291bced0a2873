"""Research on the cost model, beside the product and never packaged: the one published grouped measurement
(``published_check``), the candidate causes of the model's gap to it (``published_causes``) and NCCL 2.30's plan of
one group of calls (``nccl_plan``).

Why apart: no training and no sizing imports it, so it does not ship; ``scripts/size_the_win.py --check-published``
composes it with the package's sizing. It imports the product as users do (``owner_reduce.``); the product never
imports it (``tests/repo/test_layering.py``).
"""
