"""The codec functions' old import path, kept for code written against it: everything here is
:mod:`hsstore.format.codecs` (the codecs themselves: :mod:`hsstore.format.registry`)."""

from hsstore.format.codecs import *  # noqa: F403
from hsstore.format.codecs import __all__ as __all__
