"""Feature converters: task examples -> fixed-length model rows (packing, head rows)."""
