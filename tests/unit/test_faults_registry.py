"""docs/faults.md names the fault-injection tests (`pytest -m faults`, the marker given by
tests/conftest.py): every name there is a test function that exists, so the page and the marker
cannot drift from the suite."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_fault_test_named_in_the_docs_exists():
    ids = re.findall(r"`(tests/[\w/]+\.py::\w+)`", (REPO / "docs" / "faults.md").read_text())
    assert len(ids) >= 30
    missing = []
    for node in ids:
        path, name = node.split("::")
        tree = ast.parse((REPO / path).read_text())
        if name not in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}:
            missing.append(node)
    assert not missing, f"docs/faults.md names tests that do not exist: {missing}"
