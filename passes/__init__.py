"""dep_compile.passes: find the stock DSA, KDA and MoE subgraphs and rewrite them into kimi_dep ops.

One family per file (``dsa``, ``kda``, ``moe``; ``mla`` only reports), shared matching helpers in
``fx_match``, the pass base and packing in ``base``, and ``manager`` running them in order.
"""
