"""HF transformers checkpoints: load_hf / save_hf, one layout module per model_type, tokenizers."""
