"""Top-level handle for vLLM: ``--compilation-config '{"inductor_passes": {"post_grad_custom_post_pass":
"dep_compile_vllm.kimi_dep_pass"}, "use_inductor_graph_partition": true}'``.

vLLM resolves the name with ``__import__("dep_compile_vllm").__dict__["kimi_dep_pass"]``, so the
instance must live in a top-level module; this one exists for that alone (and imports vllm, which
``import dep_compile`` never does).
"""

from dep_compile.integrations.vllm import KimiDepInductorPass, compilation_config, pack_model_weights

kimi_dep_pass = KimiDepInductorPass()

__all__ = ["kimi_dep_pass", "KimiDepInductorPass", "compilation_config", "pack_model_weights"]
