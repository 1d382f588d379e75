"""dep_compile: the ``kimi_dep`` torch.compile backend for Kimi K3 / K3.1 decode at DEP.

Importing this package imports nothing GPU-only. The backend is registered through the
``torch_dynamo_backends`` entry point, so ``torch.compile(model, backend="kimi_dep")`` works
without importing it first.
"""

__version__ = "0.1.0"

__all__ = ["options", "last_report", "reports"]


def options(**kw):
    """Validated ``kimi_dep`` options: ``torch.compile(model, backend="kimi_dep",
    options=dep_compile.options(front_max=32))``, or ``compilation_config(dep_compile.options(...))``.

    Checks every name and value at once (ValueError naming the option and the expected type) and
    returns them as the plain dict both routes take. See ``dep_compile.config.DepOptions.HELP``.
    """
    from .config import options as _options

    return _options(**kw)


def last_report():
    """The match report of the most recent ``kimi_dep`` compile (a MatchReport), or None."""
    from .debug.report import last_report as _last

    return _last()


def reports():
    """Every match report of this process, oldest first."""
    from .debug.report import all_reports

    return all_reports()
