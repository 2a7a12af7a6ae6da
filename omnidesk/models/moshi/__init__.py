"""Kyutai's Moshi: the Mimi codec and the dual-autoregressive language model."""
