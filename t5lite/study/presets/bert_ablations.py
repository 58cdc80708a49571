"""`bert_ablations`: BERT's pretraining tasks (Devlin et al. 2019, Table 5: without the
next-sentence prediction (NSP) task the finetuned scores fall a little, and a left-to-right
LM in place of the MLM falls further, most on MRPC and SQuAD; Liu et al. 2019, RoBERTa,
Table 2: MLM alone on full segments matches or beats MLM + NSP on pairs).

Arms on one encoder (gin/models/bert/*.gin), each pretrained for the same FLOPs and finetuned
alike: MLM + NSP on sentence pairs (gin/runs/stdlib_bert_pretrain.gin), MLM alone on the same
pairs (no next-sentence head), and MLM alone on packed full segments (gin/runs/stdlib_mlm.gin).
The left-to-right arm ("LTR & No NSP") is the same network made causal: BERT's layers, width,
embeddings and WordPiece as a decoder-only model (the decoder_only family with BERT's
post-LayerNorm, learned positions and embedding norm; no token types, no pooler), pretrained
as a causal LM on the same text (stdlib_lm_wordpiece) with the MLM's recipe (its optimizer,
learning rate, batch and 128-token pieces: only the objective differs, as in the paper) and
finetuned with the left-only constraint kept, as the paper did: the same head tasks, read by
a classifier on the last real token (GPT-2's sequence classification), since under causal
attention the first token sees nothing after it.
"""
from t5lite.study.spec import BERT_SMALL_SCALE, Arm, Pretraining, Scale, Study, register

PAIRS = "gin/runs/stdlib_bert_pretrain.gin"
LEFT_TO_RIGHT = ("ModelConfig.architecture='decoder_only'", "ModelConfig.family='decoder_only'",
                 "ModelConfig.type_vocab_size=0", "ModelConfig.pooler=False",
                 "ModelConfig.sentence_classes=0",
                 "ModelConfig.bos_id=2", "ModelConfig.eos_id=3")  # [CLS] starts, [SEP] ends
"""BERT's network as a causal decoder: its depth is the scale's num_decoder_layers."""
LM_DATA = ("MIXTURE_OR_TASK_NAME='stdlib_lm_wordpiece'", "TASK_FEATURE_LENGTHS={'targets': 128}")

register(Study(
    name="bert_ablations",
    title="MLM + NSP, MLM alone, MLM on full segments, left-to-right LM",
    paper="Devlin et al. 2019, Table 5; Liu et al. 2019, Table 2 (orderings)",
    published_metric="GLUE and SQuAD (orderings only)",
    arms=(Arm("mlm_nsp", "MLM + NSP (pairs)", Pretraining(PAIRS)),
          Arm("mlm", "MLM alone (pairs)", Pretraining(PAIRS, ("ModelConfig.sentence_classes=0",))),
          Arm("mlm_full", "MLM alone (full segments)", Pretraining("gin/runs/stdlib_mlm.gin")),
          Arm("ltr", "left-to-right LM", Pretraining("gin/runs/stdlib_mlm.gin", LM_DATA),
              model_bindings=LEFT_TO_RIGHT)),
    # The left-to-right arm reads packed full segments, so the MLM it is held against is the
    # one on the same data (the paper's No NSP and LTR & No NSP shared theirs too).
    orderings=(("mlm_nsp", "mlm"), ("mlm_full", "mlm_nsp"), ("mlm_full", "ltr")),
    scales={
        "tiny": Scale("gin/models/bert/tiny.gin", pretrain_steps=1_000, finetune_steps=300,
                      model_bindings=("ModelConfig.num_decoder_layers=2",)),  # tiny.gin's depth
        "small": BERT_SMALL_SCALE,
    },
    note=("BERT's ablation scored MNLI, QNLI, MRPC, SST-2 and SQuAD; the embedded head tasks "
          "stand in for them here."),
))
