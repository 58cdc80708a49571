"""Moving models in and out of t5lite: HF transformers layout (serving export arrives later)."""
from t5lite.export.hf import load_hf, save_hf

__all__ = ["load_hf", "save_hf"]
