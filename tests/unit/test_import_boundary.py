"""The library never imports the research code in megatron_rl.experiments (imports point from
experiments to the library only); the CLI reaches `megatron-rl toy` through an entry point."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
EXPERIMENTS = "megatron_rl.experiments"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of everything `module` imports, relative imports resolved; a name
    imported from a package counts as its submodule (`from megatron_rl import experiments`)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.append((node.lineno, node.args[0].value))
    return found


def _library_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "experiments" not in p.relative_to(PACKAGE).parts)


def test_library_modules_do_not_import_experiments():
    files = _library_files()
    assert len(files) > 20 and PACKAGE / "cli.py" in files
    offenders = []
    for path in files:
        name = _module_name(path)
        for line, imported in _imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py"):
            if imported == EXPERIMENTS or imported.startswith(EXPERIMENTS + "."):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}")
    assert not offenders, "library modules import megatron_rl.experiments:\n" + "\n".join(offenders)


@pytest.mark.parametrize("source", [
    "from megatron_rl.experiments.toy import main",
    "import megatron_rl.experiments.sweep as ex",
    "from megatron_rl import experiments",
    "from .experiments import toy",
    "from ..experiments.tiny_model import make_char_model",
    "importlib.import_module('megatron_rl.experiments.toy')",
])
def test_scan_catches_every_import_form(source):
    module = "megatron_rl.models.gpt" if source.startswith("from ..") else "megatron_rl.cli"
    names = [n for _, n in _imported(ast.parse(source), module, False)]
    assert any(n == EXPERIMENTS or n.startswith(EXPERIMENTS + ".") for n in names), names


def test_cli_lists_every_command_from_entry_points(capsys):
    from megatron_rl import cli

    found = cli.commands()
    assert {"train", "eval", "convert", "toy"} <= set(found)
    assert found["toy"].value == "megatron_rl.experiments.toy:main"
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "eval", "convert", "toy"):
        line = next(l for l in out.splitlines() if l.split()[:1] == [name])
        assert len(line.split()) > 2, line  # a description follows the name
    assert cli.main(["no-such-command"]) == 2
