"""The preset studies, one module each; importing this package registers them all."""
from t5lite.study.presets import (bert_ablations, electra_vs_mlm, modifications,  # noqa: F401
                                  pretrain_vs_scratch)
