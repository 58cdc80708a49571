"""Many adapters, one base (t5lite.interop.peft.adapter_batch): a batch whose rows use different
LoRA adapters of one base, and rows of the base alone, decodes in one program as each row does
with its own adapter alone; `t5lite infer` / `eval` / `export serving` take a base plus
adapters."""
import json

import jax
import numpy as np
import pytest
from flax import traverse_util

import train_tasks
from helpers import BYTE_VOCAB_SIZE, tiny, tiny_decoder_only
from t5lite import cli
from t5lite.errors import ConfigError
from t5lite.interop import params_only
from t5lite.families import family_of
from t5lite.models import adapters
from t5lite.models.decoding import search as decoding
from t5lite.models.adapters import AdapterConfig
from t5lite.runtime import partitioning
from t5lite.interop.peft import adapter_batch
from t5lite.interop import frozen_model
from t5lite.interop.peft import record as peft_record

LORA = AdapterConfig(r=2, lora_alpha=4, target_modules=("query", "value", "wo"))
ROWS = ["a", "b", None, "c", "a", "b"]  # one base-only row; every adapter at least once
KINDS = {  # name -> the adapters a, b and c of a bank
    "lora": (LORA, LORA, AdapterConfig(r=2, lora_alpha=3, use_rslora=True,  # another scale
                                       target_modules=LORA.target_modules)),
    "prompt": (AdapterConfig(method="prompt_tuning", num_virtual_tokens=3,
                             prompt_init="random"),) * 3,
    "prefix": (AdapterConfig(method="prefix_tuning", num_virtual_tokens=2),) * 3,
}


def _layers(scan_layers):
  """One layer per stack unless scanned (each decode here compiles every layer once); a
  scanned stack keeps two, so that its layer axis is a real one beside the row axis."""
  return dict(scan_layers=scan_layers, num_decoder_layers=2 if scan_layers else 1)


MODELS = {"t5": lambda scan_layers=False: tiny(vocab_size=BYTE_VOCAB_SIZE,
                                                num_encoder_layers=2 if scan_layers else 1,
                                                **_layers(scan_layers)),
          "decoder_only": lambda scan_layers=False: tiny_decoder_only(**_layers(scan_layers))}


def write_base(path, config, seed=0):
  params_only.write_model_dir(str(path), config, family_of(config).init_params(seed), step=0,
                              vocabulary=train_tasks.VOCAB)
  return str(path)


def random_half(config, seed, saved=()):
  """Random non-zero adapter params (and saved modules) of an adapted config (LoRA's B = 0
  would prove nothing)."""
  rng = np.random.RandomState(seed)
  half = adapters.split(family_of(config).abstract_params(), saved)[1]
  return jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), half)


_BASES = {}  # base MODEL_DIR -> (config, params): each base here is written once, never changed


def write_run(path, base, adapter=LORA, seed=1, saved=()):
  """A PEFT RUN_DIR of `base` holding random adapters, as `t5lite import peft` writes one."""
  if base not in _BASES:
    where, base_config, host = frozen_model.read(base, role="base")
    mesh = partitioning.make_mesh(partitioning.MeshConfig())
    _BASES[base] = base_config, frozen_model.load(where, base_config, host, mesh,
                                                  partitioning.logical_axis_rules())
  base_config, base_params = _BASES[base]
  config = base_config.replace(adapter=adapter)
  params_only.write_model_dir(str(path), config, random_half(config, seed, saved), step=7,
                              vocabulary=train_tasks.VOCAB)
  peft_record.write(str(path), peft_record.make(base, base_config, base_params, adapter, saved))
  return str(path)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
  """(model, scan, kind) -> (base MODEL_DIR, {name: RUN_DIR}), written once."""
  built, bases = {}, {}

  def get(model, scan=False, kind="lora"):
    if (model, scan) not in bases:
      root = tmp_path_factory.mktemp(f"{model}_{scan}")
      bases[model, scan] = write_base(root / "base", MODELS[model](scan_layers=scan))
    base = bases[model, scan]
    if (model, scan, kind) not in built:
      root = tmp_path_factory.mktemp(f"{model}_{scan}_{kind}")
      bank = KINDS[kind]
      if scan and kind == "lora":
        # c at a's scale: one adapter config, one set of alone-decode programs. The other
        # scale folded into B is an elementwise product before stacking, checked unscanned.
        bank = (LORA,) * 3
      built[model, scan, kind] = base, {
          name: write_run(root / name, base, adapter, seed=seed)
          for seed, (name, adapter) in enumerate(zip("abc", bank), 1)}
    return built[model, scan, kind]
  return get


