"""`distillation`: DistilBERT's recipe (Sanh et al. 2019, Table 1: DistilBERT 77.0 vs its
teacher BERT-base 79.5 GLUE macro-score, "97% of BERT's performance"; Table 4: a student
started from random weights and trained without the teacher falls further behind).

Three arms on gin/models/bert/*.gin, each pretrained for the same steps on the embedded
corpus and finetuned alike: the teacher (4 layers, BERT's MLM), a 2-layer student started
from the teacher's layers 0 and 2 and trained with DistilBERT's loss (gin/runs/distilbert.gin:
5 x soft targets at T=2, 2 x MLM, 1 x cosine of the hidden states) against that teacher, and
the same 2-layer student from a random init with the MLM alone. Steps, not FLOPs, are equal
(the distilled student also runs the teacher's forward), as in the paper.
"""
from t5lite.study.spec import Arm, Pretraining, Scale, Study, register

STUDENT = ("ModelConfig.num_encoder_layers=2",)
# A 4-layer post-LN BERT at stdlib_mlm.gin's peak learning rate of 2e-3 collapses.
LEARNING_RATE = ("ScheduleConfig.value=1e-3",)

register(Study(
    name="distillation",
    title="DistilBERT: a distilled student vs the same student from scratch",
    paper="Sanh et al. 2019, Table 1 (BERT-base teacher, DistilBERT)",
    published_metric="GLUE macro-score",
    arms=(Arm("teacher", "teacher (4 layers)",
              Pretraining("gin/runs/stdlib_mlm.gin", LEARNING_RATE),
              model_bindings=("ModelConfig.num_encoder_layers=4",), published=79.5),
          Arm("distilled", "student, distilled (2 layers)",
              Pretraining("gin/runs/distilbert.gin", LEARNING_RATE, teacher="teacher",
                          teacher_layers="0,2"),
              model_bindings=STUDENT, published=77.0),
          Arm("scratch", "student, MLM from scratch (2 layers)",
              Pretraining("gin/runs/stdlib_mlm.gin", LEARNING_RATE), model_bindings=STUDENT)),
    orderings=(("teacher", "distilled"), ("distilled", "scratch")),
    scales={
        "tiny": Scale("gin/models/bert/tiny.gin", pretrain_steps=800, finetune_steps=300),
        # BERT-Small's width (256, 4 heads), the same depths, batch 128.
        "small": Scale("gin/models/bert/tiny.gin", pretrain_steps=20_000, finetune_steps=1_000,
                       model_bindings=("ModelConfig.d_model=256", "ModelConfig.num_heads=4",
                                       "ModelConfig.d_ff=1024"),
                       pretrain_bindings=("BATCH_SIZE=128",)),
    },
    equal_flops=False,
))
