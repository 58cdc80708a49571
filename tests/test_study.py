"""`t5lite study` (t5lite/study/): every preset plans its arms at equal pretraining FLOPs at
every scale, the report's figures against a numpy re-derivation, bad input refused in one
line, and a smoke-sized study end to end through the CLI that resumes without rerunning what
it finished. The smoke studies run on one fake device: what they check is the study's plumbing,
not sharding (a sharded run's steps and checkpoints are checked by test_trainer,
test_partitioning and test_reliability), and one device saves a sixth of their time."""
import json
import os

import numpy as np
import pytest

from helpers.cli import run_t5lite
from t5lite import cli
from t5lite.errors import ConfigError
from t5lite.study import _check_plan, report, runner, spec


@pytest.mark.parametrize("name", spec.names())
def test_every_preset_plans_its_arms_at_equal_pretraining_flops_or_steps(name):
  study = spec.get(name)
  assert study.orderings and all(arm.label for arm in study.arms)
  for scale_name in (*study.scales, spec.SMOKE):
    scale = study.scale(scale_name)
    plan = runner.pretraining_plan(study, scale)
    assert set(plan) == {arm.name for arm in study.arms if arm.pretraining}
    assert plan[study.reference.name]["steps"] == scale.pretrain_steps
    budget = plan[study.reference.name]["flops"]
    for arm, entry in plan.items():
      if not study.equal_flops:
        assert entry["steps"] == scale.pretrain_steps
        continue
      # Equal up to rounding to whole steps.
      one_step = entry["flops_per_example"] * entry["batch"]
      assert abs(entry["flops"] - budget) <= one_step / 2 + 1, (scale_name, arm)


def test_electra_counts_both_networks_so_the_mlm_gets_more_steps():
  study = spec.get("electra_vs_mlm")
  plan = runner.pretraining_plan(study, study.scale("tiny"))
  assert plan["electra"]["flops_per_example"] > 1.05 * plan["mlm"]["flops_per_example"]
  assert plan["mlm"]["steps"] > plan["electra"]["steps"] == 800


def result(arm, seed, accuracies, steps=10, flops=1e9):
  return {"arm": arm, "seed": seed, "pretrain_steps": steps, "pretrain_flops": flops,
          "curve": [[5, 7.0], [10, 6.5]], "downstream": accuracies,
          "pretrain_eval": {"stdlib_mlm/loss": 5.25 + 0.5 * seed, "stdlib_mlm/accuracy": 0.1},
          "score": float(np.mean(list(accuracies.values())))}


def test_t5_objectives_arms_have_the_papers_params_and_costs():
  """Table 2's P and M: the encoder-decoder 2P at cost M; shared P at M; half the layers P
  at M/2; the language model and prefix LM (L layers over inputs + targets) P at about M."""
  from t5lite.models import count_params
  study = spec.get("t5_objectives")
  scale = study.scale("tiny")
  plan = runner.pretraining_plan(study, scale)
  params = {}
  for arm in study.arms:
    config = _pretraining_model(scale, arm)
    embeddings = config.vocab_size * config.d_model * (1 + (not config.tie_output_embedding))
    params[arm.name] = count_params(config) - embeddings  # the layers' share
  for objective in ("denoising", "LM"):
    cost = {a: plan[f"{a}_{objective}"]["flops_per_example"]
            for a in ("encdec", "shared", "half", "lm", "prefix")}
    p = {a: params[f"{a}_{objective}"] for a in cost}
    assert cost["shared"] == cost["encdec"] and 0.45 < cost["half"] / cost["encdec"] < 0.65
    assert 0.9 < cost["lm"] / cost["encdec"] < 1.3 and cost["prefix"] == cost["lm"]
    assert 1.7 < p["encdec"] / p["shared"] < 2.3  # the decoder's cross-attention is its own
    assert 0.8 < p["half"] / p["shared"] < 1.2 and 0.7 < p["lm"] / p["shared"] < 1.1
    assert p["prefix"] == p["lm"]
  # At smoke scale too, the half arms' runs get half of the scale's 2 + 2 layers.
  half = _pretraining_model(study.scale("smoke"), study.arm("half_LM"))
  assert (half.num_encoder_layers, half.num_decoder_layers) == (1, 1)