def prompts(config, rows, length=7, seed=0):
  """Inputs (rows, length) without ids 0 and 1; decoder-only prompts of different lengths."""
  rng = np.random.RandomState(seed)
  out = rng.randint(2, 200, (rows, length)).astype(np.int32)
  if not config.has_encoder:
    for i in range(rows):
      out[i, 3 + i % (length - 3):] = 0
  return out


def assert_close(got, want, tolerance=1e-5):
  """Within `tolerance` of the logits' scale: the per-row LoRA products are other matmuls
  (a batched einsum) than one adapter's, so float32 rounding differs in the last bits."""
  assert got.shape == want.shape
  error = np.abs(got - want).max() / max(1.0, np.abs(want).max())
  assert error <= tolerance, error


# Scanned stacks (scan: the per-row axis after the layer axis) with LoRA on t5, whose encoder
# and decoder stacks both scan, and with prefixes on a decoder-only model (its ragged prompts
# mixed per row). The per-row LoRA and soft-prompt code is the same for every architecture
# (layers.Dense, transformer.embed): t5 runs it unscanned.
@pytest.mark.parametrize("model, scan, kind", [
    ("t5", False, "lora"), pytest.param("t5", True, "lora", marks=pytest.mark.slow),
    ("t5", False, "prompt"), pytest.param("t5", False, "prefix", marks=pytest.mark.slow),
    pytest.param("decoder_only", True, "prefix", marks=pytest.mark.slow)])
def test_a_mixed_batch_decodes_as_each_row_with_its_adapter_alone(made, model, scan, kind):
  base, runs = made(model, scan, kind)
  bank = adapter_batch.load_bank(base, runs)
  config = bank.config
  assert config.scan_layers == scan
  rows = ROWS if kind == "lora" else ["a", "b", "c", "c", "a", "b"]  # no base-only row
  inputs = prompts(config, len(rows))
  mixed = bank.params_for(bank.row_ids(rows))
  # The per-row axis sits after a scanned stack's layer axis, first elsewhere.
  flat = traverse_util.flatten_dict(adapters.split(mixed)[1])
  assert flat
  for path, leaf in flat.items():
    scanned = scan and path[1] == "layers"
    assert leaf.shape[int(scanned)] == len(rows), (path, leaf.shape)
  targets = prompts(config, len(ROWS), length=5, seed=1)
  targets[:, -1] = 1
  got_logits = decoding.teacher_forced_logits(config, mixed, inputs, targets)
  got = {m: decoding.generate(config, mixed, inputs, max_decode_length=6, method=m, num_beams=3)
         for m in ("greedy", "beam")}
  differs = 0
  names = ("a", "b", "c", None) if kind == "lora" else ("a", "b", "c")
  for name in names:
    mine = [i for i, n in enumerate(rows) if n == name]
    alone, own = bank.params_of(name), bank.config_of(name)
    if name is not None:  # what peft_record.load_run of the RUN_DIR joins, bitwise
      joined = peft_record.load_run(runs[name])[1]
      for (p, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(joined),
                                jax.tree_util.tree_leaves_with_path(alone)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(p))
    want_logits = decoding.teacher_forced_logits(own, alone, inputs, targets)
    assert_close(got_logits[mine], want_logits[mine])
    for method in ("greedy", "beam"):
      want = decoding.generate(own, alone, inputs, max_decode_length=6, method=method,
                               num_beams=3)
      np.testing.assert_array_equal(got[method][mine], want[mine], err_msg=f"{name} {method}")
    others = [i for i in range(len(rows)) if rows[i] != name]
    differs += np.abs(got_logits[others] - want_logits[others]).max() > 1e-2
  assert differs == len(names)  # every adapter (and the base) gives other rows other logits
  if kind != "lora":
    with pytest.raises(ConfigError, match="a row of the base alone cannot share a batch"):
      bank.row_ids(["a", None])


