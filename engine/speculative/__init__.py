"""Speculative decoding: n-gram (prompt lookup) and draft-model proposals, verified by the target so
that every row gets the tokens it would get without speculation."""

from bulkinfer.engine.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
