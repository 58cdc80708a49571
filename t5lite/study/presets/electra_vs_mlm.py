"""`electra_vs_mlm`: ELECTRA against BERT's masked LM at equal pretraining FLOPs (Clark et
al. 2020, Table 1: ELECTRA-Small 79.9 vs BERT-Small 75.1 GLUE dev).

One network shape for both: ELECTRA's discriminator (gin/models/electra/*.gin) pretrained as
ELECTRA (with its generator, both networks' FLOPs counted) or, with its MLM head in place of
the replaced-token head, as BERT's MLM for as many FLOPs. Both then finetune alike: the same
first-token classification head with ELECTRA's GELU classifier, from the HF export's
discriminator or the MLM's MODEL_DIR.
"""
from t5lite.study.spec import Arm, Pretraining, Scale, Study, register

MLM = ("ModelConfig.electra=None",)

register(Study(
    name="electra_vs_mlm",
    title="ELECTRA vs BERT's MLM at equal pretraining FLOPs",
    paper="Clark et al. 2020, Table 1 (ELECTRA-Small vs BERT-Small)",
    published_metric="GLUE dev score",
    arms=(Arm("electra", "ELECTRA",
              Pretraining("gin/runs/stdlib_electra_pretrain.gin", finetune_from="hf:discriminator"),
              published=79.9),
          Arm("mlm", "BERT MLM", Pretraining("gin/runs/stdlib_mlm.gin", MLM), published=75.1)),
    orderings=(("electra", "mlm"),),
    scales={
        # 2 CPU cores: about 15 minutes a seed.
        "tiny": Scale("gin/models/electra/tiny.gin", pretrain_steps=800, finetune_steps=300),
        # ELECTRA-Small's shape and batch 128, for a GPU or TPU.
        "small": Scale("gin/models/electra/small.gin", pretrain_steps=20_000,
                       finetune_steps=1_000, pretrain_bindings=("BATCH_SIZE=128",)),
    },
    finetune_bindings=(*MLM, "ModelConfig.pooler=False",
                       "ModelConfig.classifier_activation='gelu_exact'"),
    note=("At tiny scale ELECTRA samples at temperature 2 (gin/runs/stdlib_electra_pretrain.gin;"
          " at the paper's 1 its discriminator learns nothing in this budget: docs/recipes.md)."),
))
