"""Doge sidecar: the attention stays replicated under TP (transformers' head-sharded plan cannot work)."""
