"""Errors a user can fix, told apart from bugs.

A ConfigError is a setup mistake: a flag, gin binding, task name, path, size or input file
that cannot work as given. Its message says what is wrong and, where it can, how to fix it.
`t5lite` prints it on one line (`t5lite VERB: error: ...`) and exits 2, with no traceback.
Any other exception is a bug (in t5lite or in a task's code) and keeps its traceback (exit
1). A damaged checkpoint (t5lite.runtime.integrity.CorruptCheckpointError) is a ConfigError
too: bad data on disk, named in one line, that the user fixes by hand. What the OS reports
(OSError: a missing or existing path, a file where a folder should be, no permission, a
full or read-only disk) is the environment's, told in one line with its path, exit 2.

ConfigError is a ValueError, so code that catches ValueError still catches it. Its two
subclasses are also what a lookup and an open raise: ConfigKeyError is a KeyError (an unknown
task or a tensor a checkpoint lacks), ConfigFileNotFoundError a FileNotFoundError (a MODEL_DIR
without checkpoints).

This module imports nothing, so every layer of t5lite can raise these.
"""


class ConfigError(ValueError):
  """A setup mistake the user can fix; the message says what is wrong."""


class ConfigKeyError(ConfigError, KeyError):
  """A name that is not there: an unregistered task or mixture, a tensor a checkpoint lacks.
  The message lists near names where there are some."""

  def __str__(self) -> str:
    # KeyError's own str() shows the repr of its argument: quotes around the whole message.
    return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
  """A file or folder the user named that is missing or holds nothing usable."""
