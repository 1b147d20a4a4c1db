"""The layering of the package, checked on the source:
- the library never imports the research code in megatron_rl.experiments (imports point from
  experiments to the library only); the CLI reaches `megatron-rl toy` through an entry point;
- nothing in the library imports the training loop (megatron_rl.train is the top: it uses the
  rollout layer, rollout_queue.py, and the update, update.py, not the other way round);
- a private name (`_x`) is used only inside its own subpackage (a top-level module's: only
  inside that module), in the package (experiments included) and the tools;
- the RL maths (kl, advantages, loss, policy_losses, correction, and imports, the import-path
  resolver they use) is pure PyTorch: no Megatron, no
  torch.distributed, nothing of the package beyond each other."""
import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
TOOLS = PACKAGE.parent / "tools"
EXPERIMENTS = "megatron_rl.experiments"
TRAINING_LOOP = "megatron_rl.train"
RL_MATH = ("megatron_rl.kl", "megatron_rl.advantages", "megatron_rl.loss", "megatron_rl.correction",
           "megatron_rl.policy_losses", "megatron_rl.imports")
COMPILED = {"megatron_rl._C"}  # the compiled extension module: private by its name only


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


def test_library_modules_do_not_import_the_training_loop():
    offenders = []
    for path in _library_files():
        name = _module_name(path)
        for line, imported in _imported(ast.parse(path.read_text(), str(path)), name,
                                        path.name == "__init__.py"):
            if imported == TRAINING_LOOP or imported.startswith(TRAINING_LOOP + "."):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}")
    assert not offenders, "library modules import the training loop:\n" + "\n".join(offenders)


def _is_module(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != "megatron_rl":
        return False
    base = PACKAGE.parent.joinpath(*parts)
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _private_uses(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str, str]]:
    """(line, module, private name) for every private name of a megatron_rl module that `module`
    imports (`from megatron_rl.x import _y`) or reads off an imported module (`x._y`)."""
    found = []
    aliases: dict[str, str] = {}  # local name -> the megatron_rl module it is bound to
    for line, dotted in _imported(tree, module, is_package):
        owner, _, name = dotted.rpartition(".")
        if name.startswith("_") and not name.startswith("__") and _is_module(owner):
            found.append((line, owner, name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and _is_module(a.name):
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if _is_module(f"{node.module}.{a.name}"):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append((node.lineno, aliases[node.value.id], node.attr))
    return found


def _private_use_allowed(importer: str, owner: str, name: str) -> bool:
    if f"{owner}.{name}" in COMPILED or importer == owner:
        return True
    package = owner.rpartition(".")[0] if not (PACKAGE.parent.joinpath(*owner.split("."))
                                               / "__init__.py").exists() else owner
    return package != "megatron_rl" and importer.startswith(package + ".")


def test_private_names_stay_inside_their_package():
    files = sorted(PACKAGE.rglob("*.py")) + sorted(TOOLS.rglob("*.py"))  # experiments too
    offenders = []
    for path in files:
        name = (_module_name(path) if path.is_relative_to(PACKAGE)
                else "tools." + path.stem)
        tree = ast.parse(path.read_text(), str(path))
        for line, owner, private in _private_uses(tree, name, path.name == "__init__.py"):
            if not _private_use_allowed(name, owner, private):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line} uses "
                                 f"{owner}.{private}")
    assert not offenders, ("private names used outside their package (make them public, or "
                           "use the public function):\n" + "\n".join(offenders))


@pytest.mark.parametrize("source, module, allowed", [
    ("from megatron_rl.rollout_queue import _deal_groups", "megatron_rl.train", False),
    ("from megatron_rl import train\ntrain._microbatch", "tools.bench", False),
    ("import megatron_rl.update as u\nu._x", "megatron_rl.experiments.check", False),
    ("from megatron_rl.rollout.functions import _x", "megatron_rl.rollout.multi", True),
    ("from megatron_rl.ops.logprob_kl import _exact_backend", "megatron_rl.ops.lm_head", True),
    ("from megatron_rl import _C", "megatron_rl.ops.logprob_kl", True),
])
def test_private_name_scan_sees_each_form(source, module, allowed):
    uses = _private_uses(ast.parse(source), module, False)
    assert uses and all(_private_use_allowed(module, o, n) == allowed for _, o, n in uses), uses


def test_rl_maths_is_pure_pytorch():
    offenders = []
    for mod in RL_MATH:
        path = PACKAGE.parent.joinpath(*mod.split(".")).with_suffix(".py")
        for line, imported in _imported(ast.parse(path.read_text(), str(path)), mod, False):
            top = imported.split(".")[0]
            ours = top == "megatron_rl" and not any(
                imported == m or imported.startswith(m + ".") for m in RL_MATH)
            if (ours or top == "megatron" or imported.startswith("torch.distributed")
                    or (top not in sys.stdlib_module_names and top not in ("torch", "megatron_rl"))):
                offenders.append(f"{mod}:{line} imports {imported}")
    assert not offenders, "the RL maths imports beyond PyTorch:\n" + "\n".join(offenders)
