"""Where examples come from: in-memory and file readers (text, JSONL, TSV, TFRecord,
array_record via TFDS), file access, and the embedded standard-library corpus."""
