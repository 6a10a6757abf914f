"""p2p-spes: peer-to-peer pretraining of Mixture-of-Experts language models (SPES method)."""

__version__ = "0.1.0"
