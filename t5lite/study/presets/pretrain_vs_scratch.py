"""`pretrain_vs_scratch`: the same encoder finetuned after MLM pretraining and from a random
init (Raffel et al. 2020, Table 1: GLUE average 83.28 pretrained vs 66.22 without).

The pretrained arm is BERT's MLM on the embedded corpus; the scratch arm finetunes the same
network, with the same steps and recipe, from a random init.
"""
from t5lite.study.spec import BERT_SMALL_SCALE, Arm, Pretraining, Scale, Study, register

register(Study(
    name="pretrain_vs_scratch",
    title="Pretrained vs from scratch",
    paper="Raffel et al. 2020, Table 1 (baseline vs no pre-training)",
    published_metric="GLUE average",
    arms=(Arm("pretrained", "MLM pretrained", Pretraining("gin/runs/stdlib_mlm.gin"),
              published=83.28),
          Arm("scratch", "from scratch", None, published=66.22)),
    orderings=(("pretrained", "scratch"),),
    scales={
        "tiny": Scale("gin/models/bert/tiny.gin", pretrain_steps=1_200, finetune_steps=300),
        "small": BERT_SMALL_SCALE,
    },
))
