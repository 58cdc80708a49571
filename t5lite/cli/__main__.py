"""`python -m t5lite.cli ...`: the same as the `t5lite` command."""
from t5lite.cli import console_main

console_main()
