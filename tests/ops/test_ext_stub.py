"""megatron_rl/_C.pyi, the stub the type checker reads for the compiled extension, matches
csrc/bindings.cpp (every bound function, with its argument names) and, where the extension is
built, the signatures the extension itself reports."""
import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _stub_params() -> dict[str, list[str]]:
    tree = ast.parse((REPO / "megatron_rl" / "_C.pyi").read_text())
    return {f.name: [a.arg for a in f.args.args] for f in tree.body
            if isinstance(f, ast.FunctionDef)}


def _bound_params() -> dict[str, list[str] | None]:
    """name -> py::arg names (None where the binding names no arguments) from bindings.cpp."""
    src = (REPO / "csrc" / "bindings.cpp").read_text()
    out = {}
    for block in re.findall(r'm\.def\((.*?)\);', src, flags=re.S):
        name = re.match(r'\s*"(\w+)"', block).group(1)
        args = re.findall(r'py::arg\("(\w+)"\)', block)
        out[name] = args or None
    return out


def test_stub_names_every_binding_with_its_arguments():
    stub, bound = _stub_params(), _bound_params()
    assert bound, "no m.def in csrc/bindings.cpp"
    assert sorted(stub) == sorted(bound)
    for name, args in bound.items():
        if args is not None:
            assert stub[name] == args, name


def test_stub_matches_the_built_extension():
    pytest.importorskip("torch")
    try:
        from megatron_rl import _C
    except ImportError:
        pytest.skip("megatron_rl._C is not built")
    stub = _stub_params()
    built = [n for n in dir(_C) if not n.startswith("_")]
    assert built and set(built) <= set(stub)
    for name in built:
        # pybind11's docstring starts with the signature: name(arg: type, ...) -> type
        signature = getattr(_C, name).__doc__.strip().splitlines()[0]
        params = re.match(rf"{name}\((.*)\) ->", signature).group(1)
        names = [p.split(":")[0].strip() for p in params.split(", ")] if params else []
        assert stub[name] == names, (name, signature)
