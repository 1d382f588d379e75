"""dep_compile.passes: find the stock DSA, KDA and MoE subgraphs and rewrite them into kimi_dep ops.

One family per file (``dsa``, ``kda``, ``moe``; ``attn_res`` the glue; ``mla`` only reports); the graph
read in three levels (``calls``: canonical calls, ``walkers``: values followed through one piece of math,
``trees``: expressions of several calls); ``base`` the pass base and the one commit path, ``validate``
the family-blind probe, ``functionalized`` post-grad replacements, and ``manager`` running them in order.
"""
