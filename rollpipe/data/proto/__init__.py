"""``DataProto``, verl's and ROLL's batch type, as one concept in one package.

``dataproto.py`` is the class: its API reads top to bottom. The underscore modules beside it
are its private helpers (argument checks, row indices, deep equality, meta_info merging,
the TensorDict view, pickling), imported by nothing outside this package. Two public
modules go with it: ``columns`` (the 1-D object columns that rows and layouts also build)
and ``divisor`` (verl's pad-to-world-size and unpad).
"""

from rollpipe.data.proto.dataproto import DataProto
from rollpipe.data.proto.divisor import pad_to_divisor, unpad

__all__ = ["DataProto", "pad_to_divisor", "unpad"]
