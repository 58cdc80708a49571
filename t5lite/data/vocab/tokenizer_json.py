"""Any HF fast tokenizer's `tokenizer.json` as a t5lite vocabulary: LLaMA, Mistral, Qwen,
GPT-NeoX and the other checkpoints whose folders hold no vocab.txt or vocab.json + merges.txt.

transformers saves every fast tokenizer as one tokenizer.json (normalizer, pre-tokenizer,
model, decoder, added tokens), which the `tokenizers` library -- what transformers' fast
tokenizers run on -- loads as it is. So this kind wraps that file instead of rebuilding a
pipeline, and encodes and decodes exactly as HF does. The special tokens' roles come from
tokenizer_config.json, else special_tokens_map.json (`bos_token`, `eos_token`, `unk_token`,
`pad_token`, `mask_token`, `cls_token`, `sep_token`: a string or {"content": ...}).

encode adds no special token: HF's LLaMA tokenizer prepends <s> in its post-processor, which
t5lite leaves to the model (decoding and the decoder-only feature converter put
ModelConfig.bos_id first; `t5lite import hf` takes it from config.json's bos_token_id).
decode stops at the first EOS and skips special tokens, as HF's
decode(skip_special_tokens=True) does.

  >>> v = TokenizerJsonVocabulary.from_directory("Llama-2-7b-hf")  # tokenizer.json + config
  >>> v.bos_id, v.eos_id, v.unk_id, v.pad_id
  (1, 2, 0, None)
  >>> v.save("out")  # out/vocabulary.json (kind "tokenizer_json", the roles) + tokenizer.json

A folder with LLaMA's SentencePiece `tokenizer.model` but no tokenizer.json (older
checkpoints) is converted on `t5lite import hf` by transformers, as AutoTokenizer converts
it, into this kind (t5lite.cli.imports).
"""
from __future__ import annotations

import pathlib
from typing import Any, Mapping

from tokenizers import Tokenizer

from t5lite.data.vocab.hf_vocabularies import (HF_CONFIG, _read_json, _read_text, _saved_file,
                                               _TokenizersVocabulary)
from t5lite.data.vocab.vocabularies import SPECIAL_ROLES
from t5lite.errors import ConfigError

TOKENIZER_JSON = "tokenizer.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


class TokenizerJsonVocabulary(_TokenizersVocabulary):
  """The tokenizer in `text` (a tokenizer.json's content), with `roles` {role: token} for the
  roles of SPECIAL_ROLES it has. `where` names the file in errors."""

  _kind = "tokenizer_json"

  def __init__(self, text: str, roles: Mapping[str, str], where: str = TOKENIZER_JSON):
    try:
      tokenizer = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 (tokenizers raises plain Exceptions for bad JSON)
      raise ConfigError(f"{where} is not a tokenizer.json that HF `tokenizers` loads: "
                        f"{str(e).splitlines()[0][:200]}") from None
    ids = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [None] * len(ids)
    for token, i in ids.items():
      if not 0 <= i < len(tokens) or tokens[i] is not None:
        raise ConfigError(f"{where}: token ids are not 0..{len(tokens) - 1} ({token!r} has "
                          f"id {i}); t5lite needs one token per id")
      tokens[i] = token
    super().__init__(tokens, where)
    self._text, self._roles = text, dict(roles)
    for role, token in self._roles.items():
      if role not in SPECIAL_ROLES:
        raise ConfigError(f"{where}: unknown special-token role {role!r}; roles are "
                          f"{', '.join(SPECIAL_ROLES)}")
      if token not in self._ids:
        raise ConfigError(f"{where}: {role}_token {token!r} is not one of its tokens")
    self._finish(tokenizer, self._roles)

  @classmethod
  def from_directory(cls, directory) -> TokenizerJsonVocabulary:
    """An HF tokenizer folder's tokenizer.json, with the roles its configs name."""
    directory = pathlib.Path(directory)
    path = directory / TOKENIZER_JSON
    return cls(_read_text(path, "an HF tokenizer.json"), _hf_roles(directory), str(path))

  @property
  def roles(self) -> dict[str, str]:
    """{role: token} of the special tokens."""
    return dict(self._roles)

  @property
  def tokenizer_json(self) -> str:
    """The tokenizer.json this vocabulary was made from, as it was."""
    return self._text

  def _state(self) -> dict[str, Any]:
    return dict(text=self._text, roles=self._roles)

  def _save_files(self, directory: pathlib.Path, config: dict) -> None:
    from t5lite.util import atomic
    atomic.write_file(str(directory / TOKENIZER_JSON), self._text)
    config.update(tokenizer_file=TOKENIZER_JSON, roles=self._roles)

  @classmethod
  def _load(cls, directory: pathlib.Path, config: dict) -> TokenizerJsonVocabulary:
    path = _saved_file(directory, config, "tokenizer_file", TOKENIZER_JSON)
    roles = config.get("roles", {})
    if not isinstance(roles, dict) or not all(isinstance(v, str) for v in roles.values()):
      raise ConfigError(f"{directory}/vocabulary.json: roles={roles!r} must map roles to tokens")
    return cls(_read_text(path, "a tokenizer.json"), roles, str(path))

  @classmethod
  def _load_hf_directory(cls, directory: pathlib.Path) -> TokenizerJsonVocabulary | None:
    if not (directory / TOKENIZER_JSON).is_file():
      return None
    return cls.from_directory(directory)


def _hf_roles(directory: pathlib.Path) -> dict[str, str]:
  """{role: token} from tokenizer_config.json, else special_tokens_map.json (neither: none)."""
  for name in (HF_CONFIG, SPECIAL_TOKENS_MAP):
    path = directory / name
    if not path.is_file():
      continue
    config = _read_json(path, f"an HF {name}")
    if not isinstance(config, dict):
      raise ConfigError(f"{path}: a JSON {type(config).__name__}, not an object of settings")
    roles = {}
    for role in SPECIAL_ROLES:
      token = config.get(f"{role}_token")
      if isinstance(token, dict):  # AddedToken's serialized form
        token = token.get("content")
      if token is None:
        continue
      if not isinstance(token, str) or not token:
        raise ConfigError(f"{path}: {role}_token={token!r} is not a token")
      roles[role] = token
    if roles:
      return roles
  return {}

