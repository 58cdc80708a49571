"""Moving models in and out of t5lite: HF transformers (hf.py, hf_tokenizer.py), params-only
MODEL_DIRs (params_only.py), T5X checkpoints (t5x.py) and jax.export serving artifacts
(serving.py, read by the stand-alone serving_loader.py). The CLI verbs are export_cli.py and
import_cli.py."""
from t5lite.export.hf import load_hf, save_hf

__all__ = ["load_hf", "save_hf"]
