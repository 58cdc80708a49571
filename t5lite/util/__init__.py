"""Utilities below every layer that are not data code: atomic writes, argument checks."""
