"""model_config.json files of older t5lite versions, read as today's ModelConfig: the ELECTRA
and SpanBERT options that were top-level fields before they moved into their sub-configs
(ModelConfig.electra, ModelConfig.span_boundary), so existing MODEL_DIRs keep loading; and
the gin names of the moved fields, for the error a binding of an old name gets."""
from __future__ import annotations

from typing import Any

from t5lite.errors import ConfigError

# The moved top-level keys (ModelConfig.from_dict maps them: upgrade_legacy_keys).
LEGACY_ELECTRA_KEYS = ("replaced_token_detection", "generator_hidden_fraction",
                       "discriminator_loss_weight")
LEGACY_SPAN_BOUNDARY_KEYS = ("span_boundary_objective", "max_span_length")
MOVED_FIELDS = {  # old ModelConfig field -> its binding now (for gin's error messages)
    "replaced_token_detection": "ModelConfig.electra = @ElectraConfig() (None: False)",
    "generator_hidden_fraction": "ElectraConfig.generator_hidden_fraction",
    "discriminator_loss_weight": "ElectraConfig.discriminator_loss_weight",
    "span_boundary_objective": "ModelConfig.span_boundary = @SpanBoundaryConfig() (None: False)",
    "max_span_length": "SpanBoundaryConfig.max_span_length",
}


def upgrade_legacy_keys(values: dict[str, Any]) -> dict[str, Any]:
  """values with the top-level ELECTRA and SpanBERT keys of older model_config.json files
  (LEGACY_*_KEYS) moved into the sub-configs that hold them now, so that MODEL_DIRs written
  before the move load as the same model. An old file wrote all five keys, defaults included:

    replaced_token_detection true   -> electra {generator_hidden_fraction,
                                                discriminator_loss_weight}; false -> null
    span_boundary_objective true    -> span_boundary {max_span_length}; false -> null

  Values that only applied with the objective off (a max_span_length, a loss weight of a
  model without the discriminator head) changed nothing and are dropped. A dict that also
  has the new key is refused: which of the two holds is ambiguous."""
  old = [k for k in LEGACY_ELECTRA_KEYS + LEGACY_SPAN_BOUNDARY_KEYS if k in values]
  if not old:
    return values
  values = dict(values)
  legacy = {k: values.pop(k) for k in old}
  electra_keys = [k for k in old if k in LEGACY_ELECTRA_KEYS]
  if electra_keys:
    _refuse_both(values, electra_keys, "electra", "ElectraConfig")
    fraction = legacy.get("generator_hidden_fraction", 0.0)
    if legacy.get("replaced_token_detection", False):
      values["electra"] = {"generator_hidden_fraction": fraction,
                           "discriminator_loss_weight":
                               legacy.get("discriminator_loss_weight", 50.0)}
    elif fraction:
      raise ConfigError(f"generator_hidden_fraction={fraction} with replaced_token_detection="
                        "false: the generator trains beside ELECTRA's discriminator; use "
                        f"electra={{'generator_hidden_fraction': {fraction}}}")
    else:
      values["electra"] = None
  span_keys = [k for k in old if k in LEGACY_SPAN_BOUNDARY_KEYS]
  if span_keys:
    _refuse_both(values, span_keys, "span_boundary", "SpanBoundaryConfig")
    values["span_boundary"] = ({"max_span_length": legacy.get("max_span_length", 10)}
                               if legacy.get("span_boundary_objective", False) else None)
  return values


def _refuse_both(values: dict[str, Any], old_keys: list[str], field: str, sub_config: str):
  """Old keys beside their new sub-config field: which of the two holds is ambiguous."""
  if field in values:
    raise ConfigError(f"ModelConfig fields {old_keys} (model_config.json before the "
                      f"{sub_config}) and {field}={values[field]!r} are both set: keep "
                      f"{field} only")
