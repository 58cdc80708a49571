"""The preset studies, one module each; importing this package registers them all."""
from t5lite.study.presets import electra_vs_mlm, modifications, pretrain_vs_scratch  # noqa: F401