# --- bad input --------------------------------------------------------------------------------

def test_bad_mixes_are_refused_by_name(made, tmp_path):
  base, runs = made("t5")
  other_base = write_base(tmp_path / "other", MODELS["t5"](), seed=5)
  cases = [
      ({"a": runs["a"], "x": write_run(tmp_path / "x", other_base)},
       r"adapters a and x adapt different bases"),
      ({"a": runs["a"], "r4": write_run(tmp_path / "r4", base, AdapterConfig(
          r=4, lora_alpha=4, target_modules=LORA.target_modules))},
       r"adapters a and r4 have different rank r \(2 vs 4\)"),
      ({"a": runs["a"], "q": write_run(tmp_path / "q", base, AdapterConfig(
          r=2, target_modules=("query",)))},
       r"adapters a and q have different target_modules"),
      ({"a": runs["a"], "plain": base}, r"adapter plain=.* is not a PEFT run"),
      ({"base": runs["a"]}, r"adapter name 'base'"),
  ]
  for given, message in cases:
    with pytest.raises(ConfigError, match=message):
      adapter_batch.load_bank(base, given)
  with pytest.raises(ConfigError, match=r"adapter x .* was trained on the base .*other"):
    adapter_batch.load_bank(base, {"x": str(tmp_path / "x")})
  with pytest.raises(ConfigError, match=r"is itself an adapted model"):
    adapter_batch.load_bank(runs["a"], {"b": runs["b"]})
  bank = adapter_batch.load_bank(base, {"a": runs["a"]})
  with pytest.raises(ConfigError, match=r"adapter 'zz' is not one of the adapters given \(a;"):
    bank.row_ids(["a", "zz"])
  with pytest.raises(ConfigError, match="NAME=RUN_DIR"):
    adapter_batch.parse_adapters("a=/x,b")
  prompt = write_run(tmp_path / "p", base, KINDS["prompt"][0])
  with pytest.raises(ConfigError, match=r"adapters a and p have different methods"):
    adapter_batch.load_bank(base, {"a": runs["a"], "p": prompt})
  mlp = write_run(tmp_path / "mlp", base, AdapterConfig(method="prefix_tuning",
                                                        num_virtual_tokens=2,
                                                        prefix_projection=True))
  with pytest.raises(ConfigError, match=r"adapter mlp .* trains its prefixes through an MLP"):
    adapter_batch.load_bank(base, {"mlp": mlp})


