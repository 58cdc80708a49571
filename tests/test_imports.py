"""t5lite's imports go only down its layers, and make no cycle.

The layers are the table in docs/architecture.md (one row a layer, bottom up, each naming its
packages): a module may import its own package and the packages of lower layers, nothing
else. No import cycles either, between files or between subpackages (data, models, ...).
Imports inside functions count as well: a cycle moved into a function still ties the two
modules together, it only turns an import-time failure into a run-time one. Relative imports
are resolved, and importing a package counts as importing its __init__.py.
"""
from __future__ import annotations

import ast
import collections
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "t5lite"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

Edges = dict[str, dict[str, int]]  # importer -> {imported module: line of the first import}


def module_files(package: pathlib.Path) -> dict[str, pathlib.Path]:
  """Every module of `package` by dotted name; a subpackage is its __init__.py.

  Example: {'t5lite': .../t5lite/__init__.py, 't5lite.data': .../data/__init__.py,
  't5lite.data.pipeline': .../data/pipeline.py, ...}
  """
  modules = {}
  for path in sorted(package.rglob("*.py")):
    parts = path.relative_to(package.parent).with_suffix("").parts
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return modules


def _targets(node: ast.AST, package: str) -> list[str]:
  """The dotted names an import statement may load: `from a.b import c` gives a.b and a.b.c
  (c may be a module); `from .x import y` inside package p.q gives p.q.x and p.q.x.y."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if not isinstance(node, ast.ImportFrom):
    return []
  base = node.module or ""
  if node.level:
    parts = package.split(".")
    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
  return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_edges(modules: dict[str, pathlib.Path]) -> Edges:
  """Which module imports which, from every import statement at any depth (ast.walk)."""
  edges: Edges = {name: {} for name in modules}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
      for target in _targets(node, package):
        while target and target not in modules:  # a.b.Name -> a.b; outside the package -> ""
          target = target.rpartition(".")[0]
        # A module's own enclosing packages are being imported already when it runs.
        if target and target != name and not name.startswith(target + "."):
          edges[name].setdefault(target, node.lineno)
  return edges


def package_edges(modules: dict[str, pathlib.Path], edges: Edges) -> Edges:
  """Edges between top-level subpackages (t5lite.data -> t5lite.models), each with one of
  the file imports behind it; top-level modules (t5lite/demo.py) are not subpackages."""
  def subpackage(name: str) -> str | None:
    top = ".".join(name.split(".")[:2])
    return top if top in modules and modules[top].name == "__init__.py" else None
  out: Edges = collections.defaultdict(dict)
  for importer, targets in edges.items():
    for target in targets:
      a, b = subpackage(importer), subpackage(target)
      if a and b and a != b:
        out[a].setdefault(b, f"{importer} imports {target}")
  return dict(out)


def cycles(graph: Edges) -> list[tuple[list[str], set[str]]]:
  """(one shortest cycle, every node) per strongly connected component of several nodes.

  Example: {a: {b}, b: {a, c}, c: {}} -> [([a, b], {a, b})] (a -> b -> a).
  """
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  components: list[set[str]] = []

  def visit(node: str) -> None:  # Tarjan's algorithm
    index[node] = low[node] = len(index)
    stack.append(node)
    for successor in graph.get(node, {}):
      if successor not in index:
        visit(successor)
        low[node] = min(low[node], low[successor])
      elif successor in stack:
        low[node] = min(low[node], index[successor])
    if low[node] == index[node]:
      component = set()
      while True:
        member = stack.pop()
        component.add(member)
        if member == node:
          break
      if len(component) > 1:
        components.append(component)

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return [(_shortest_cycle(graph, component), component) for component in components]


def _shortest_cycle(graph: Edges, component: set[str]) -> list[str]:
  """A shortest path from the component's first node back to itself, inside the component."""
  start = min(component)
  came_from: dict[str, str] = {}
  frontier = collections.deque([start])
  while frontier:
    node = frontier.popleft()
    for successor in sorted(graph.get(node, {})):
      if successor == start:
        path = [node]
        while path[-1] != start:
          path.append(came_from[path[-1]])
        return path[::-1]
      if successor in component and successor not in came_from:
        came_from[successor] = node
        frontier.append(successor)
  raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _describe(found: tuple[list[str], set[str]], graph: Edges, where) -> str:
  cycle, component = found
  steps = [f"  {where(a, b, graph[a][b])}" for a, b in zip(cycle, cycle[1:] + cycle[:1])]
  others = sorted(component - set(cycle))
  also = f"\n  (tied into the same cycles: {', '.join(others)})" if others else ""
  return " -> ".join(cycle + cycle[:1]) + "\n" + "\n".join(steps) + also