def test_the_report_gives_mean_and_std_over_seeds_and_checks_each_ordering(tmp_path):
  study = spec.get("electra_vs_mlm")
  tasks = ("a_head", "b_head")
  electra = [{"a_head": 40.0, "b_head": 70.0}, {"a_head": 44.0, "b_head": 61.0}]
  mlm = [{"a_head": 50.0, "b_head": 72.5}, {"a_head": 52.0, "b_head": 71.5}]
  results = {"electra": [result("electra", s, a) for s, a in enumerate(electra)],
             "mlm": [result("mlm", s, a) for s, a in enumerate(mlm)]}
  summary = report.summarize(study, results, "tiny")
  for name, runs in (("electra", electra), ("mlm", mlm)):
    scores = [np.mean([r[t] for t in tasks]) for r in runs]
    arm = summary["arms"][name]
    assert arm["score_mean"] == pytest.approx(np.mean(scores))
    assert arm["score_std"] == pytest.approx(np.std(scores, ddof=1))
    for t in tasks:
      assert arm["downstream"][t]["std"] == pytest.approx(np.std([r[t] for r in runs], ddof=1))
  (ordering,) = summary["orderings"]
  # Scores 55, 52.5 (std 1.8) against 61.25, 61.75 (std 0.35): a gap of -7.75.
  assert ordering == {"better": "electra", "worse": "mlm", "held": False, "beyond_spread": True,
                      "gap": pytest.approx(np.mean([55, 52.5]) - np.mean([61.25, 61.75]))}
  text = report.markdown(study, summary)
  assert ("| ELECTRA | 10 | 1e+09 | 5.500 | 42.0 ± 2.8 | 65.5 ± 6.4 | **53.8 ± 1.8** | 79.9 |"
          in text)
  assert ("ELECTRA > BERT MLM: **did not hold** here (score gap -7.8, beyond the seeds' "
          "spread)") in text
  one_seed = report.summarize(study, {k: v[:1] for k, v in results.items()}, "tiny")
  assert one_seed["orderings"][0]["beyond_spread"] is None
  assert "no spread measured" in report.markdown(study, one_seed)
  paths = report.write(study, results, summary, str(tmp_path))
  assert json.loads(open(paths["json"]).read())["orderings"][0]["held"] is False
  assert os.path.getsize(paths["png"]) > 10_000


def test_a_study_scored_by_pretraining_reads_minus_the_eval_loss():
  """switch_vs_dense: no finetuning; each arm's score is minus its pretraining eval loss."""
  study = spec.get("switch_vs_dense")
  assert study.scored_by_pretraining and study.scale("tiny").downstream == ()
  assert study.scale(spec.SMOKE).downstream == ()
  losses = {"dense": [4.25, 4.5], "switch": [4.0, 4.125]}
  results = {arm: [{"arm": arm, "seed": seed, "pretrain_steps": 400, "pretrain_flops": 6.4e12,
                    "curve": [[400, 4.0]], "downstream": {},
                    "pretrain_eval": {"stdlib_span_corruption/loss": loss,
                                      "stdlib_span_corruption/accuracy": 0.3},
                    "score": -loss}
                   for seed, loss in enumerate(values)] for arm, values in losses.items()}
  assert runner.pretraining_loss(results["switch"][1]) == 4.125
  summary = report.summarize(study, results, "tiny")
  assert summary["arms"]["switch"]["score_mean"] == pytest.approx(-4.0625)
  assert summary["arms"]["dense"]["score_std"] == pytest.approx(np.std([4.25, 4.5], ddof=1))
  (ordering,) = summary["orderings"]
  assert ordering["held"] and ordering["gap"] == pytest.approx(4.375 - 4.0625)
  text = report.markdown(study, summary)
  assert "minus the pretraining eval loss" in text and "validation accuracy" not in text
  assert "| Switch, 8 experts | 400 | 6.4e+12 | 4.062 | **-4.062 ± 0.088** | -1.553 |" in text
  assert "score gap +0.312" in text


