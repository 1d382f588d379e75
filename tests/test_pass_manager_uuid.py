"""The pass manager's uuid(): stable across processes, changed by options (it keys Inductor's FX cache)."""

from __future__ import annotations

import subprocess
import sys

from dep_compile.config import DepOptions
from dep_compile.passes.manager import DepPassManager
from dep_compile.tactics import SplitK

CODE = "from dep_compile.config import DepOptions; from dep_compile.passes.manager import DepPassManager; " \
       "print(DepPassManager(DepOptions.from_dict({})).uuid())"


def test_uuid_stable_across_processes_and_option_sensitive():
    here = DepPassManager(DepOptions.from_dict({})).uuid()
    there = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there and len(here) == 64
    assert DepPassManager(DepOptions.from_dict({"front_max": 32})).uuid() != here
    assert DepPassManager(DepOptions.from_dict({"oproj_table": {8: SplitK(2)}})).uuid() != here
    assert DepPassManager(DepOptions.from_dict({"kinds": ("kda",)})).uuid() != here
    # the dump directory does not change the rewritten graph, so it does not change the key
    assert DepPassManager(DepOptions.from_dict({"dump_dir": "/tmp/x"})).uuid() == here


def test_uuid_covers_what_compiled_graphs_bake_in():
    """A change to a Prepared* layer, the registry or a pass must change the key (not only passes/*.py)."""
    names = {f.name for f in DepPassManager.hashed_files()}
    assert {"dsa.py", "kda.py", "moe.py", "projection.py", "registry.py", "tactics.py", "calls.py", "walkers.py",
            "trees.py", "validate.py", "base.py"} <= names
    assert sum(f.name == "dsa.py" for f in DepPassManager.hashed_files()) == 2  # passes/dsa.py and ops/dsa.py
