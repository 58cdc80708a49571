"""jax.export serving artifacts and their stand-alone loader."""
