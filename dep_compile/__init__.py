"""dep_compile: the ``kimi_dep`` torch.compile backend for Kimi K3 / K3.1 decode at DEP.

Importing this package imports nothing GPU-only. The backend is registered through the
``torch_dynamo_backends`` entry point, so ``torch.compile(model, backend="kimi_dep")`` works
without importing it first.
"""

__version__ = "0.1.0"


def last_report():
    """The match report of the most recent ``kimi_dep`` compile (a MatchReport), or None."""
    from .debug.report import last_report as _last

    return _last()


def reports():
    """Every match report of this process, oldest first."""
    from .debug.report import all_reports

    return all_reports()
