"""The preset studies, one module each; importing this package registers them all."""
from t5lite.study.presets import (bert_ablations, distillation, electra_vs_mlm,  # noqa: F401
                                  modifications, peft_vs_full, pretrain_vs_scratch,
                                  switch_vs_dense, t5_objectives)
