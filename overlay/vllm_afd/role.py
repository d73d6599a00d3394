"""The two AFD roles, in one home: the config, the wire, the models and the metrics all name them so."""

from __future__ import annotations

import enum

__all__ = ["Role"]


class Role(str, enum.Enum):
    """The two AFD roles; a member equals, hashes and prints as its config string ("attention", "ffn").

    NOTE: ``enum.StrEnum`` written out (it is Python 3.11+, the overlay supports 3.10): ``str()`` and
    ``format()`` give the value, so messages, metric labels and JSON read as before.
    """

    ATTENTION = "attention"
    FFN = "ffn"

    __str__ = str.__str__
    __format__ = str.__format__
