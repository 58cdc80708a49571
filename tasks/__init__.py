"""Task and mixture definitions; importing a module registers its tasks.

Installed as the package `t5lite_tasks` (PyPI's unrelated `tasks` keeps its name): import it
as `import t5lite_tasks`. The data layer and the embedded default tasks land here next.
"""

from . import (  # noqa: F401 (import = registration)
    c4, cnn_dailymail, conll_ner, embedded, embedded_gpt, embedded_heads, embedded_pretrain,
    embedded_text_to_text, glue, glue_heads, squad, squad_heads, vocab, wmt)
