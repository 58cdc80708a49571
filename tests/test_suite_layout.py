"""The suite's own layout: no test module imports another test module or conftest (shared
code lives in tests/helpers/, shared fixtures in helpers/fixtures.py)."""
import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
MODULES = sorted(TESTS.glob("test_*.py"))


def forbidden_imports(source: str) -> list[str]:
  """`import test_x`, `from test_x import ...`, `import conftest`, `from conftest import ...`
  anywhere in a module (inside functions too), as 'line N: name'."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [node.module]
    else:
      continue
    for name in names:
      top = name.split(".")[0]
      if top.startswith("test_") or top == "conftest":
        found.append(f"line {node.lineno}: {name}")
  return found


def test_no_test_module_imports_another_or_conftest():
  found = {path.name: forbidden_imports(path.read_text()) for path in MODULES}
  assert not {name: lines for name, lines in found.items() if lines}, (
      "move what is shared to tests/helpers/ (fixtures: helpers/fixtures.py)")


def test_the_check_sees_every_form():
  assert forbidden_imports("import test_gin\nfrom conftest import REPO\n"
                           "def f():\n  from test_x import y\n") == [
      "line 1: test_gin", "line 2: conftest", "line 4: test_x"]
  assert forbidden_imports("from helpers import tiny\nimport testing\n") == []
