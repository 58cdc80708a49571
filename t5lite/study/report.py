"""A study's report: per arm the mean and standard deviation over seeds of each downstream
figure and of their average (the score), the paper's figure beside it, whether each of the
paper's orderings held, as a Markdown table (study.md), JSON (study.json) and a PNG of the
pretraining curves and the scores (study.png).
"""
from __future__ import annotations

import json
import os
import statistics

from t5lite.study.runner import pretraining_loss
from t5lite.study.spec import Study
from t5lite.util import atomic


def _mean_std(values: list[float]) -> tuple[float, float]:
  return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(study: Study, results: dict[str, list[dict]], scale: str) -> dict:
  """The figures of the report (what study.json holds, less the curves)."""
  arms = {}
  for arm in study.arms:
    runs = results[arm.name]
    tasks = list(runs[0]["downstream"])
    score_mean, score_std = _mean_std([r["score"] for r in runs])
    losses = [loss for loss in map(pretraining_loss, runs) if loss is not None]
    arms[arm.name] = {
        "label": arm.label, "seeds": len(runs), "published": arm.published,
        "pretrain_eval_loss": statistics.fmean(losses) if losses else None,
        "pretrain_steps": runs[0]["pretrain_steps"], "pretrain_flops": runs[0]["pretrain_flops"],
        "score_mean": score_mean, "score_std": score_std,
        "downstream": {t: dict(zip(("mean", "std"), _mean_std([r["downstream"][t] for r in runs])))
                       for t in tasks}}
  orderings = []
  for better, worse in study.orderings:
    gap = arms[better]["score_mean"] - arms[worse]["score_mean"]
    # Whether the gap exceeds the two arms' spread over seeds (None: one seed, no spread).
    spread = arms[better]["score_std"] + arms[worse]["score_std"]
    beyond = abs(gap) > spread if arms[better]["seeds"] > 1 else None
    orderings.append({"better": better, "worse": worse, "gap": gap, "held": gap > 0,
                      "beyond_spread": beyond})
  return {"study": study.name, "scale": scale, "paper": study.paper,
          "published_metric": study.published_metric, "arms": arms, "orderings": orderings}


def _row(cells: list[str]) -> str:
  return "| " + " | ".join(cells) + " |"


def markdown(study: Study, summary: dict) -> str:
  arms = summary["arms"]
  tasks = list(next(iter(arms.values()))["downstream"])
  metric = {d.task: d.metric for d in study.scale(summary["scale"]).downstream}
  scoring = ("score = minus the pretraining eval loss (the negative log perplexity of the "
             "targets, higher is better), mean ± std over seeds; no finetuning"
             if study.scored_by_pretraining else
             "figures are each downstream task's validation metric (%, named in its column) "
             "after finetuning (mean ± std over seeds); "
             "score = their average. The pretraining eval loss is each arm's own objective's "
             "(comparable between arms of one objective)")
  lines = [f"## `t5lite study {study.name}`: {study.title}", "",
           f"Scale `{summary['scale']}`, {next(iter(arms.values()))['seeds']} seed(s); "
           f"{scoring}. Published: {study.paper}, {study.published_metric}.", "",
           _row(["arm", "pretraining steps", "pretraining FLOPs", "pretraining eval loss",
                 *(f"`{t}` {metric.get(t, '')}".rstrip() for t in tasks), "score",
                 "published"]),
           _row(["---"] + ["---:"] * (len(tasks) + 5))]
  for name, a in arms.items():
    # One seed has no spread to show.
    digits = 3 if study.scored_by_pretraining else 1  # log perplexities vs percentages
    figure = ((lambda mean, std: f"{mean:.{digits}f} ± {std:.{digits}f}") if a["seeds"] > 1
              else (lambda mean, std: f"{mean:.{digits}f}"))
    cells = [figure(a["downstream"][t]["mean"], a["downstream"][t]["std"]) for t in tasks]
    published = "—" if a["published"] is None else f"{a['published']:g}"
    loss = "—" if a["pretrain_eval_loss"] is None else f"{a['pretrain_eval_loss']:.3f}"
    lines.append(_row([a["label"], f"{a['pretrain_steps']:,}", f"{a['pretrain_flops']:.3g}",
                       loss, *cells, f"**{figure(a['score_mean'], a['score_std'])}**",
                       published]))
  lines.append("")
  for o in summary["orderings"]:
    verdict = "held" if o["held"] else "did not hold"
    spread = {None: "one seed: no spread measured", True: "beyond the seeds' spread",
              False: "within the seeds' spread"}[o["beyond_spread"]]
    lines.append(f"- Published ordering {arms[o['better']]['label']} > "
                 f"{arms[o['worse']]['label']}: **{verdict}** here (score gap "
                 f"{o['gap']:+.{3 if study.scored_by_pretraining else 1}f}, {spread}).")
  if study.note:
    lines += ["", study.note]
  return "\n".join(lines) + "\n"


def plot(study: Study, results: dict[str, list[dict]], summary: dict, path: str) -> None:
  """Pretraining loss against FLOPs (seed 0 of each arm that pretrains) and the scores."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (curves, scores) = plt.subplots(1, 2, figsize=(12, 4))
  for arm in study.arms:
    run = results[arm.name][0]
    if run["curve"]:
      per_step = run["pretrain_flops"] / max(run["pretrain_steps"], 1)
      steps, losses = zip(*run["curve"])
      curves.plot([s * per_step for s in steps], losses, ".-", label=arm.label)
  curves.set_xlabel("pretraining FLOPs")
  curves.set_ylabel("training loss (each arm's own objective)")
  curves.set_title("pretraining, seed 0")
  if curves.lines:
    curves.legend(fontsize=8)
  arms = summary["arms"]
  scores.bar([a["label"] for a in arms.values()], [a["score_mean"] for a in arms.values()],
             yerr=[a["score_std"] for a in arms.values()], capsize=4)
  scores.set_ylabel("minus pretraining eval loss" if study.scored_by_pretraining
                    else "finetuned score (%)")
  scores.set_title(study.title)
  scores.tick_params(axis="x", labelrotation=20, labelsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write(study: Study, results: dict[str, list[dict]], summary: dict, out: str) -> dict:
  """Writes study.md, study.json and study.png into out; returns their paths."""
  paths = {kind: os.path.join(out, f"study.{kind}") for kind in ("md", "json", "png")}
  atomic.write_file(paths["md"], markdown(study, summary))
  atomic.write_file(paths["json"], json.dumps({**summary, "runs": results}, indent=1))
  plot(study, results, summary, paths["png"])
  return paths
