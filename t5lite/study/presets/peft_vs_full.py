"""`peft_vs_full`: full finetuning against LoRA and prompt tuning of the same pretrained model
(Hu et al. 2021, Table 2: on RoBERTa-base, LoRA of the query and value projections averages
87.2 on GLUE dev against full finetuning's 86.4 with 0.3M trained params instead of 125M;
Lester et al. 2021, Figure 1: prompt tuning trails full finetuning far at small model sizes
and closes the gap only past about 10B params).

One BERT (gin/models/bert/tiny.gin) is pretrained once a seed (MLM + NSP,
gin/runs/stdlib_bert_pretrain.gin) and finetuned on each downstream task three ways, for the
same steps with the study's optimizer, learning rate and schedule (gin/runs/bert_finetune.gin):
every param; LoRA (peft's LoraConfig as the paper's GLUE runs: rank 8, alpha 8, query and
value); prompt tuning (20 soft tokens from sampled vocabulary embeddings). In both PEFT arms the
new classifier trains whole beside the adapter (peft's modules_to_save), and the step counter
starts at 0. Lester et al.'s Adafactor at 0.3 is for T5's text-to-text tasks, where nothing but
the prompt trains; a classifier trained at that rate diverges, so the prompt arm keeps the
study's AdamW, as peft's sequence-classification examples do.
"""
from t5lite.study.spec import (BERT_SMALL_SCALE, Arm, Finetuning, Pretraining, Scale, Study,
                               register)

LORA = ("AdapterConfig.r=8", "AdapterConfig.lora_alpha=8", "AdapterConfig.lora_dropout=0.1",
        "AdapterConfig.target_modules=('query', 'value')")
PROMPT = ("AdapterConfig.num_virtual_tokens=20", "AdapterConfig.prompt_init='sample_vocab'")

register(Study(
    name="peft_vs_full",
    title="full finetuning, LoRA and prompt tuning of one pretrained model",
    paper="Hu et al. 2021, Table 2 (RoBERTa-base); Lester et al. 2021, Figure 1 (ordering)",
    published_metric="GLUE dev average",
    arms=(Arm("full", "full finetuning", Pretraining("gin/runs/stdlib_bert_pretrain.gin"),
              published=86.4),
          Arm("lora", "LoRA (rank 8, query and value)", None, published=87.2,
              pretrained_by="full", finetuning=Finetuning("lora", LORA)),
          Arm("prompt_tuning", "prompt tuning (20 soft tokens)", None, pretrained_by="full",
              finetuning=Finetuning("prompt_tuning", PROMPT))),
    orderings=(("lora", "full"), ("full", "prompt_tuning"), ("lora", "prompt_tuning")),
    scales={
        "tiny": Scale("gin/models/bert/tiny.gin", pretrain_steps=1_000, finetune_steps=300),
        "small": BERT_SMALL_SCALE,
    },
    note=("Every arm finetunes for the same steps from the same pretrained model with the "
          "same optimizer, learning rate and schedule; only what trains differs. Hu et al.'s "
          "ordering (LoRA at or above full finetuning) is from bases of 125M params and more, "
          "Lester et al.'s gap from T5 at every size below 10B."),
))
