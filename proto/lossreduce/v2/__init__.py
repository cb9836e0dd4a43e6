"""The wire contract (``coordinator.proto``) and its generated binding.

The binding checks the protobuf runtime itself, with a ``VersionError`` deep in the
first import that reaches it; this package checks first, against the supported range
(``lossreduce._versions``), so the error names the installed version and what to install.
"""

import google.protobuf

from lossreduce._versions import check_protobuf

check_protobuf(google.protobuf.__version__)
