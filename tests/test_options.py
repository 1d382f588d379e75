"""``dep_compile.options(**kw)`` (checked at once, a plain dict both compile routes take), the
``validate`` option, and the ``explain`` CLI's argument checks (before anything is built)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import dep_compile
import dep_compile.__main__ as cli
from dep_compile.config import DepOptions
from dep_compile.tactics import DEP_OPROJ, DEP_PROJECTION, SplitK

# ---------------------------------------------------------------------------------------------
# dep_compile.options
# ---------------------------------------------------------------------------------------------


def test_options_is_exported():
    assert "options" in dep_compile.__all__ and callable(dep_compile.options)


def test_options_returns_the_plain_dict_given():
    assert dep_compile.options() == {}
    kw = dict(kinds=("dsa", "moe"), front_max=32, max_q=4, batches=[1, 8], validate=False,
              oproj_table={16: SplitK(2), 64: "cublas"}, inductor=False, inductor_config={"max_autotune": False})
    opts = dep_compile.options(**kw)
    assert type(opts) is dict and opts == kw
    # the backend's own reading of it: the same typed options as the dict route
    typed = DepOptions.from_dict(opts)
    assert typed == DepOptions.from_dict(dict(kw))
    assert typed.kinds == ("dsa", "moe") and typed.front_max == 32 and typed.validate is False
    assert typed.fingerprint() != DepOptions.from_dict({}).fingerprint()


@pytest.mark.parametrize("kw, message", [
    ({"front_max": "64"}, "kimi_dep: front_max: expected an int, got '64'"),
    ({"max_q": "4"}, "kimi_dep: max_q: expected an int, got '4'"),
    ({"moe_top_k": 16.0}, "kimi_dep: moe_top_k: expected an int, got 16.0"),
    ({"front_max": True}, "kimi_dep: front_max: expected an int, got True"),
    ({"front_max": 0}, "kimi_dep: front_max: expected an int >= 1, got 0"),
    ({"validate": "false"}, "kimi_dep: validate: expected a bool, got 'false'"),
    ({"validate": 0}, "kimi_dep: validate: expected a bool, got 0"),
    ({"inductor": 1}, "kimi_dep: inductor: expected a bool, got 1"),
    ({"attn_res_ahead": "yes"}, "kimi_dep: attn_res_ahead: expected a bool, got 'yes'"),
    ({"kinds": "dsa"}, "kimi_dep: kinds: expected a tuple or list of ('dsa', 'kda', 'moe', 'attn_res')"),
    ({"kinds": ("dsa", "mla")}, "kimi_dep: kinds: expected a subset of ('dsa', 'kda', 'moe', 'attn_res')"),
    ({"batches": 8}, "kimi_dep: batches: expected a tuple or list of ints >= 1, got 8"),
    ({"batches": ("1", 2)}, "kimi_dep: batches: expected a tuple or list of ints >= 1, got ('1', 2)"),
    ({"sparse_mla": "flashmla"}, "kimi_dep: sparse_mla: expected one of 'auto', 'triton', 'flashinfer', got 'flashmla'"),
    ({"dump_dir": 3}, "kimi_dep: dump_dir: expected a str or os.PathLike (or None), got 3"),
    ({"inductor_config": [("max_autotune", True)]}, "kimi_dep: inductor_config: expected a dict"),
    ({"oproj_table": [(16, "cublas")]}, "kimi_dep: oproj_table: expected a dict {max_rows: SplitK(...) | 'cublas'}"),
    ({"oproj_table": {"16": "cublas"}}, "kimi_dep: oproj_table bin: expected an int (max rows), got '16'"),
    ({"oproj_table": {16: {"split_k": 2, "blockn": 64}}}, "kimi_dep: oproj_table: SplitK.__init__() got an unexpected"),
    ({"projection_tables": {"kda_in_proj": {4: "splitk"}}},
     "kimi_dep: projection_tables['kda_in_proj']: bin 4 has tactic 'splitk'"),
    ({"projection_tables": {"o_proj": {}}}, "kimi_dep: projection_tables: expected keys among"),
    ({"projection_tables": None}, "kimi_dep: projection_tables: expected a dict"),
])
def test_options_reject_bad_values_at_once_with_the_expected_type(kw, message):
    with pytest.raises(ValueError) as e:
        dep_compile.options(**kw)
    assert str(e.value).startswith(message), str(e.value)
    # the backend's dict route raises the same
    with pytest.raises(ValueError) as e2:
        DepOptions.from_dict(kw)
    assert str(e2.value) == str(e.value)


def test_options_reject_unknown_names_listing_the_valid_ones():
    with pytest.raises(ValueError) as e:
        dep_compile.options(front_maxx=4)
    msg = str(e.value)
    assert msg.startswith("kimi_dep: unknown option(s) ['front_maxx']; valid options:"), msg
    assert f"\n  validate: {DepOptions.HELP['validate']}" in msg


def test_validate_option():
    assert DepOptions().validate is True and DepOptions.from_dict({}).validate is True
    assert DepOptions.HELP["validate"] == (
        "run each matched layer's stock subgraph and its replacement on small random inputs at compile time and "
        "keep the rewrite only if they agree (translation validation); False skips that check, so a matching bug "
        "could rewrite a layer wrongly with no message")
    off = DepOptions.from_dict(dep_compile.options(validate=False))
    assert off.validate is False
    assert off.fingerprint() != DepOptions.from_dict({}).fingerprint()  # a different rewrite: a different uuid


def test_sets_of_kinds_normalize_to_a_stable_order():
    assert DepOptions.from_dict({"kinds": {"moe", "dsa"}}).kinds == ("dsa", "moe")
    assert DepOptions.from_dict({"kinds": ["moe", "dsa"]}).kinds == ("moe", "dsa")  # a sequence keeps its order


def test_from_dict_rejects_a_non_dict():
    with pytest.raises(ValueError, match="options: expected a dict"):
        DepOptions.from_dict([("front_max", 4)])


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.a(x))


def test_options_through_torch_compile():
    model, x = _Tiny(), torch.randn(3, 8)
    before = len(dep_compile.reports())
    with torch.no_grad():
        out = torch.compile(model, backend="kimi_dep", fullgraph=True,
                            options=dep_compile.options(inductor=False, validate=False, front_max=8))(x)
        torch.testing.assert_close(out, model(x))
    assert len(dep_compile.reports()) == before + 1
    assert dep_compile.last_report().options == DepOptions.from_dict(
        {"inductor": False, "validate": False, "front_max": 8}).fingerprint()


def test_options_for_the_post_grad_pass():
    """What ``compilation_config(options)`` hands vLLM: the pass built from the options (here without
    vllm: its base class, which holds the options dict and hashes it into ``uuid()``)."""
    from dep_compile.passes.manager import DepPostGradPass

    p = DepPostGradPass(dep_compile.options(front_max=32))
    assert p.options == {"front_max": 32}
    assert p.uuid() == DepPostGradPass({"front_max": 32}).uuid() != DepPostGradPass().uuid()


# ---------------------------------------------------------------------------------------------
# python -m dep_compile explain / dep-compile
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if ``explain`` would build or compile anything."""
    def explode(*a, **k):
        raise AssertionError("explain() ran: the arguments were not checked first")

    monkeypatch.setattr(cli, "explain", explode)


