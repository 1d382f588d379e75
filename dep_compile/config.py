"""DepOptions: the typed form of ``torch.compile(..., backend="kimi_dep", options={...})``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from . import tactics

KINDS = ("dsa", "kda", "moe", "attn_res")  # "attn_res": the AttnRes -> RMSNorm glue points
DEP_KINDS = KINDS  # kinds rewritten by default; MLA is never rewritten
FRONT_MAX = 64  # MoE batches above this many rows keep the stock path
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
MAX_VERIFY_Q = 8  # verify steps beyond this many tokens per request are prefill-shaped
SPARSE_MLA_KERNELS = ("auto", "triton", "flashinfer")  # the DSA sparse-MLA kernel choices (ops.sparse_mla)


class OptionError(RuntimeError):
    """An option the user set cannot be honoured on this machine: the compile fails with the reason
    (a forced kernel is never silently replaced, and a pass error of this kind is not a fallback)."""


# Options that put every projection on cuBLAS (torch.mm): the rewritten ops then run the same
# kernels in the same order as stock, so pattern-only results match stock eager to the bit.
CUBLAS_ONLY = {"projection_tables": {name: {} for name in tactics.DEP_PROJECTION}, "oproj_table": {}}


@dataclasses.dataclass(frozen=True)
class DepOptions:
    """Every option the backend takes; ``from_dict`` rejects unknown names and bad values."""

    kinds: tuple[str, ...] = DEP_KINDS
    projection_tables: dict = dataclasses.field(default_factory=dict)  # the tables set; the rest: tables_for
    oproj_table: dict | None = None  # None: the measured H200 table on CUDA (tables_for)
    front_max: int = FRONT_MAX
    batches: tuple[int, ...] = DEFAULT_BATCHES
    max_q: int = MAX_VERIFY_Q
    moe_top_k: int = 16
    sparse_mla: str = "auto"
    attn_res_ahead: bool = False
    dump_dir: str | None = None
    validate: bool = True
    inductor: bool = True
    inductor_config: dict = dataclasses.field(default_factory=dict)

    HELP = {
        "kinds": "subset of ('dsa', 'kda', 'moe', 'attn_res') to rewrite (attn_res: the AttnRes -> RMSNorm "
                 "points); MLA is never rewritten",
        "projection_tables": "{'dsa_qkv_a_g_index'|'kda_in_proj'|'moe_front': {max_rows: SplitK|'cublas'}}; a "
                             "projection not named: the measured H200 table on CUDA, torch.mm elsewhere (BF16 "
                             "weights; FP8 block-scaled ones run tactics.DEP_PROJECTION_FP8 on CUDA)",
        "oproj_table": "{max_rows: SplitK|'cublas'} for the 7168 x 12288 o_proj; unset: the measured H200 table on "
                       "CUDA, torch.mm elsewhere",
        "front_max": "MoE batches above this many rows run the stock path (FRONT_MAX)",
        "batches": "the batch sizes ('wide') the report lists tactics for",
        "max_q": "largest verify q (tokens per request) rewritten; larger steps are prefill-shaped",
        "moe_top_k": "the routed top-k a MoE must have to be rewritten (K3: 16)",
        "sparse_mla": "DSA sparse-MLA kernel: 'auto' (FlashInfer where it runs, else Triton), 'triton', 'flashinfer'"
                      " (a compile error where it cannot run)",
        "attn_res_ahead": "True: each fused AttnRes point also computes the next one's bank part on a side stream, "
                          "beside the sublayer between them (CUDA; passes/attn_res.link_points); off by default "
                          "(-3.5 % on the DEP32 rank's 1-request step, docs/perf.md)",
        "dump_dir": "write graphs, match reports and near misses here (or $DEP_COMPILE_DUMP_DIR)",
        "validate": "run each matched layer's stock subgraph and its replacement on small random inputs at compile"
                    " time and keep the rewrite only if they agree (translation validation); False skips that"
                    " check, so a matching bug could rewrite a layer wrongly with no message",
        "inductor": "False: return the rewritten graph without Inductor (pattern-only mode)",
        "inductor_config": "Inductor config patches passed to compile_fx",
    }

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> "DepOptions":
        """The typed options of an ``options`` dict (None: all defaults); unknown names and bad
        values raise ValueError. ``dump_dir`` falls back to ``$DEP_COMPILE_DUMP_DIR``."""
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"kimi_dep: options: expected a dict, got {type(options).__name__} {options!r}")
        options = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid), key=str)
        if unknown:
            listing = "\n".join(f"  {n}: {cls.HELP[n]}" for n in valid)
            raise ValueError(f"kimi_dep: unknown option(s) {unknown}; valid options:\n{listing}")
        if "dump_dir" not in options and os.environ.get("DEP_COMPILE_DUMP_DIR"):
            options["dump_dir"] = os.environ["DEP_COMPILE_DUMP_DIR"]
        opts = cls(**options)
        opts._check()
        return opts

    @staticmethod
    def _bad(name: str, expected: str, value: Any) -> ValueError:
        return ValueError(f"kimi_dep: {name}: expected {expected}, got {value!r}")

    def tables_for(self, device: Any, fp8: bool = False) -> tuple[dict, dict]:
        """(projection tables, o_proj table) for a layer on ``device``: the tables set in the options; for the
        others, on CUDA the measured H200 defaults (``tactics``), elsewhere none (torch.mm, so the rewritten
        ops compute what stock computes; a table set in the options runs the split-K contract in torch).
        ``fp8``: FP8 block-scaled weights, whose tables are the measured FP8 ones on CUDA and none elsewhere
        (stock's FP8 op); the options' tables are for BF16 weights."""
        cuda = getattr(device, "type", device) == "cuda"
        if fp8:
            return ({name: dict(table) if cuda else {} for name, table in tactics.DEP_PROJECTION_FP8.items()},
                    dict(tactics.DEP_OPROJ_FP8) if cuda else {})
        proj = {name: self.projection_tables.get(name, table if cuda else {})
                for name, table in tactics.DEP_PROJECTION.items()}
        oproj = self.oproj_table if self.oproj_table is not None else (tactics.DEP_OPROJ if cuda else {})
        return proj, oproj

    def _table(self, table: Any, where: str) -> dict:
        if not isinstance(table, Mapping):
            raise self._bad(where, "a dict {max_rows: SplitK(...) | 'cublas'}", table)
        for bound in table:
            if not isinstance(bound, int) or isinstance(bound, bool):
                raise self._bad(f"{where} bin", "an int (max rows)", bound)
        try:
            return tactics.validate_table(table, where)
        except (TypeError, ValueError) as e:  # a bad bin or tactic, SplitK(**{...}) with a bad field
            msg = str(e) if str(e).startswith(where) else f"{where}: {e}"
            raise ValueError(f"kimi_dep: {msg}") from None

    def _check(self) -> None:
        kinds = self.kinds
        if not isinstance(kinds, (tuple, list, set, frozenset)):
            raise self._bad("kinds", f"a tuple or list of {KINDS} (MLA is never rewritten)", kinds)
        if not all(isinstance(k, str) and k in KINDS for k in kinds):
            raise self._bad("kinds", f"a subset of {KINDS} (MLA is never rewritten)", kinds)
        if isinstance(kinds, (set, frozenset)):  # a set's order is arbitrary: keep the fingerprint stable
            kinds = [k for k in KINDS if k in kinds]
        object.__setattr__(self, "kinds", tuple(kinds))
        if not isinstance(self.projection_tables, Mapping):
            raise self._bad("projection_tables", "a dict {projection: {max_rows: SplitK(...) | 'cublas'}}",
                            self.projection_tables)
        tables = {}
        for name, table in dict(self.projection_tables).items():
            if name not in tactics.DEP_PROJECTION:
                raise self._bad("projection_tables", f"keys among {sorted(tactics.DEP_PROJECTION)}", name)
            tables[name] = self._table(table, f"projection_tables[{name!r}]")
        object.__setattr__(self, "projection_tables", tables)
        if self.oproj_table is not None:
            object.__setattr__(self, "oproj_table", self._table(self.oproj_table, "oproj_table"))
        for name in ("front_max", "max_q", "moe_top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise self._bad(name, "an int", v)
            if v < 1:
                raise self._bad(name, "an int >= 1", v)
        batches = self.batches
        if (not isinstance(batches, (tuple, list, set, frozenset))
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in batches)):
            raise self._bad("batches", "a tuple or list of ints >= 1", batches)
        object.__setattr__(self, "batches", tuple(sorted(set(batches))))
        if self.sparse_mla not in SPARSE_MLA_KERNELS:
            raise self._bad("sparse_mla", "one of " + ", ".join(map(repr, SPARSE_MLA_KERNELS)), self.sparse_mla)
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise self._bad("dump_dir", "a str or os.PathLike (or None)", self.dump_dir)
        for name in ("validate", "inductor", "attn_res_ahead"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(name, "a bool", getattr(self, name))
        if not isinstance(self.inductor_config, Mapping) or not all(isinstance(k, str) for k in self.inductor_config):
            raise self._bad("inductor_config", "a dict {config_name: value}", self.inductor_config)

    def fingerprint(self) -> str:
        """A stable text of every option that changes the rewritten graph (for uuid())."""
        keep = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("dump_dir",)}
        return repr(sorted((k, repr(v)) for k, v in keep.items()))


def options(**kw: Any) -> dict[str, Any]:
    """Validated ``kimi_dep`` options, for ``torch.compile(..., backend="kimi_dep", options=...)``
    and ``dep_compile.integrations.vllm.compilation_config(...)``.

    Checks every name and value now (an unknown name or a bad value raises ValueError naming the
    option and the expected type: ``front_max: expected an int, got '64'``) instead of at the
    first compile, and returns a plain dict of the options given (what both routes take; the
    backend turns it into a :class:`DepOptions` again). Options not given keep their defaults.
    """
    DepOptions.from_dict(kw)
    return dict(kw)