@pytest.mark.parametrize("args, message", [
    (["nope"], "no study 'nope': choose one of bert_ablations, distillation"),
    (["electra_vs_mlm", "--scale", "huge"],
     "has no scale 'huge': choose one of tiny, small, smoke"),
    (["electra_vs_mlm", "--seeds", "0"], "--seeds must be at least 1"),
    (["distillation", "--arms", "teacher,nope"],
     "study 'distillation' has no arm nope: choose among teacher, distilled, scratch"),
])
def test_bad_arguments_are_refused_in_one_line(args, message, capsys, tmp_path):
  assert cli.main(["study", *args, "--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1


def test_some_arms_bring_the_arms_they_need_and_the_orderings_between_them():
  """--arms: a distilled student needs its teacher, a PEFT arm the arm whose pretraining it
  adapts; the steps stay the whole study's plan (the reference arm's budget)."""
  study = spec.get("distillation")
  assert [arm.name for arm in study.only(("distilled",)).arms] == ["teacher", "distilled"]
  assert study.only(("distilled",)).orderings == (("teacher", "distilled"),)
  assert study.only(("scratch",)).orderings == ()
  peft = spec.get("peft_vs_full")
  assert [arm.name for arm in peft.only(("prompt_tuning",)).arms] == ["full", "prompt_tuning"]
  bert = spec.get("bert_ablations")
  assert [arm.name for arm in bert.only(("ltr", "mlm")).arms] == ["mlm", "ltr"]
  t5 = spec.get("t5_objectives")
  tiny = t5.only(("half_LM",)).scales["tiny"]
  assert tiny.bindings_of("half_LM") == t5.scales["tiny"].bindings_of("half_LM") != ()
  assert {name for name, _ in tiny.arm_bindings} == {"half_LM"}


def test_each_modifications_arm_is_its_activation_and_norm_at_equal_flops():
  """Each arm's model as its runs build it (the gin files and bindings the runner passes);
  the gated arms (a third MLP matrix) get fewer steps than ReLU's at equal FLOPs. The smoke
  in test_study_presets runs two of them."""
  study = spec.get("modifications")
  expected = {"relu": ("relu", "layer"), "gelu": ("gelu_exact", "layer"),
              "geglu": ("gated-gelu", "layer"), "swiglu": ("swiglu", "layer"),
              "rmsnorm": ("gelu_exact", "rms")}
  for scale_name in ("tiny", spec.SMOKE):
    scale = study.scale(scale_name)
    for arm in study.arms:
      config = _pretraining_model(scale, arm)
      assert (config.mlp_activation, config.norm) == expected[arm.name], arm.name
    steps = {arm: entry["steps"] for arm, entry in runner.pretraining_plan(study, scale).items()}
    reference = scale.pretrain_steps
    assert steps["relu"] == steps["gelu"] == steps["rmsnorm"] == reference
    assert 0 < steps["geglu"] == steps["swiglu"] < reference, steps


def test_distillation_has_a_4_layer_teacher_and_2_layer_students_at_equal_steps():
  """The smoke in test_study_presets runs the teacher and the distilled student."""
  study = spec.get("distillation")
  for scale_name in ("tiny", spec.SMOKE):
    scale = study.scale(scale_name)
    layers = {arm.name: _pretraining_model(scale, arm).num_encoder_layers for arm in study.arms}
    assert layers == {"teacher": 4, "distilled": 2, "scratch": 2}
    plan = runner.pretraining_plan(study, scale)
    assert {entry["steps"] for entry in plan.values()} == {scale.pretrain_steps}


def test_bert_ablations_mlm_arm_is_mlm_nsp_without_the_sentence_head():
  """The smoke in test_study_presets runs mlm_nsp: `mlm` is the same run on the same pairs
  with no sentence head."""
  import gin
  study = spec.get("bert_ablations")
  runs = {}
  for arm in ("mlm_nsp", "mlm"):
    config = _pretraining_model(study.scale(spec.SMOKE), study.arm(arm))
    runs[arm] = (config, gin.query_parameter("MIXTURE_OR_TASK_NAME/macro.value"))
  assert runs["mlm"][1] == runs["mlm_nsp"][1] == "stdlib_bert_pretrain"
  assert runs["mlm"][0] == runs["mlm_nsp"][0].replace(sentence_classes=0)


def _pretraining_model(scale, arm):
  """The ModelConfig of an arm's pretraining run, from the gin files and bindings the runner
  gives it."""
  from t5lite.cli import gin_config
  gin_config.parse(*runner.pretraining_gin(arm, scale))
  return gin_config.model_config()


def test_an_out_folder_holds_one_study(tmp_path):
  plan = {"study": "a", "scale": "tiny", "plan": {"x": 10}}
  _check_plan(str(tmp_path), plan)
  _check_plan(str(tmp_path), plan)  # the same study again: continued
  with pytest.raises(ConfigError, match="holds study 'a' at scale 'tiny'"):
    _check_plan(str(tmp_path), {**plan, "scale": "small"})


def test_study_list_names_every_preset(capsys):
  assert cli.main(["study", "list"]) == 0
  listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
  assert listed == spec.names() and {"electra_vs_mlm", "pretrain_vs_scratch",
                                     "modifications", "bert_ablations"} <= set(listed)


def test_help_shows_the_usage_and_an_example(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(["study", "--help"])
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  assert "t5lite study NAME [--seeds 1]" in out and "example: t5lite study electra_vs_mlm" in out


@pytest.mark.e2e
@pytest.mark.slow
def test_a_smoke_study_runs_end_to_end_and_resumes_without_rerunning(tmp_path):
  """electra_vs_mlm at smoke scale (a pair exported to HF and finetuned from its
  discriminator, an MLM finetuned from its MODEL_DIR); then, with one arm's result removed,
  the rerun reads the other arm's and finds that arm's runs finished."""
  out = tmp_path / "study"
  done = run_t5lite("study", "electra_vs_mlm", "--scale", "smoke", "--out", out,
                    devices=1, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  line = json.loads(done.stdout.strip().splitlines()[-1])
  assert line["study"] == "electra_vs_mlm" and set(line["arms"]) == {"electra", "mlm"}
  assert line["arms"]["electra"]["published"] == 79.9
  assert isinstance(line["orderings"][0]["held"], bool)
  table = (out / "study.md").read_text()
  assert "| ELECTRA | 6 |" in table and "| BERT MLM | 6 |" in table
  assert set(json.loads((out / "electra" / "seed0" / "result.json").read_text())["pretrain_eval"]
             ) >= {"stdlib_electra_pretrain/loss", "stdlib_electra_pretrain/discriminator_loss"}
  assert (out / "study.png").stat().st_size > 10_000
  for arm in ("electra", "mlm"):
    figures = json.loads((out / arm / "seed0" / "result.json").read_text())
    accuracy = figures["downstream"]["stdlib_docstring_module_head"]
    assert 0 <= accuracy <= 100 and figures["curve"]
  assert (out / "electra" / "seed0" / "pretrain_hf" / "discriminator" / "config.json").exists()

  kept = (out / "electra" / "seed0" / "result.json").stat().st_mtime_ns
  (out / "mlm" / "seed0" / "result.json").unlink()
  again = run_t5lite("study", "electra_vs_mlm", "--scale", "smoke", "--out", out,
                     devices=1, timeout=900)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "electra seed 0: done earlier" in again.stdout
  assert (out / "electra" / "seed0" / "result.json").stat().st_mtime_ns == kept
  assert "nothing to do" in (out / "mlm" / "seed0" / "pretrain.log").read_text()
  assert json.loads(again.stdout.strip().splitlines()[-1])["arms"] == line["arms"]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_smoke_study_scored_by_pretraining_runs_no_finetuning(tmp_path):
  """switch_vs_dense at smoke scale: two encoder-decoder pretrainings, a Switch one among them;
  each arm's score is minus its eval loss, and no finetuning run is made."""
  out = tmp_path / "study"
  done = run_t5lite("study", "switch_vs_dense", "--scale", "smoke", "--out", out,
                    devices=1, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  line = json.loads(done.stdout.strip().splitlines()[-1])
  for arm in ("dense", "switch"):
    figures = json.loads((out / arm / "seed0" / "result.json").read_text())
    loss = figures["pretrain_eval"]["stdlib_span_corruption/loss"]
    assert figures["downstream"] == {} and figures["score"] == -loss
    assert line["arms"][arm]["score_mean"] == -loss
    assert sorted(os.listdir(out / arm / "seed0")) == ["pretrain", "pretrain.log", "result.json"]
  assert "--gin.MoeConfig.num_experts=8" in done.stdout  # each run's command, printed first



@pytest.mark.e2e
@pytest.mark.slow
def test_a_smoke_study_of_finetuning_methods_pretrains_once_and_adapts_that_model(tmp_path):
  """peft_vs_full at smoke scale: one pretraining (the full arm's), finetuned three ways; the
  LoRA and prompt-tuning runs name it as their frozen base (the same fingerprint), count their
  steps from 0 and store only what trained."""
  out = tmp_path / "study"
  done = run_t5lite("study", "peft_vs_full", "--scale", "smoke", "--out", out,
                    devices=1, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  line = json.loads(done.stdout.strip().splitlines()[-1])
  assert {arm: a["published"] for arm, a in line["arms"].items()} == {
      "full": 86.4, "lora": 87.2, "prompt_tuning": None}
  pretrain = out / "full" / "seed0" / "pretrain"
  task = "stdlib_docstring_module_head"
  full = json.loads((out / "full" / "seed0" / "result.json").read_text())
  stored, fingerprints = {}, set()
  for arm, method in (("lora", "lora"), ("prompt_tuning", "prompt_tuning")):
    assert sorted(os.listdir(out / arm / "seed0")) == [
        f"finetune_{task}", f"finetune_{task}.log", "result.json"]  # no pretraining of its own
    figures = json.loads((out / arm / "seed0" / "result.json").read_text())
    assert figures["curve"] == full["curve"] and figures["pretrain_steps"] == 6
    assert 0 <= figures["downstream"][task] <= 100
    run = out / arm / "seed0" / f"finetune_{task}"
    record = json.loads((run / "peft.json").read_text())
    assert record["base"] == str(pretrain) and record["adapter"]["method"] == method
    assert max(r["step"] for r in map(json.loads, (run / "metrics.jsonl").open())) == 4
    stored[arm] = _newest_step_bytes(run)
    fingerprints.add(record["base_fingerprint"])
  full_run = out / "full" / "seed0" / f"finetune_{task}"
  assert max(r["step"] for r in map(json.loads, (full_run / "metrics.jsonl").open())) == 10
  assert len(fingerprints) == 1
  assert max(stored.values()) < _newest_step_bytes(full_run) / 3, stored
  assert "finetuned by lora" in done.stdout and "the pretrained model of arm full" in done.stdout


def _newest_step_bytes(model_dir) -> int:
  newest = max((p for p in (model_dir / "checkpoints").iterdir() if p.name.isdigit()),
               key=lambda p: int(p.name))
  return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())