def check(package: pathlib.Path) -> list[str]:
  """Every cycle in `package`, described with the imports that make it (empty: none)."""
  modules = module_files(package)
  edges = import_edges(modules)
  root = package.parent
  def file_line(a: str, b: str, line: int) -> str:
    return f"{modules[a].relative_to(root)}:{line} imports {b}"
  found = [f"file cycle: {_describe(c, edges, file_line)}" for c in cycles(edges)]
  between = package_edges(modules, edges)
  found += [f"package cycle: {_describe(c, between, lambda a, b, why: why)}"
            for c in cycles(between)]
  return found


def test_t5lite_has_no_import_cycles():
  found = check(PACKAGE)
  assert not found, "import cycles in t5lite:\n" + "\n".join(found)


def test_the_check_sees_cycles_in_functions_relative_imports_and_packages(tmp_path):
  package = tmp_path / "pkg"
  for folder in ("low", "high"):
    (package / folder).mkdir(parents=True)
    (package / folder / "__init__.py").write_text("")
  (package / "__init__.py").write_text("")
  (package / "a.py").write_text("from pkg import b\n")
  (package / "b.py").write_text("def f():\n  from . import a\n")  # hidden in a function
  (package / "low" / "base.py").write_text("import os\n")
  (package / "low" / "uses_high.py").write_text("def f():\n  from ..high import top\n")
  (package / "high" / "top.py").write_text("from pkg.low.base import os\n")
  found = check(package)
  assert len(found) == 2, found
  assert found[0].startswith("file cycle: pkg.a -> pkg.b -> pkg.a\n  pkg/a.py:1 imports pkg.b")
  assert "pkg/b.py:2 imports pkg.a" in found[0]
  assert found[1].startswith("package cycle: pkg.high -> pkg.low -> pkg.high")
  assert "pkg.low.uses_high imports pkg.high" in found[1]


def layer_table(markdown: str) -> dict[str, int]:
  """{top-level part of t5lite: layer} from the rows `| N | `t5lite/x/`, `t5lite/y.py` | ... |`.

  Example: '| 2 | `t5lite/models/`, `t5lite/data/` | ... |' -> {'models': 2, 'data': 2}.
  """
  layers = {}
  for number, packages in re.findall(r"^\|\s*(\d+)\s*\|([^|]*)\|", markdown, re.M):
    for name in re.findall(r"`t5lite/(\w+)(?:/|\.py)`", packages):
      layers[name] = int(number)
  return layers


def upward_imports(package: pathlib.Path, layers: dict[str, int]) -> list[str]:
  """Every import from one top-level part of `package` into another part that is not on a
  lower layer (also a part missing from the table), as 'file:line imports module (a -> b)'."""
  modules = module_files(package)
  root = package.parent
  def part(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"
  found, seen = [], set()
  for importer, targets in import_edges(modules).items():
    for target, line in targets.items():
      a, b = part(importer), part(target)
      if a == b or (importer, b) in seen:  # one line per importing file and imported part
        continue
      seen.add((importer, b))
      where = f"{modules[importer].relative_to(root)}:{line} imports {target}"
      if a not in layers or b not in layers:
        found.append(f"{where} ({a if a not in layers else b} is in no layer of the table)")
      elif layers[b] >= layers[a]:
        found.append(f"{where} (layer {layers[a]} {a} -> layer {layers[b]} {b})")
  return found


def test_imports_go_only_down_the_layer_table():
  layers = layer_table(ARCHITECTURE.read_text(encoding="utf-8"))
  assert {"errors", "models", "data", "train", "cli"} <= set(layers), layers
  found = upward_imports(PACKAGE, layers)
  assert not found, "imports against docs/architecture.md's layers:\n" + "\n".join(found)


def test_the_layer_check_sees_upward_and_sideways_imports(tmp_path):
  package = tmp_path / "pkg"
  for folder in ("low", "mid", "side", "high"):
    (package / folder).mkdir(parents=True)
    (package / folder / "__init__.py").write_text("")
  (package / "__init__.py").write_text("")
  (package / "low" / "a.py").write_text("def f():\n  from pkg.high import b\n")  # up
  (package / "mid" / "c.py").write_text("from pkg.low import a\nfrom ..side import d\n")
  (package / "side" / "d.py").write_text("import os\n")
  (package / "high" / "b.py").write_text("from pkg.mid import c\nfrom pkg.extra import e\n")
  (package / "extra.py").write_text("")
  table = ("| layer | package |\n| --- | --- |\n| 0 | `t5lite/low/` |\n"
           "| 1 | `t5lite/mid/`, `t5lite/side/` |\n| 2 | `t5lite/high/` |\n")
  layers = layer_table(table)
  assert layers == {"low": 0, "mid": 1, "side": 1, "high": 2}
  found = upward_imports(package, layers)
  assert found == [
      "pkg/high/b.py:2 imports pkg.extra (extra is in no layer of the table)",
      "pkg/low/a.py:2 imports pkg.high (layer 0 low -> layer 2 high)",
      "pkg/mid/c.py:2 imports pkg.side (layer 1 mid -> layer 1 side)",
  ], found
