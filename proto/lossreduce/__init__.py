"""lossreduce: validated global loss normalizers for distributed RL training.

The package is spread over the repository's top-level folders (see
``pyproject.toml``): ``lossreduce.v2`` is the wire contract and its generated
binding (``proto/``), ``lossreduce.server`` the coordinator, ``lossreduce.client``
the engine-side client and ``lossreduce.trainer_worker`` the reduction library,
the Ray trainer workers and the training driver. This root package holds what
every side shares: the rules every partial and normalizer must obey
(``lossreduce.rules``), the one exception hierarchy (``lossreduce.errors``)
and its wire encoding (``lossreduce.status_codec``), the settings-to-flags
rule of every command (``lossreduce.settings_cli``) and free ports
(``lossreduce.ports``).
"""

from lossreduce._versions import check_python

# First: on an unsupported Python (a source checkout on PYTHONPATH; pip refuses to
# install there) fail here with the supported range, not on some later import or
# syntax error (Python 3.7 has no importlib.metadata, below).
check_python()

from importlib.metadata import PackageNotFoundError, version  # noqa: E402

try:
    __version__ = version("lossreduce")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
