"""DepOptions: the typed form of ``torch.compile(..., backend="kimi_dep", options={...})``."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from . import tactics
from .ops.sparse_mla import SPARSE_MLA_KERNELS

KINDS = ("dsa", "kda", "moe")
DEP_KINDS = KINDS  # kinds rewritten by default; MLA is never rewritten
FRONT_MAX = 64  # MoE batches above this many rows keep the stock path
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
MAX_VERIFY_Q = 8  # verify steps beyond this many tokens per request are prefill-shaped


# Options that put every projection on cuBLAS (torch.mm): the rewritten ops then run the same
# kernels in the same order as stock, so pattern-only results match stock eager to the bit.
CUBLAS_ONLY = {"projection_tables": {name: {} for name in tactics.DEP_PROJECTION}, "oproj_table": {}}


@dataclasses.dataclass(frozen=True)
class DepOptions:
    """Every option the backend takes; ``from_dict`` rejects unknown names and bad values."""

    kinds: tuple[str, ...] = DEP_KINDS
    projection_tables: dict = dataclasses.field(default_factory=lambda: dict(tactics.DEP_PROJECTION))
    oproj_table: dict = dataclasses.field(default_factory=lambda: dict(tactics.DEP_OPROJ))
    front_max: int = FRONT_MAX
    batches: tuple[int, ...] = DEFAULT_BATCHES
    max_q: int = MAX_VERIFY_Q
    moe_top_k: int = 16
    sparse_mla: str = "auto"
    dump_dir: str | None = None
    inductor: bool = True
    inductor_config: dict = dataclasses.field(default_factory=dict)

    HELP = {
        "kinds": "subset of ('dsa', 'kda', 'moe') to rewrite; MLA is never rewritten",
        "projection_tables": "{'dsa_qkv_a_g_index'|'kda_in_proj'|'moe_front': {max_rows: SplitK|'cublas'}}",
        "oproj_table": "{max_rows: SplitK|'cublas'} for the 7168 x 12288 o_proj",
        "front_max": "MoE batches above this many rows run the stock path (FRONT_MAX)",
        "batches": "the batch sizes ('wide') the report lists tactics for",
        "max_q": "largest verify q (tokens per request) rewritten; larger steps are prefill-shaped",
        "moe_top_k": "the routed top-k a MoE must have to be rewritten (K3: 16)",
        "sparse_mla": "DSA sparse-MLA kernel: 'auto' (FlashInfer where it runs, else Triton), 'triton', 'flashinfer'"
                      " (a compile error where it cannot run)",
        "dump_dir": "write graphs, match reports and near misses here (or $DEP_COMPILE_DUMP_DIR)",
        "inductor": "False: return the rewritten graph without Inductor (pattern-only mode)",
        "inductor_config": "Inductor config patches passed to compile_fx",
    }

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> "DepOptions":
        options = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            listing = "\n".join(f"  {n}: {cls.HELP[n]}" for n in valid)
            raise ValueError(f"kimi_dep: unknown option(s) {unknown}; valid options:\n{listing}")
        if "dump_dir" not in options and os.environ.get("DEP_COMPILE_DUMP_DIR"):
            options["dump_dir"] = os.environ["DEP_COMPILE_DUMP_DIR"]
        opts = cls(**options)
        opts._check()
        return opts

    def _bad(self, name: str, value: Any) -> ValueError:
        return ValueError(f"kimi_dep: bad value {value!r} for option {name!r}; expected {self.HELP[name]}")

    def _check(self) -> None:
        kinds = self.kinds
        if isinstance(kinds, str) or not all(k in KINDS for k in kinds):
            raise self._bad("kinds", kinds)
        object.__setattr__(self, "kinds", tuple(kinds))
        tables = {}
        for name, table in dict(self.projection_tables).items():
            if name not in tactics.DEP_PROJECTION:
                raise self._bad("projection_tables", name)
            tables[name] = tactics.validate_table(table, f"projection_tables[{name!r}]")
        object.__setattr__(self, "projection_tables", {**tactics.DEP_PROJECTION, **tables})
        object.__setattr__(self, "oproj_table", tactics.validate_table(self.oproj_table, "oproj_table"))
        for name in ("front_max", "max_q", "moe_top_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise self._bad(name, v)
        if not all(isinstance(b, int) and b >= 1 for b in self.batches):
            raise self._bad("batches", self.batches)
        object.__setattr__(self, "batches", tuple(sorted(set(self.batches))))
        for name in ("inductor",):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(name, getattr(self, name))
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise self._bad("dump_dir", self.dump_dir)
        if not isinstance(self.inductor_config, dict):
            raise self._bad("inductor_config", self.inductor_config)
        if self.sparse_mla not in SPARSE_MLA_KERNELS:
            raise self._bad("sparse_mla", self.sparse_mla)

    def fingerprint(self) -> str:
        """A stable text of every option that changes the rewritten graph (for uuid())."""
        keep = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("dump_dir",)}
        return repr(sorted((k, repr(v)) for k, v in keep.items()))
