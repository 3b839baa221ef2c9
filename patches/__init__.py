"""patchserve's shared library: the patch format, BitFit targets, the base encoder, the registries and the training
contract. Imported by ``patchserve.server`` and ``patchserve.trainer``; imports neither."""