def test_a_run_with_saved_modules_decodes_alone_but_not_beside_others(made, tmp_path):
  base, runs = made("t5")
  saved = (("decoder", "decoder_norm"),)
  head = write_run(tmp_path / "h", base, saved=saved)
  config, params, step, bank, _ = adapter_batch.load_model(base, head, None, None, None)
  assert bank is None and step == 7
  _, joined, _ = peft_record.load_run(head)
  for (p, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(joined),
                            jax.tree_util.tree_leaves_with_path(params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(p))
  bank = adapter_batch.load_bank(base, {"h": head})
  assert bank.row_ids(["h", "h"]).tolist() == [1, 1]
  with pytest.raises(ConfigError, match=r"adapter h .* also trained whole modules "
                                        r"\(decoder/decoder_norm\)"):
    bank.row_ids(["h", None])
  with pytest.raises(ConfigError, match=r"adapter h .* also trained whole modules"):
    adapter_batch.load_bank(base, {"a": runs["a"], "h": head})


# --- t5lite infer / eval ----------------------------------------------------------------------

def infer(capsys, checkpoint, lines, tmp_path, *flags, name="out"):
  """Records `t5lite infer` writes for JSONL `lines` (dicts), or its exit code and stderr."""
  inputs, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.jsonl"
  inputs.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
  code = cli.main(["infer", "--gin_file=gin/runs/infer.gin", f"--gin.CHECKPOINT_PATH={checkpoint}",
                   f"--gin.INFER_INPUT={inputs}", f"--gin.INFER_OUTPUT={out}",
                   "--gin.INPUTS_LENGTH=16", "--gin.MAX_DECODE_LENGTH=6", "--gin.BATCH_SIZE=4",
                   *flags])
  if code:
    return code, capsys.readouterr().err
  return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


TEXTS = ["alpha beta", "gamma delta", "eta theta zeta", "the a", "epsilon", "beta alpha"]


def test_infer_mixes_adapters_per_line_as_each_decodes_alone(made, tmp_path, capsys):
  base, runs = made("t5")
  names = ["a", "b", "base", None, "b", "a"]  # None: no field, --adapter's (a)
  lines = [{"inputs": t, **({} if n is None else {"adapter": n})} for t, n in zip(TEXTS, names)]
  mixed = infer(capsys, base, lines, tmp_path, "--adapters", f"a={runs['a']},b={runs['b']}",
                "--adapter", "a", name="mixed")
  assert [r["adapter"] for r in mixed] == ["a", "b", "base", "a", "b", "a"]
  plain = [{"inputs": t} for t in TEXTS]
  alone = {"a": infer(capsys, base, plain, tmp_path, "--adapter", runs["a"], name="a"),
           "b": infer(capsys, base, plain, tmp_path, f"--adapter={runs['b']}", name="b"),
           "base": infer(capsys, base, plain, tmp_path, name="base")}
  # A PEFT RUN_DIR as the checkpoint (joined with the base its peft.json names) still works.
  assert infer(capsys, runs["a"], plain, tmp_path, name="run") == alone["a"]
  for i, record in enumerate(mixed):
    assert record["prediction"] == alone[record["adapter"]][i]["prediction"], record
  assert len({r["prediction"] for r in mixed}) > 1
  assert alone["a"] != alone["b"] and alone["a"] != alone["base"]


def test_infer_refuses_bad_adapters_with_exit_2(made, tmp_path, capsys):
  base, runs = made("t5")
  lines = [{"inputs": "alpha", "adapter": "zz"}]
  code, err = infer(capsys, base, lines, tmp_path, "--adapters", f"a={runs['a']}")
  assert code == 2 and "line 1: adapter 'zz' is not one of --adapters a" in err
  code, err = infer(capsys, base, lines, tmp_path)
  assert code == 2 and "line 1 names the adapter 'zz', but no adapters were given" in err
  r4 = write_run(tmp_path / "r4", base, AdapterConfig(r=4, target_modules=LORA.target_modules))
  code, err = infer(capsys, base, [{"inputs": "alpha"}], tmp_path, "--adapters",
                    f"a={runs['a']},r4={r4}")
  assert code == 2 and "adapters a and r4 have different rank r (2 vs 4)" in err
  other = write_base(tmp_path / "other", MODELS["t5"](), seed=5)
  code, err = infer(capsys, other, [{"inputs": "alpha"}], tmp_path, "--adapter", runs["a"])
  assert code == 2 and f"adapter default ({runs['a']}) was trained on the base {base}" in err
  code, err = infer(capsys, base, [{"inputs": "alpha"}], tmp_path, "--adapters", "a")
  assert code == 2 and "expected NAME=RUN_DIR" in err
  _, prompts_ = made("t5", False, "prompt")  # soft prompts: every row names its own
  code, err = infer(capsys, base, [{"inputs": "alpha", "adapter": "a"}, {"inputs": "beta"}],
                    tmp_path, "--adapters", f"a={prompts_['a']},b={prompts_['b']}")
  assert code == 2 and "a row of the base alone cannot share a batch with prompt_tuning" in err


def test_eval_takes_a_base_plus_an_adapter(made, tmp_path, capsys):
  from t5lite.data.registry import TaskRegistry
  from t5lite.eval import metrics
  base, runs = made("t5")
  task = TaskRegistry.get("train_test_copy")
  object.__setattr__(task, "metric_fns", (metrics.sequence_accuracy,))
  try:
    argv = ["eval", "--gin_file=gin/runs/eval.gin", "--gin.MIXTURE_OR_TASK_NAME=train_test_copy",
            "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 6}",
            "--gin.EvalConfig.max_examples=4", "--gin.BATCH_SIZE=4"]
    assert cli.main(argv + [f"--gin.CHECKPOINT_PATH={base}", "--adapter", runs["a"]]) == 0
    assert f"adapter {runs['a']} at step 7 on the base {base}" in capsys.readouterr().out
    got = (tmp_path / "x").parent / runs["a"] / "eval" / "train_test_copy-7.jsonl"
    got = [json.loads(line) for line in open(got)]
    assert cli.main(argv + [f"--gin.CHECKPOINT_PATH={runs['a']}",
                            f"--gin.EVAL_OUTPUT_DIR={tmp_path / 'joined'}"]) == 0
    want = [json.loads(line) for line in open(tmp_path / "joined" / "train_test_copy-7.jsonl")]
    assert got == want and len(got) == 4
    assert cli.main(argv + [f"--gin.CHECKPOINT_PATH={runs['a']}", "--adapter", runs["b"]]) == 2
    assert "is itself an adapted model" in capsys.readouterr().err
  finally:
    object.__setattr__(task, "metric_fns", ())


# --- t5lite export serving --------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.slow
def test_serving_exports_a_joined_run_and_per_row_adapters(made, tmp_path, capsys):
  """Shapes and settings as in the mixed-batch test (inputs (6, 7), 6 tokens, 3 beams): the
  decodes it is compared with are programs that test compiles too."""
  from t5lite.interop.serving import serving_loader
  base, runs = made("t5")
  common = ["--input_length", "7", "--max_decode_length", "6", "--num_beams", "3"]
  # A PEFT RUN_DIR as --checkpoint: the joined model, as peft_record.load_run joins it.
  assert cli.main(["export", "serving", "--checkpoint", runs["a"], "--out",
                   str(tmp_path / "joined"), "--methods", "greedy", *common]) == 0
  joined_config, joined, _ = peft_record.load_run(runs["a"])
  model = serving_loader.ServingModel.load(tmp_path / "joined")
  assert model.adapters is None
  inputs = prompts(joined_config, len(ROWS))
  np.testing.assert_array_equal(model.generate(inputs), decoding.generate(
      joined_config, joined, inputs, max_decode_length=6))
  # A base and several adapters: one program, one adapter per row.
  assert cli.main(["export", "serving", "--checkpoint", base, "--out", str(tmp_path / "mixed"),
                   "--adapters", f"a={runs['a']},b={runs['b']},c={runs['c']}", *common]) == 0
  model = serving_loader.ServingModel.load(tmp_path / "mixed")
  assert model.adapters == ["base", "a", "b", "c"]
  assert model.manifest["default_adapter"] == "base"
  bank = adapter_batch.load_bank(base, {k: runs[k] for k in "abc"})
  rows = [n or "base" for n in ROWS]
  for method in ("greedy", "beam"):
    want = decoding.generate(bank.config, bank.params_for(bank.row_ids(ROWS)), inputs,
                             max_decode_length=6, method=method, num_beams=3)
    np.testing.assert_array_equal(model.generate(inputs, method, adapters=rows), want)
  np.testing.assert_array_equal(  # one name for every row; none: the base alone
      model.generate(inputs, adapters="b"), decoding.generate(
          bank.config_of("b"), bank.params_of("b"), inputs, max_decode_length=6))
  # Another batch size (the export's batch is symbolic).
  np.testing.assert_array_equal(model.generate(inputs[:2]), model.generate(inputs[:2],
                                                                            adapters="base"))
  with pytest.raises(ValueError, match=r"adapters \['zz'\] are not in this artifact"):
    model.generate(inputs[:1], adapters=["zz"])
  assert cli.main(["export", "serving", "--checkpoint", base, "--out", str(tmp_path / "bad"),
                   "--adapters", f"a={runs['a']},plain={base}", *common]) == 2
  assert f"adapter plain={base} is not a PEFT run" in capsys.readouterr().err
