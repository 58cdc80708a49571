"""Self-supervised objectives: T5 span corruption, BERT-style masking, prefix LM, BART
infilling, sentence pairs, and the preprocessor chains that apply them in a task."""
