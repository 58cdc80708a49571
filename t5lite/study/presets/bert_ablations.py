"""`bert_ablations`: BERT's pretraining tasks (Devlin et al. 2019, Table 5: without the
next-sentence prediction (NSP) task the finetuned scores fall a little; Liu et al. 2019,
RoBERTa, Table 2: MLM alone on full segments matches or beats MLM + NSP on pairs).

Arms on one encoder (gin/models/bert/*.gin), each pretrained for the same FLOPs and finetuned
alike: MLM + NSP on sentence pairs (gin/runs/stdlib_bert_pretrain.gin), MLM alone on the same
pairs (no next-sentence head), and MLM alone on packed full segments (gin/runs/stdlib_mlm.gin).
BERT's left-to-right arm is not here: it needs a decoder finetuned on these tasks in their
decoder format, which the study's one finetuning recipe does not cover yet.
"""
from t5lite.study.spec import BERT_SMALL_SCALE, Arm, Pretraining, Scale, Study, register

PAIRS = "gin/runs/stdlib_bert_pretrain.gin"

register(Study(
    name="bert_ablations",
    title="MLM + NSP, MLM alone, MLM on full segments",
    paper="Devlin et al. 2019, Table 5; Liu et al. 2019, Table 2 (orderings)",
    published_metric="GLUE and SQuAD (orderings only)",
    arms=(Arm("mlm_nsp", "MLM + NSP (pairs)", Pretraining(PAIRS)),
          Arm("mlm", "MLM alone (pairs)", Pretraining(PAIRS, ("ModelConfig.sentence_classes=0",))),
          Arm("mlm_full", "MLM alone (full segments)", Pretraining("gin/runs/stdlib_mlm.gin"))),
    orderings=(("mlm_nsp", "mlm"), ("mlm_full", "mlm_nsp")),
    scales={
        "tiny": Scale("gin/models/bert/tiny.gin", pretrain_steps=1_000, finetune_steps=300),
        "small": BERT_SMALL_SCALE,
    },
    note=("BERT's ablation scored MNLI, QNLI, MRPC, SST-2 and SQuAD; the embedded head tasks "
          "stand in for them here."),
))
