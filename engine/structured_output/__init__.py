"""Structured output: JSON schemas, regexes, choices and EBNF grammars through xgrammar.

``StructuredSpec`` says what a request's output must match; ``StructuredOutputManager`` compiles
specs off the engine loop (cached by spec), fills the per-step token bitmask and follows the
sampled tokens. See docs/structured-output.md.
"""

from bulkinfer.engine.structured_output.compile import GrammarError, check_spec
from bulkinfer.engine.structured_output.manager import StructuredOutputManager
from bulkinfer.engine.structured_output.spec import StructuredSpec

__all__ = ["GrammarError", "StructuredOutputManager", "StructuredSpec", "check_spec"]
