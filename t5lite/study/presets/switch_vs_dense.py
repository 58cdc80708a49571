"""`switch_vs_dense`: a Switch Transformer against its dense T5 at equal FLOPs per token (Fedus
et al. 2021, Table 1: negative log perplexity after 100k steps, Switch-Base -1.553 with
capacity factor 1.25 vs T5-Base -1.731; higher is better).

One T5 v1.1-style network (gin/models/demo.gin) pretrained on the embedded span-corruption
task: `dense` as it is; `switch` with every second MLP of each stack routed top-1 over 8
experts of the same d_ff, with the paper's recipe (t5lite.bench.moe.switch_bindings: capacity
factor 1.25 in training, 2.0 in evaluation, jitter, load-balancing and router z-losses). A
token passes one expert, so both spend the same FLOPs per token but for the router, which the
plan counts. The score is the pretraining eval loss, negated, as the paper's table: no
finetuning.
"""
from t5lite.bench.moe import switch_bindings
from t5lite.study.spec import Arm, Pretraining, Scale, Study, register

PRETRAIN = "gin/runs/demo.gin"
T5_1_1_SMALL = ("ModelConfig.d_model=512", "ModelConfig.d_ff=1024", "ModelConfig.num_heads=6",
                "ModelConfig.d_kv=64", "ModelConfig.num_encoder_layers=8",
                "ModelConfig.num_decoder_layers=8")

register(Study(
    name="switch_vs_dense",
    title="Switch Transformer vs dense T5 at equal FLOPs per token",
    paper="Fedus et al. 2021, Table 1 (Switch-Base, capacity factor 1.25, vs T5-Base)",
    published_metric="negative log perplexity after 100k steps",
    arms=(Arm("dense", "dense T5", Pretraining(PRETRAIN), published=-1.731),
          Arm("switch", "Switch, 8 experts", Pretraining(PRETRAIN),
              model_bindings=tuple(switch_bindings(8)), published=-1.553)),
    orderings=(("switch", "dense"),),
    scales={
        # 2 CPU cores: about 5 minutes a seed.
        "tiny": Scale("gin/models/demo.gin", pretrain_steps=400, finetune_steps=0, downstream=()),
        # T5 v1.1 small's shape with batch 128, for a GPU or TPU.
        "small": Scale("gin/models/demo.gin", pretrain_steps=20_000, finetune_steps=0,
                       downstream=(), model_bindings=T5_1_1_SMALL,
                       pretrain_bindings=("BATCH_SIZE=128",)),
    },
    scored_by_pretraining=True,
    note=("The paper's models are T5-Base with 128 experts after 100k steps of batch 2^20 tokens "
          "on C4; these are a few hundred steps of a 3 + 3 layer model with 8 experts on the "
          "embedded corpus, so only the direction is comparable."),
))
