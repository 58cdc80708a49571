"""Task and mixture definitions; importing a module registers its tasks.

Installed as the package `t5lite_tasks` (PyPI's unrelated `tasks` keeps its name): import it
as `import t5lite_tasks`. The data layer and the embedded default tasks land here next.
"""

from . import c4, cnn_dailymail, embedded, glue, squad, vocab, wmt  # noqa: F401 (import = registration)