@pytest.mark.parametrize("args, message", [
    (["--preset", "k4-small"], "unknown --preset 'k4-small'; valid: k3, k31, k3-small, k31-small, mixed-small"),
    (["--kinds", "dsa,mla"], "unknown --kinds 'mla'; valid: a comma-separated subset of dsa,kda,moe,attn_res (MLA is never rewritten)"),
    (["--kinds", "dsa,attn,kda,x"], "unknown --kinds 'attn', 'x'; valid: a comma-separated subset of dsa,kda,moe,attn_res"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--q", "-1"], "--q must be >= 1, got -1"),
])
def test_explain_rejects_bad_arguments_before_building(args, message, no_build, capsys):
    assert cli.main(["explain", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"dep-compile explain: error: {message}\n", err


def test_explain_accepts_good_arguments(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "explain", lambda *a: seen.append(a) or 0)
    assert cli.main(["explain", "--preset", "mixed-small", "--kinds", "kda, moe,kda,", "--q", "2", "--batch", "3"]) == 0
    assert seen == [("mixed-small", ("kda", "moe"), None, 2, 3)]
    assert cli.main(["explain"]) == 0 and seen[-1] == ("k31-small", ("dsa", "kda", "moe"), None, 1, 2)


def test_help_names_dep_compile_and_every_argument(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: dep-compile ")
    with pytest.raises(SystemExit):
        cli.main(["explain", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: dep-compile explain ")
    for arg, help_text in [("--preset", "k31-small"), ("--kinds", "dsa,kda,moe"), ("--dump", "dump directory"),
                           ("--q", "tokens per request"), ("--batch", "requests in the step")]:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(arg + " "))
        assert help_text in line, line


def test_explain_bad_preset_in_a_subprocess():
    proc = subprocess.run([sys.executable, "-m", "dep_compile", "explain", "--preset", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == ["dep-compile explain: error: unknown --preset 'nope'; valid: k3, k31, k3-small, "
                                        "k31-small, mixed-small"], proc.stderr


def test_tactic_tables_by_device():
    """Unset tables: the measured H200 ones on CUDA, none (torch.mm) on CPU; a table set in the options
    applies on every device, also when it equals the measured one."""
    plain = DepOptions.from_dict(None)
    assert plain.tables_for("cuda") == (DEP_PROJECTION, DEP_OPROJ)
    assert plain.tables_for(torch.device("cpu")) == ({name: {} for name in DEP_PROJECTION}, {})
    given = DepOptions.from_dict({"projection_tables": DEP_PROJECTION, "oproj_table": DEP_OPROJ})
    assert given.tables_for("cpu") == given.tables_for("cuda")
    assert all(given.tables_for("cpu")[0][name] for name in DEP_PROJECTION) and given.tables_for("cpu")[1]
    one = DepOptions.from_dict({"projection_tables": {"kda_in_proj": {2: SplitK(2)}}})
    proj, oproj = one.tables_for("cpu")
    assert proj["kda_in_proj"] == {2: SplitK(2)} and proj["moe_front"] == {} and oproj == {}
    assert one.tables_for("cuda")[0]["moe_front"] == DEP_PROJECTION["moe_front"]
