"""Where things are: the repository root (REPO) and its tests/ folder (TESTS)."""
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
