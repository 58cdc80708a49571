"""Vocabularies: text <-> ids (SentencePiece, bytes, WordPiece, byte-level BPE)."""
