"""patchserve's shared library: the patch format, BitFit targets, the base encoder and the registries.

Imported by ``server`` and ``trainer``; imports neither.
"""

__version__ = "0.1.0"
