"""`modifications`: MLP activations and norms of one encoder, each pretrained (BERT's MLM) at
equal FLOPs and finetuned alike (Narang et al. 2021, "Do Transformer Modifications Transfer
Across Implementations and Applications?": GeGLU and SwiGLU lower the pretraining loss and
improve the finetuned score over ReLU; RMSNorm is on a par with LayerNorm).

The gated variants carry a third MLP matrix: at equal FLOPs they get fewer steps (Narang et
al. shrink d_ff instead). The paper gives SuperGLUE scores per variant for T5-base at scale;
the table shows the orderings only.
"""
from t5lite.study.spec import BERT_SMALL_SCALE, Arm, Pretraining, Scale, Study, register

MLM = Pretraining("gin/runs/stdlib_mlm.gin")


def _arm(name: str, label: str, *bindings: str) -> Arm:
  return Arm(name, label, MLM, model_bindings=bindings)


register(Study(
    name="modifications",
    title="Activations and norms at equal FLOPs",
    paper="Narang et al. 2021, Table 1 (orderings)",
    published_metric="SuperGLUE (orderings only)",
    arms=(_arm("relu", "ReLU", "ModelConfig.mlp_activation='relu'"),
          _arm("gelu", "GeLU", "ModelConfig.mlp_activation='gelu_exact'"),
          _arm("geglu", "GeGLU", "ModelConfig.mlp_activation='gated-gelu'"),
          _arm("swiglu", "SwiGLU", "ModelConfig.mlp_activation='swiglu'"),
          _arm("rmsnorm", "GeLU, RMSNorm", "ModelConfig.mlp_activation='gelu_exact'",
               "ModelConfig.norm='rms'")),
    orderings=(("geglu", "relu"), ("swiglu", "relu")),
    scales={
        "tiny": Scale("gin/models/bert/tiny.gin", pretrain_steps=800, finetune_steps=300),
        "small": BERT_SMALL_SCALE,
    },
))
