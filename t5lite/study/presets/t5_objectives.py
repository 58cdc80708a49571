"""`t5_objectives`: T5's architectures x objectives (Raffel et al. 2020, Table 2: the
encoder-decoder with the denoising objective best, 83.28 GLUE; the decoder-only language model
with the LM objective worst, 73.78).

Five architectures, each pretrained with two objectives for the same steps (as the paper: their
costs differ by design, the table's P and M) on the embedded text, then finetuned alike on
text-to-text tasks (gin/runs/demo_finetune.gin, decoded predictions):

  encoder-decoder          L + L layers (gin/models/demo.gin's T5 v1.1 layers)   2P, M
  encoder-decoder, shared  L + L layers, the decoder's layers run the encoder's  P, M
                           (ModelConfig.shared_encoder_decoder)
  encoder-decoder, half    L/2 + L/2 layers                                       P, M/2
  language model           a causal decoder of L layers over inputs + targets     P, M
  prefix LM                the same decoder, the inputs seen bidirectionally      P, M

  denoising  T5's span corruption (stdlib_span_corruption: 15% of the tokens in spans of
             mean 3, each span one sentinel; inputs in, the spans out); a decoder reads the
             inputs then predicts the spans
  LM         a random split of each piece, the prefix in and its continuation out
             (stdlib_prefix_lm); the language model instead predicts every token of the
             piece (stdlib_lm_sentencepiece), as the paper's LM does

The paper finetuned on GLUE, CNN/DM, SQuAD, SuperGLUE and WMT; the embedded text-to-text
tasks stand in: summarizing a docstring into its first line (ROUGE-Lsum), and naming a
sentence's module (tasks/embedded_text_to_text.py).
"""
from t5lite.study.spec import Arm, Downstream, Pretraining, Scale, Study, register

RUN = "gin/runs/demo.gin"  # the demo's pretraining recipe, for every arm (its model include
# comes before the scale's bindings, which size the model)
DENOISING = Pretraining(RUN)
# Rows of at most 160 tokens for every objective, as the denoising's 128 in + 32 out.
LM = Pretraining(RUN, ("MIXTURE_OR_TASK_NAME='stdlib_prefix_lm'",
                       "TASK_FEATURE_LENGTHS={'inputs': 80, 'targets': 80}"))
WHOLE_SPAN_LM = Pretraining(RUN, ("MIXTURE_OR_TASK_NAME='stdlib_lm_sentencepiece'",
                                  "TASK_FEATURE_LENGTHS={'targets': 160}"))
SHARED = ("ModelConfig.shared_encoder_decoder=True",)
DECODER = ("ModelConfig.architecture='decoder_only'",)  # of num_decoder_layers = L
PREFIX_LM = (*DECODER, "ModelConfig.prefix_lm=True")

# (name, label, model bindings, its LM objective's pretraining, T5's GLUE with denoising and
# with the LM objective).
ARCHITECTURES = (
    ("encdec", "encoder-decoder", (), LM, 83.28, 79.56),
    ("shared", "enc-dec, shared", SHARED, LM, 82.81, 79.60),
    ("half", "enc-dec, half the layers", (), LM, 80.88, 78.67),
    ("lm", "language model", DECODER, WHOLE_SPAN_LM, 74.70, 73.78),
    ("prefix", "prefix LM", PREFIX_LM, LM, 81.82, 79.68),
)
ARMS = tuple(
    Arm(f"{name}_{objective}", f"{label}, {objective}", pretraining, bindings, published)
    for name, label, bindings, lm, with_denoising, with_lm in ARCHITECTURES
    for objective, pretraining, published in (("denoising", DENOISING, with_denoising),
                                              ("LM", lm, with_lm)))
T5_SMALL = ("ModelConfig.num_encoder_layers=8", "ModelConfig.num_decoder_layers=8",
            "ModelConfig.d_model=512", "ModelConfig.d_ff=1024", "ModelConfig.num_heads=6",
            "ModelConfig.d_kv=64")
DOWNSTREAM = (Downstream("stdlib_docstring_summary", metric="rougeLsum"),
              Downstream("stdlib_docstring_module"))


def half(layers: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
  return tuple((f"half_{objective}", (f"ModelConfig.num_encoder_layers={layers // 2}",
                                      f"ModelConfig.num_decoder_layers={layers // 2}"))
               for objective in ("denoising", "LM"))


register(Study(
    name="t5_objectives",
    title="architectures x objectives (encoder-decoder, shared, half, LM, prefix LM)",
    paper="Raffel et al. 2020, Table 2",
    published_metric="GLUE average",
    arms=ARMS,
    orderings=(("encdec_denoising", "encdec_LM"), ("encdec_denoising", "shared_denoising"),
               ("shared_denoising", "half_denoising"), ("encdec_denoising", "prefix_denoising"),
               ("prefix_denoising", "lm_denoising"), ("lm_denoising", "lm_LM")),
    scales={
        # 2 CPU cores: 2 + 2 layers of gin/models/demo.gin's width.
        "tiny": Scale("gin/models/demo.gin", pretrain_steps=300, finetune_steps=150,
                      downstream=DOWNSTREAM,
                      model_bindings=("ModelConfig.num_encoder_layers=2",
                                      "ModelConfig.num_decoder_layers=2"),
                      arm_bindings=half(2)),
        # T5 v1.1 small's shape (8 + 8 layers of 512, 6 heads of 64, FF 1024) on the
        # embedded vocabulary, batch 128, for a GPU or TPU.
        "small": Scale("gin/models/demo.gin", pretrain_steps=20_000, finetune_steps=2_000,
                       downstream=DOWNSTREAM, model_bindings=T5_SMALL,
                       pretrain_bindings=("BATCH_SIZE=128",), arm_bindings=half(8)),
    },
    equal_flops=False,
    finetune_run="gin/runs/demo_finetune.gin",
    finetune_bindings=("CheckpointConfig.best_metric=None",  # the recipe's is the summary's
                       "TrainConfig.infer_eval_examples=152"),  # the module task's whole split
    note=("T5 scored GLUE, CNN/DM, SQuAD, SuperGLUE and WMT after 2^18 steps of pretraining "
          "(the published column is its GLUE average); the embedded text-to-text tasks stand "
          "in here, at a far smaller scale."),
))
