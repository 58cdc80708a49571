"""The embedded default corpus: docstrings and reference topics of the Python standard library.

Real English prose that every Python install ships (docstrings, and the language
reference topics behind `help()` in pydoc_data), so demos and tests need no download.
Documents are deterministic for a given Python version (sorted by qualified name).
"""
from __future__ import annotations

import importlib
import inspect
import warnings

# Pure-Python modules with rich docstrings and no import side effects.
MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs",
    "collections", "colorsys", "concurrent.futures", "configparser", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "doctest", "email",
    "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext",
    "glob", "gzip", "hashlib", "heapq", "hmac", "html", "html.parser", "http.client",
    "http.cookiejar", "http.server", "imaplib", "inspect", "io", "ipaddress", "itertools",
    "json", "logging", "lzma", "mailbox", "mimetypes", "netrc", "numbers", "operator",
    "optparse", "os", "pathlib", "pdb", "pickle", "pkgutil", "platform", "plistlib",
    "poplib", "pprint", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "trace", "traceback", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "wave", "weakref", "xml.dom.minidom", "zipfile", "zoneinfo",
)
MIN_CHARS = 200  # shorter docstrings are mostly one-line stubs


def _members(module):
  """(qualified name, object) for the module, its public classes, functions and methods."""
  yield module.__name__, module
  for name, obj in sorted(vars(module).items()):
    if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
      continue
    yield f"{module.__name__}.{name}", obj
    if inspect.isclass(obj):
      for attr, member in sorted(vars(obj).items()):
        if not attr.startswith("_") and callable(member):
          yield f"{module.__name__}.{name}.{attr}", member


def stdlib_documents() -> list[dict[str, str]]:
  """[{'name': 'json.dumps', 'text': <cleaned docstring>}, ...], sorted, deduplicated."""
  seen, documents = set(), []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # deprecated modules warn on import
    for module_name in MODULES:
      try:
        module = importlib.import_module(module_name)
      except ImportError:  # e.g. a Python built without some optional module
        continue
      for name, obj in _members(module):
        doc = inspect.cleandoc(obj.__doc__) if isinstance(getattr(obj, "__doc__", None), str) else ""
        if len(doc) >= MIN_CHARS and doc not in seen:
          seen.add(doc)
          documents.append({"name": name, "text": doc})
  try:
    from pydoc_data.topics import topics  # the reference manual sections help() shows
  except ImportError:
    topics = {}
  documents.extend({"name": f"pydoc_topics.{key}", "text": text.strip()}
                   for key, text in topics.items() if len(text.strip()) >= MIN_CHARS)
  return sorted(documents, key=lambda d: d["name"])
