"""t5lite's own accelerator kernels (Pallas), below the attention layer that chooses them
(t5lite.models.attention_kernels)."""
